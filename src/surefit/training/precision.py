"""Precision and dtype choices: the compute precision (autocast), how frozen weights are stored, how activations
saved for the backward pass are stored, and the CPU's denormal handling.

With LoRA under mixed precision the frozen base computes in 16 bits while the adapters, their contribution and the
loss stay fp32 (``training/speedups/lora_fast.py``), so such a run learns as in fp32 (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16 or AMX): only then is bf16 faster on a CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_precision(precision: str, lora: bool = False) -> str:
    """``auto`` -> bf16 on GPUs that support it, fp16 on other GPUs; on a CPU, bf16 for LoRA runs when the CPU has
    native bf16 matmuls, fp32 otherwise. Returns accelerate's name.

    Why LoRA only on a CPU: with LoRA the 16-bit part is the frozen base's matmuls, while the adapters, their
    contribution and the loss stay fp32 (``training/speedups/lora_fast.py``), so the run learns as in fp32 (benchmarks/
    cpu_sft.py: final loss within noise of fp32). Full fine-tuning under autocast rounds small updates of the weights
    away in the forward pass; there fp32 stays the CPU default, where speed is not worth the difference.
    """
    if precision == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if lora and cpu_has_bf16_matmul() else "no"
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]


def make_accelerator(precision: str, *, lora: bool = False, report_to: Sequence[str] = (),
                     project_dir: str | Path | None = None) -> Any:
    """The run's accelerator; ``lora``: only adapters train (see :func:`resolve_precision`); ``report_to`` names
    experiment trackers (``tensorboard``, ``wandb``), which log under ``project_dir`` (``project_dir/tensorboard``)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    mixed = resolve_precision(precision, lora)
    if AcceleratorState._shared_state.get("_mixed_precision", mixed) != mixed:
        # accelerate allows one precision per process; a later run in the same process (the Python API, a notebook:
        # an sft run resolving auto to bf16, then a classify run to fp32) starts its state afresh. The process
        # group, if any, is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
    if not report_to:
        return Accelerator(mixed_precision=mixed, **_process_settings())
    from accelerate.utils import ProjectConfiguration

    from surefit.training.trackers import TENSORBOARD_DIR

    folder = Path(project_dir or ".")
    project = ProjectConfiguration(project_dir=str(folder), logging_dir=str(folder / TENSORBOARD_DIR))
    return Accelerator(mixed_precision=mixed, log_with=list(report_to), project_config=project,
                       **_process_settings())


def _process_settings() -> dict[str, Any]:
    """How several processes are set up (no effect on one process).

    ``cpu``: without a GPU, accelerate only forms a group of CPU processes (gloo) when told it runs on the CPU.
    ``find_unused_parameters``: decided before the model is wrapped (``distributed.tell_ddp_about_unused``).
    ``timeout``: the others wait while the main process evaluates.
    """
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from surefit.training.processes import WAIT, cpu_processes

    return {"cpu": cpu_processes(),
            "kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=True),
                                InitProcessGroupKwargs(timeout=WAIT)]}


_flushing = 0  # how many flush_denormals contexts are open


@contextmanager
def flush_denormals(device: Any):
    """On a CPU, treat denormal floats (below 1.2e-38) as zero while training.

    x86 CPUs compute with denormals through a microcode slow path. Under bf16 base matmuls they turn up often enough
    that an epoch of ``benchmarks/cpu_sft.py`` (SmolLM2-135M, LoRA) ran 1.23x faster with flushing, with the same
    losses to 4 decimals (fp32 runs were unaffected either way). GPUs flush in most kernels already. torch can set
    this process-wide flag but not read it, so it is switched back off afterwards, torch's default.
    """
    global _flushing
    on = getattr(device, "type", None) == "cpu" and torch.set_flush_denormal(True)
    _flushing += bool(on)
    try:
        yield
    finally:
        _flushing -= bool(on)
        if on and not _flushing:  # nested (the runner's around fit's): the outermost switches it off
            torch.set_flush_denormal(False)


# On a GPU, the order in which scaled_dot_product_attention tries its kernels while surefit trains. torch puts cuDNN's
# first on Hopper and Blackwell; cuDNN builds an execution graph for every new (batch, length) shape (tens of ms of
# host time, once per thread: forward and backward each) and spends about 2-3 ms of host time per call. Training
# batches change length every step, and an H200 run spent more host time there than the GPU spent on the whole step
# (results/h200/README.md). Flash and memory-efficient attention take any length at a small, fixed host cost.
ATTENTION_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


@contextmanager
def attention_kernels(device: Any, order: Sequence[str] | None = ATTENTION_ORDER):
    """On a CUDA device, try attention kernels in ``order`` (None: torch's own order). Backends the user switched off
    (``torch.backends.cuda.enable_*_sdp(False)``) stay off. The order is process-wide in torch, so it is set for the
    duration and restored afterwards; it covers the backward pass and any recomputation, which run on other threads."""
    if getattr(device, "type", None) != "cuda" or not order or not hasattr(torch._C, "_set_sdp_priority_order"):
        yield  # (a torch without settable kernel priorities keeps its own order)
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = torch.backends.cuda
    enabled = {"FLASH_ATTENTION": backends.flash_sdp_enabled(), "EFFICIENT_ATTENTION": backends.mem_efficient_sdp_enabled(),
               "CUDNN_ATTENTION": backends.cudnn_sdp_enabled(), "MATH": backends.math_sdp_enabled()}
    chosen = [getattr(SDPBackend, name) for name in order if enabled.get(name)]
    if not chosen:  # every listed kernel switched off by the user: theirs to decide
        yield
        return
    saved = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel(chosen, set_priority=True):
            yield
    finally:  # sdpa_kernel restores the order of the enabled kernels only: a switched-off one would move to the end
        torch._C._set_sdp_priority_order(saved)


@contextmanager
def device_settings(device: Any):
    """The process-wide settings a training run holds while it runs on ``device`` (:func:`flush_denormals` on a CPU,
    :func:`attention_kernels` on a GPU), restored afterwards."""
    with flush_denormals(device), attention_kernels(device, ATTENTION_ORDER):
        yield


def saved_activations_in(dtype: str | None, store: Callable[[torch.dtype], Any] | None) -> Any:
    """The context a forward runs in: ``store`` (handed in by the task) keeping saved activations in ``dtype``."""
    if dtype is None:
        return nullcontext()
    if store is None:
        raise ValueError(f"saved activations in {dtype} were asked for, but no activation store was handed in")
    return store({"bf16": torch.bfloat16}[dtype])


def holds_bf16(device: torch.device) -> bool:
    """Whether ``device`` can store bf16 tensors (casts only: GPUs without bf16 arithmetic, Turing's T4 and GTX 16xx,
    V100, convert in software, which is all that storing saved activations needs)."""
    try:
        torch.ones(1, device=device).to(torch.bfloat16).float()
    except (RuntimeError, TypeError):  # pragma: no cover - a backend without bf16 storage
        return False
    return True


def store_frozen_in(model: Any, dtype: torch.dtype) -> int:
    """Store frozen ``nn.Linear`` and ``nn.Embedding`` weights in ``dtype`` (autocast would cast the Linear ones to it
    at every matmul anyway). Returns bytes saved.

    Norms and everything trainable stay as they are. An embedding's lookups come out in its old dtype (fp32): the
    values are rounded to ``dtype`` once, the residual stream stays fp32. Why embeddings too: a tied output layer
    (SmolLM2, Qwen3-0.6B) otherwise has autocast cast the whole fp32 table to 16 bits at every forward and keep that
    copy for the backward pass (57 MB for SmolLM2-135M), on top of the fp32 table itself (113 MB). A weight shared
    with any other kind of module, or trainable, is left alone.
    """
    users: dict[int, list[Any]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            users.setdefault(id(p), []).append(m)
    kinds = (torch.nn.Linear, torch.nn.Embedding)
    saved, converted = 0, set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, kinds) or not isinstance(w, torch.nn.Parameter) or w.requires_grad \
                or not all(isinstance(u, kinds) for u in users.get(id(w), [])):
            continue
        if w.dtype == torch.float32:  # (a tied weight is met twice: converted at the first meeting)
            before = w.numel() * w.element_size()
            w.data = w.data.to(dtype)
            saved += before - w.numel() * w.element_size()
            converted.add(id(w))
        if isinstance(m, torch.nn.Linear) and m.bias is not None and not m.bias.requires_grad \
                and m.bias.dtype == torch.float32:
            m.bias.data = m.bias.data.to(dtype)
        # (an embedding loaded in ``dtype`` already, models.load_causal_lm, gets the same fp32 lookups)
        if isinstance(m, torch.nn.Embedding) and (id(w) in converted or w.dtype == dtype) \
                and not hasattr(m, "_surefit_lookup_in"):
            m._surefit_lookup_in = torch.float32  # type: ignore[assignment]  # a new attribute on the module
            m.register_forward_hook(_lookup_in_fp32)
    if saved:
        _own_copies(model, dtype)
    return saved


def _lookup_in_fp32(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.to(module._surefit_lookup_in) if output.is_floating_point() else output


def _own_copies(model: Any, dtype: torch.dtype) -> None:
    """Copy the frozen CPU tensors left in their dtype (embeddings, norms, buffers) out of the checkpoint file.

    Weights are loaded from safetensors by memory-mapping the file, and the whole mapping lives while any tensor
    still points into it: once the Linear weights have 16-bit copies, the fp32 embedding alone kept the file's pages
    resident, counted in the process's memory on top of the copies (docs/performance.md).
    """
    done: set[int] = set()
    for m in model.modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if id(t) in done or t.device.type != "cpu" or t.requires_grad or t.dtype == dtype:
                continue
            done.add(id(t))
            t.data = t.data.clone()


def precision_name(accelerator: Any) -> str:
    """accelerate calls fp32 "no"; users set and read "fp32"."""
    name = str(accelerator.mixed_precision)
    return "fp32" if name == "no" else name




def autocast_where(model: Any, accelerator: Any) -> Any:
    """The run's autocast for the device the model's weights are on now. accelerate's autocast is the accelerator
    device's: a model still on the CPU under a GPU run (a sharded run, before ``prepare``) would get none, and its
    16-bit frozen weights would meet fp32 inputs."""
    import torch

    params = model.parameters() if hasattr(model, "parameters") else iter(())
    device = next((p.device for p in params), accelerator.device)
    if device.type == accelerator.device.type:
        return accelerator.autocast()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_name(accelerator))
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
