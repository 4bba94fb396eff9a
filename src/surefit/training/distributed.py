"""Sharding a model over processes: DDP through accelerate, or FSDP2 with ``--sharding fsdp``, and how a global batch
is cut over processes. Who this process is and what the processes agree on (barriers, sums, the main process's
values) is ``training/processes.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from surefit.errors import Problem
from surefit.training.processes import is_main_process, quiet

# ------------------------------------------------------------------------------------------------------------ FSDP2
#
# ``--sharding fsdp``: surefit applies PyTorch's FSDP2 (``fully_shard``) itself, to each transformer block and then
# to the whole model, rather than through accelerate's FSDP plugin, which switches itself off on a CPU (it reports
# MULTI_CPU): a CPU run over gloo and a GPU run over NCCL take the same code. Each process then holds 1/N of every
# parameter, gradient and optimizer state; a block's full parameters exist only during its forward and backward.
# What needs the whole model (evaluation and generation, an epoch checkpoint's model/, the final save) goes through
# :func:`gathered`; checkpoints are written shard by shard (:func:`save_sharded`).


def fsdp_blocks(model: Any) -> list[Any]:
    """The modules to shard one by one: the transformer blocks (the classes a transformers model names in
    ``_no_split_modules``), else the items of the model's longest ``nn.ModuleList`` (a custom model's layers)."""
    from torch import nn

    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if blocks:
        return blocks
    lists = sorted((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, reverse=True)
    return list(lists[0]) if lists else []


def shard_model(model: Any, device: Any, say: Callable[[str], None] = quiet) -> Any:
    """``fully_shard`` each block of ``model`` (:func:`fsdp_blocks`), then the model itself, over every process.

    A run of one process forms a group of one, so that it takes the same path (and writes the same checkpoints) as a
    run of several. Blocks free their full parameters after the forward (gathered again in the backward); the root
    keeps them (the embeddings and head are needed again at once).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0,
                                world_size=1)
    n = dist.get_world_size()
    mesh = init_device_mesh(device.type, (n,))
    blocks = fsdp_blocks(model)
    kinds = sorted({type(b).__name__ for b in blocks})
    say(f"--sharding fsdp: {len(blocks)} blocks ({', '.join(kinds) or 'none found'}) and then the rest of the model "
        f"sharded over {n} process{'es' if n > 1 else ''}: each holds 1/{n} of the parameters, gradients and "
        "optimizer states")
    for block in reversed(blocks):  # inner ones first, should a block class nest inside another
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded by :func:`shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _fsdp_modules(model: Any) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gather_on_main(model: Any) -> list[Any]:
    """All-gather ``model``'s full parameters (every process must call it); the main process keeps them, as plain
    tensors, until :func:`release` (evaluation, generation and ``save_pretrained`` then run there alone, with no
    collective), the others free theirs at once. Returns the sharded modules (nothing for a model not sharded)."""
    if not is_sharded(model):
        return []
    modules = _fsdp_modules(model)
    for m in modules:
        m.unshard()
    if not is_main_process():
        for m in modules:
            m.reshard()
    else:
        model.set_reshard_after_forward(False)  # a forward must not free what the main process cannot gather alone
        _state_dict_hooks(modules, on=False)
    return modules


def _state_dict_hooks(modules: list[Any], on: bool) -> None:
    """FSDP2 hooks ``state_dict()`` to swap the sharded parameters back in first, so ``save_pretrained`` of a
    gathered model would write shards; while the main process holds the full parameters they are taken off (torch
    has no public switch for them: this uses its parameter groups' own registration)."""
    for m in modules:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            if on:
                group._register_state_dict_hooks()
                continue
            for handles in (group._module_to_pre_save_state_dict_hook_handle,
                            group._module_to_pre_load_state_dict_hook_handle):
                for handle in handles.values():
                    handle.remove()
                handles.clear()


def release(model: Any, modules: list[Any]) -> None:
    """Undo :func:`gather_on_main` on the main process (free the full parameters; blocks reshard after forward)."""
    if not modules or not is_main_process():
        return
    _state_dict_hooks(modules, on=True)
    for m in modules:
        m.reshard()
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)


@contextmanager
def gathered(model: Any) -> Iterator[None]:
    """:func:`gather_on_main` for the block's length (every process must enter; a model not sharded is untouched)."""
    modules = gather_on_main(model)
    try:
        yield
    finally:
        release(model, modules)


def gradient_sync(model: Any, sync: bool) -> None:
    """FSDP2: whether the next backward reduce-scatters the gradients (``False``: they accumulate unsharded until a
    step's last micro-batch). It acts in the backward, so it is set, not scoped, and every micro-batch sets it."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)


def local(t: Any) -> Any:
    """This process's part of a sharded tensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm(params: list[Any], max_norm: float) -> float:
    """The gradients' global L2 norm, after clipping them to ``max_norm`` (0: no clipping). Works on sharded
    gradients: each process's part of the norm is summed over the processes (``full_tensor``), so every process
    clips by the same factor, the one a single process would use."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return float(total)


def load_full_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Give a sharded run's optimizer a whole state saved in the unsharded layout (``optimizer.pt``, numbered
    parameters; the checkpoints of sharded runs before their sharded layout); each process keeps its shard of it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    current: dict[str, Any] = get_optimizer_state_dict(model, optimizer)
    names = [name for group in current["param_groups"] for name in group["params"]]
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    osd: dict[str, Any] = {"state": {names[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def load_full_weights(model: Any, tensors: dict[str, Any]) -> None:
    """Load whole tensors (a checkpoint's ``trainable.safetensors``) into a sharded model: each process keeps its
    shard of each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))


# ------------------------------------------------------------------------------------------------ sharded checkpoints
#
# Under FSDP each process writes its own shard of the weights and optimizer state with torch.distributed.checkpoint
# (DCP), so no process ever holds the whole optimizer state (nor, for a step checkpoint, the whole model). DCP
# records which slice of each tensor a file holds, so a checkpoint written by N processes loads into any number.
# DCP's reader unpickles its ``.metadata`` and its planner ``torch.load``s the non-tensor values with
# ``weights_only=False``: a run folder is data, so both are replaced by readers that allow plain values and DCP's own
# metadata classes only.

# What pickle may build from a DCP ``.metadata``: its dataclasses and the values they hold (dtypes, sizes, paths).
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                              "StorageMeta", "MetadataIndex"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


def read_dcp_metadata(path: Any) -> Any:
    """A DCP ``.metadata`` file, unpickled with only DCP's metadata classes and plain values allowed (anything else,
    such as a function to call, raises ``pickle.UnpicklingError`` naming it)."""
    import pickle

    import torch

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name in _DCP_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")

    with open(path, "rb") as fh:
        return Restricted(fh).load()


def _dcp_reader(folder: Any) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)


def _dcp_planner() -> Any:
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            # Non-tensor values (the optimizer's hyper-parameters) are numbers, tuples and flags: weights_only.
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return Planner()


def _sharded_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """This process's shard of the trainable weights and buffers (frozen weights come from the base model) and of
    the optimizer state, keyed by parameter names (so any number of processes can read it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model, options=options)}
    weights, optim = get_state_dict(model, optimizer, options=options)
    return {"model": weights, "optimizer": optim}


def save_sharded(model: Any, optimizer: Any, folder: Any) -> list[str]:
    """Every process writes its shard of ``model``'s trainable weights and ``optimizer``'s state into ``folder``
    (DCP: ``__RANK_0.distcp`` per process, ``.metadata`` by the main one); a collective. Each file is fsynced.
    Returns the files this process wrote (names in ``folder``)."""
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer), storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return sorted(p.name for p in Path(folder).glob(f"__{rank}_*.distcp"))


def load_sharded(model: Any, optimizer: Any, folder: Any) -> None:
    """Load a checkpoint :func:`save_sharded` wrote, by any number of processes, into this run's shards (DCP cuts
    each saved tensor to the slices this process holds); a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _sharded_state(model, optimizer)  # the targets: DCP loads into them in place
    dcp.load(state, storage_reader=_dcp_reader(folder), planner=_dcp_planner())
    options = StateDictOptions(ignore_frozen_params=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"], options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)


def gather_json(value: Any) -> list[Any]:
    """Every process's ``value`` (anything JSON can hold), in process order, on every process; sent as JSON bytes,
    never pickled."""
    import torch
    import torch.distributed as dist

    from surefit.training.processes import state, world_size

    if world_size() <= 1 or not dist.is_initialized():
        return [value]
    device = state().device
    data = json.dumps(value).encode("utf-8")
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    buf = torch.zeros(int(size.item()) + 8, dtype=torch.uint8, device=device)
    buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buf)
    out = []
    for part in parts:
        raw = part.cpu().numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        out.append(json.loads(raw[8:8 + n].decode("utf-8")))
    return out


def plain_architectures(folder: Any) -> None:
    """``save_pretrained`` of a sharded model records its class as ``FSDP<Class>``: write the model's own class in
    the saved ``config.json`` files, so the folder reads as one saved without sharding."""
    from pathlib import Path

    for path in Path(folder).rglob("config.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        arch = data.get("architectures") if isinstance(data, dict) else None
        if isinstance(arch, list) and any(isinstance(a, str) and a.startswith("FSDP") for a in arch):
            data["architectures"] = [a[4:] if isinstance(a, str) and a.startswith("FSDP") else a for a in arch]
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def process_micro_batches(batch_size: int, micro_batch_size: int, processes: int) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` of one process: its share of a step is at most ``ceil(batch / processes)``
    examples, cut into micro-batches of at most ``micro_batch_size`` (the most one process runs at once).

    One process: ``(micro_batch_size, batch_size / micro_batch_size)``, as configured.
    """
    share = math.ceil(batch_size / processes)
    micro = max(1, min(micro_batch_size, share))
    return micro, math.ceil(share / micro)


def describe_processes(batch_size: int, micro_batch_size: int, processes: int) -> str:
    """How a global batch is split over processes and micro-batches, and what was done where it does not divide."""
    micro, accum = process_micro_batches(batch_size, micro_batch_size, processes)
    share, extra = divmod(batch_size, processes)
    if micro * accum * processes == batch_size:
        return (f"{processes} processes: batch {batch_size} = micro-batch {micro} x accumulation {accum} x "
                f"{processes} processes (each step's examples are dealt to the processes by tokens; the same run as "
                "one process)")
    if not extra:
        dealt = f"{share} to each process"
    elif extra == 1:
        dealt = f"{share + 1} to one process, {share} to the other{'s' if processes > 2 else ''}"
    else:
        dealt = f"{share + 1} to {extra} processes, {share} to the other{'s' if processes - extra > 1 else ''}"
    cut = " + ".join(str(min(micro, share + (extra > 0) - i)) for i in range(0, share + (extra > 0), micro))
    return (f"{processes} processes: batch {batch_size} is not micro-batch x accumulation x processes exactly; it "
            f"stays {batch_size}: each step's examples are dealt by tokens ({dealt}) and cut into micro-batches of "
            f"at most {micro} (the largest share runs as {cut}). The loss is normalised by the whole step's count, so the update is the "
            "one a single process would make; a last step with fewer examples than processes leaves some without "
            "any (they run a zero-weight pass)")


def refuse_sharded(accelerator: Any, sharding: str = "none") -> None:
    """Sharding by accelerate itself is refused: its FSDP plugin and DeepSpeed wrap the model in their own engines,
    whose checkpoints, evaluation and saving the loop does not drive. ``--sharding fsdp`` shards the model in
    surefit's own code (FSDP2) and is the way to shard; an accelerate FSDP config is accepted with it (only its
    process settings are used)."""
    kind = str(getattr(accelerator, "distributed_type", "NO")).split(".")[-1]
    if kind == "FSDP" and sharding == "fsdp":
        return
    if kind in ("FSDP", "DEEPSPEED"):
        from surefit.errors import ConfigError

        how = ("add --sharding fsdp (surefit then shards the model itself with FSDP2: parameters, gradients and "
               "optimizer states; the accelerate config's fsdp_config is not used)" if kind == "FSDP" else
               "use --sharding fsdp instead (FSDP2 in surefit's own loop: parameters, gradients and optimizer states "
               "sharded, exact resume), e.g. surefit train --num_processes N --sharding fsdp, or accelerate launch "
               "--config_file examples/accelerate/fsdp.yaml -m surefit train ... --sharding fsdp")
        raise ConfigError(Problem(
            f"accelerate is set up for {kind}, which surefit's loop does not train through: its checkpoints, "
            "evaluation and final save read the whole model and optimizer, and under "
            f"{kind} (accelerate's engine) each process holds only a shard of them",
            "accelerate config", how))


def refuse_fsdp_fp16(accelerator: Any) -> None:
    """fp16 needs a loss scaler that knows gradients are sharded; surefit's FSDP path supports bf16 and fp32."""
    if getattr(accelerator, "scaler", None) is not None:
        from surefit.errors import ConfigError

        raise ConfigError(Problem("--sharding fsdp with fp16 mixed precision (a loss scaler over sharded gradients "
                                  "is not supported)", "--precision",
                                  "use --precision bf16 (GPUs from Ampere on) or --precision fp32"))


def tell_ddp_about_unused(model: Any, first_batch: Callable[[], dict[str, Any]], loss_fn: Callable[..., Any],
                          accelerator: Any, say: Callable[[str], None]) -> None:
    """DDP must be told about trainable parameters that get no gradient, or it fails at the next step; looking for
    them walks the autograd graph every step, so it is only switched on when a first forward and backward finds some."""
    if getattr(accelerator, "ddp_handler", None) is None:
        return
    unused = unused_parameters(model, first_batch, loss_fn, accelerator)
    accelerator.ddp_handler.find_unused_parameters = bool(unused)
    if unused:
        say(f"{len(unused)} trainable parameters get no gradient (e.g. {unused[0]}): DDP looks for them every step")


def unused_parameters(model: Any, first_batch: Callable[[], dict[str, Any]], loss_fn: Callable[..., Any],
                      accelerator: Any) -> list[str]:
    """Trainable parameters that a forward and backward of the first example leave without a gradient (a pooler under
    a head that ignores it, say). The random generators and the buffers (BatchNorm statistics) are put back."""
    import torch

    model.to(accelerator.device)
    model.zero_grad(set_to_none=True)
    device = torch.device(accelerator.device)
    devices = [device.index or 0] if device.type == "cuda" else []
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    with torch.random.fork_rng(devices=devices):
        batch = {k: v.to(device) for k, v in first_batch().items()}
        with accelerator.autocast():
            loss, _ = loss_fn(model, batch)
        loss.backward()
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    return names
