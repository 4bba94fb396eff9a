"""The memory planner: fit a run into the memory there is, before step 1, without changing what it learns.

It picks the micro-batch (and so the gradient accumulation), gradient checkpointing, and the storage dtype of
frozen weights, from two sources:

* an analytic estimate: weights, gradients of the trainable parameters, AdamW states, activations per token (with
  and without checkpointing) and the logits at supervised positions (chunked, see ``training/loss.py``);
* a measurement of the real worst case: the activations autograd saves for the longest training example are
  counted exactly (a saved-tensors hook; this works on a CPU too), and on a GPU the longest micro-batch of the chosen
  plan is run forward and backward and its peak read from the allocator. A plan whose measured peak does not fit
  steps down and is measured again.

What it never changes is the update: micro x accumulation x processes = ``--batch_size``. The loss is normalised by
the whole step's supervised tokens (``training/loop.py``), so a step of 7 examples as micro-batches 3 + 3 + 1 is the
same update as one batch of 7; the planner says how the step is cut. The out-of-memory guard stays on as the net
under the plan (a plan is an estimate; fragmentation and other processes are not in it).

Why not the alternatives: Hugging Face's ``auto_find_batch_size`` restarts on OOM and leaves accumulation as it was
(the effective batch changes); Lightning's batch-size finder tries the first batches, not the longest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from surefit.config import TrainConfig
from surefit.data.collate import PadCollator
from surefit.data.sampling import longest_first
from surefit.errors import Problem, SurefitError
from surefit.models.lowbit import quantized_bits
from surefit.training.loss import CHUNK_VALUES
from surefit.training.memory import free_memory, is_oom
from surefit.training.precision import holds_bf16, precision_name, store_frozen_in
from surefit.training.work import ActivationStore, TrainingWork
from surefit.units import GiB, human_bytes

GB = GiB
# Of a budget, the planner fills at most this share: the allocator's fragmentation and the CUDA context (a few
# hundred MB that torch does not count) live in the rest.
FILL = 0.9


class MemoryPlanError(SurefitError):
    title = "the run does not fit in memory"


@dataclass
class Plan:
    """What the planner chose and why; printed at the start and saved as ``OUTPUT/memory_plan.json``."""

    batch_size: int
    processes: int
    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    precision: str
    frozen_dtype: str | None
    eval_batch_size: int
    budget_gb: float | None
    budget_source: str
    estimate: dict[str, int] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)
    # "bf16" when fp32 activations saved for the backward pass are stored in bf16 (LoRA on 16-bit frozen weights,
    # bf16 or fp16 runs: see training/speedups/lora_fast.SavedActivationsIn); None: as autograd saves them.
    saved_activations: str | None = None
    # "4bit" / "8bit": the frozen Linear weights were quantised by bitsandbytes while loading (--quantize).
    quantized: str | None = None
    # "fsdp": the estimate is one process's shard; checkpoint_host_bytes: host RAM the main process needs to write a
    # step checkpoint (its shard under fsdp; an epoch checkpoint's model/ also gathers the whole weights there).
    sharding: str = "none"
    checkpoint_host_bytes: int = 0
    # Training batches' lengths padded up to a multiple of this (the collator's ``pad_to_multiple_of``); None: no.
    pad_to_multiple_of: int | None = None

    @property
    def estimated_bytes(self) -> int:
        return sum(self.estimate.values())

    def cut(self) -> str:
        """How one process's share of a step is cut into micro-batches, e.g. ``3 + 3 + 1``."""
        share = math.ceil(self.batch_size / self.processes)
        sizes = [min(self.micro_batch_size, share - i) for i in range(0, share, self.micro_batch_size)]
        return " + ".join(map(str, sizes))

    def render(self) -> str:
        lines = [f"memory plan ({self.budget_source}):"]
        share = math.ceil(self.batch_size / self.processes)
        exact = self.micro_batch_size * self.grad_accum * self.processes == self.batch_size
        if exact:
            lines.append(f"  batch {self.batch_size} = micro-batch {self.micro_batch_size} x accumulation "
                         f"{self.grad_accum}" + (f" x {self.processes} processes" if self.processes > 1 else ""))
        else:
            each = f"{self.processes} processes x up to {share} examples, " if self.processes > 1 else ""
            lines.append(f"  batch {self.batch_size} = {each}cut as {self.cut()} (micro-batch {self.micro_batch_size}, "
                         f"accumulation {self.grad_accum}): the same update, the loss is normalised by the step's "
                         "tokens")
        if self.quantized:
            stored = f"; frozen Linear weights quantised to {self.quantized.replace('bit', '-bit')}, the other frozen weights in " \
                     f"{self.frozen_dtype or 'fp32'}"
        else:
            stored = f"; frozen weights stored in {self.frozen_dtype}" if self.frozen_dtype else ""
        stored = stored \
            + ("; activations saved in bf16" if self.saved_activations else "")
        lines.append(f"  gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}; precision "
                     f"{self.precision}{stored}; evaluation batch {self.eval_batch_size}")
        if self.pad_to_multiple_of and self.pad_to_multiple_of > 1:
            lines.append(f"  batch lengths padded up to a multiple of {self.pad_to_multiple_of} tokens: fewer batch "
                         "shapes, so memory does not grow with each new one (--pad_to_multiple_of)")
        parts = " + ".join(f"{k} {human_bytes(v)}" for k, v in self.estimate.items() if v)
        per = f" per process (1/{self.processes} of the weights and AdamW states)" if self.sharding == "fsdp" else ""
        lines.append(f"  estimate {human_bytes(self.estimated_bytes)}{per} = {parts}")
        if self.sharding == "fsdp" and self.checkpoint_host_bytes:  # unsharded: in memory_plan.json only
            lines.append(f"  checkpoint save: about {human_bytes(self.checkpoint_host_bytes)} of host RAM on the main "
                         "process (each process writes its own shard of the weights and AdamW states)")
        if self.measured:
            m = self.measured
            lines.append(f"  measured: {m['how']}")
        if self.budget_gb:
            peak = self.measured.get("peak_bytes", self.estimated_bytes)
            lines.append(f"  headroom {human_bytes(self.budget_gb * GB - peak)} of {self.budget_gb:g} GB")
        lines += [f"  changed: {c}" for c in self.changes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimated_bytes"] = self.estimated_bytes
        return d



# --------------------------------------------------------------------------------------------------- the budget


def resolve_budget(setting: str | float | None, device: torch.device) -> tuple[float | None, str]:
    """``--gpu_memory_gb`` as GB and where it came from. ``auto`` (and unset on a GPU): what the device reports."""
    if setting not in (None, "auto"):
        return float(setting), f"budget {float(setting):g} GB from --gpu_memory_gb"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = _memory_fraction(index)
        free, _ = torch.cuda.mem_get_info(index)
        usable = min(total * fraction, free + torch.cuda.memory_reserved(index))
        name = torch.cuda.get_device_name(index)
        how = f"{name}, {total / GB:.1f} GB" + (f" capped at {fraction:g}" if fraction < 1 else "")
        return usable / GB, f"budget {usable / GB:.2f} GB: what {how} has free"
    if setting == "auto":
        return None, "no budget: --gpu_memory_gb auto on a CPU (nothing to read); the plan is the settings as given"
    return None, "no budget on a CPU (set --gpu_memory_gb to plan for a GPU); the plan is the settings as given"


def _memory_fraction(index: int) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        return float(getter(index)) if getter else 1.0
    except Exception:  # noqa: BLE001 - older torch: no cap readable
        return 1.0


# ------------------------------------------------------------------------------------------------- the estimate


@dataclass
class Footprint:
    """Sizes that do not depend on the batch, and activation bytes per token (measured or from the config)."""

    weights: int  # bytes of parameters and buffers as stored
    trainable: int  # trainable values (gradients and AdamW states are kept in fp32 for them)
    trainable_bytes: int
    act_per_token: float  # bytes autograd keeps per token, all layers, no checkpointing
    ckpt_per_token: float  # the same with checkpointing: one hidden state per layer + one layer recomputed
    vocab: int  # 0 when there is no LM head
    act_source: str
    layers: int = 0
    kv_width: int = 0  # key (or value) width per layer, for the generation cache
    # --sharding fsdp over this many processes (1: not sharded); block: the largest sharded block's weights.
    shards: int = 1
    block: int = 0

    def at(self, micro: int, seq: int, supervised: int, ckpt: bool) -> dict[str, int]:
        # FSDP: each process keeps 1/N of the weights and AdamW states; a block's full weights exist during its
        # forward and backward (two blocks: the next one is gathered ahead). Gradients are counted whole: under
        # accumulation they stay unsharded until the step's last micro-batch.
        weights = self.weights // self.shards + (2 * self.block if self.shards > 1 else 0)
        acts = micro * seq * (self.ckpt_per_token if ckpt else self.act_per_token)
        # Supervised positions only, at most one chunk at a time; fp32 logits, their softmax and its gradient.
        chunk = max(1, CHUNK_VALUES // self.vocab) if self.vocab else 0
        logits = min(supervised, chunk) * self.vocab * 4 * 3 if self.vocab else 0
        return {"weights": weights, "gradients": self.trainable_bytes, "AdamW states": self.trainable * 8 // self.shards,
                "activations": int(acts), "logits": int(logits)}

    def checkpoint_host_bytes(self, processes: int, sharding: str) -> int:
        """Host RAM the main process needs to write a step checkpoint: unsharded, a CPU copy of the trainable
        weights and the AdamW states; sharded, its own shard of them (each process writes its part)."""
        whole = self.trainable_bytes + self.trainable * 8
        return whole // processes if sharding == "fsdp" else whole


def model_dims(model: Any) -> dict[str, int]:
    """``hidden``, ``layers``, ``inter``, ``heads``, ``kv``, ``vocab`` from the model's config (those it has)."""
    cfg = getattr(getattr(model, "module", model), "config", None)
    out: dict[str, int] = {}
    for key, names in {"hidden": ("hidden_size", "d_model", "n_embd", "dim"),
                       "layers": ("num_hidden_layers", "n_layer", "num_layers"),
                       "inter": ("intermediate_size", "ffn_dim", "n_inner"),
                       "heads": ("num_attention_heads", "n_head"),
                       "kv": ("num_key_value_heads",),
                       "vocab": ("vocab_size",)}.items():
        for source in (cfg, getattr(cfg, "text_config", None)):
            v = next((getattr(source, n) for n in names if source is not None and isinstance(getattr(source, n, None), int)), None)
            if v:
                out[key] = v
                break
    return out


def analytic_act_per_token(model: Any, mixed: bool) -> float | None:
    """Bytes per token autograd keeps in a transformer block stack, from the model config (None without one).

    Per layer and token: the norms' outputs, q/k/v, the attention output and o_proj's input, the MLP's gate, up,
    activation and product (4 x intermediate), and the inputs LoRA's dropout copies: ~ 10 h + 2 kv + 5 i values.
    """
    d = model_dims(model)
    if not {"hidden", "layers"} <= d.keys():
        return None
    h, layers = d["hidden"], d["layers"]
    inter = d.get("inter", 4 * h)
    kv = h * d.get("kv", d.get("heads", 1)) // max(d.get("heads", 1), 1)
    values = 10 * h + 2 * kv + 5 * inter
    return values * layers * (2.2 if mixed else 4.0)  # mixed: a few fp32 tensors (norm statistics, softmax)


def measure_saved_bytes(model: Any, run_forward: Callable[[], Any], packer: Any = None) -> int:
    """Bytes of the distinct tensors autograd saves for the backward pass of one forward (exact, any device).

    ``packer``: a :class:`~surefit.training.speedups.lora_fast.SavedActivationsIn` the run will train under; what it stores
    is counted."""
    from surefit.training.speedups.lora_fast import Packed, SavedActivationsIn, keep_saved

    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> Any:
        if packer is not None:
            packed = packer.pack(t)
            if type(packed) is Packed:
                storage = packed.tensor.untyped_storage()
                seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
                return packed
        try:
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        except Exception:  # noqa: BLE001 - e.g. tensors without storage; they cost nothing
            pass
        return keep_saved(t)  # not ``t``: that would keep this never-backpropagated graph alive (see keep_saved)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    unpack = SavedActivationsIn.unpack
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run_forward()
    del out
    if packer is not None:
        packer.forget()
    return sum(n for (ptr, _), n in seen.items() if ptr not in params)


def footprint(model: Any, *, mixed: bool, measured_act: tuple[int, int] | None, shards: int = 1) -> Footprint:
    """Sizes of ``model`` as it will train; ``measured_act``: (saved bytes, tokens) of a measured forward;
    ``shards``: the processes ``--sharding fsdp`` shards it over (1: not sharded)."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    weights += sum(_quant_state_bytes(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    d = model_dims(model)
    analytic = analytic_act_per_token(model, mixed)
    if measured_act and measured_act[1]:
        per_token = measured_act[0] / measured_act[1]  # measured under the run's autocast
        source = "measured (saved tensors of the longest example)"
    elif analytic:
        per_token, source = analytic, "from the model config"
    else:
        per_token, source = 0.0, "unknown (no config, no measurement)"
    layers = d.get("layers", 0)
    hidden = d.get("hidden", 0)
    ckpt = (layers * hidden * (2 if mixed else 4) + per_token / max(layers, 1)) if layers else per_token
    vocab = d.get("vocab", 0) if hasattr(getattr(model, "module", model), "get_output_embeddings") and \
        _has_lm_head(model) else 0
    block = 0
    if shards > 1:
        from surefit.training.distributed import fsdp_blocks

        block = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in fsdp_blocks(model)),
                    default=0)
    return Footprint(weights=weights, trainable=n_train, trainable_bytes=n_train * 4, act_per_token=per_token,
                     ckpt_per_token=ckpt, vocab=vocab, act_source=source, layers=layers,
                     kv_width=hidden * d.get("kv", d.get("heads", 1)) // max(d.get("heads", 1), 1), shards=shards,
                     block=block)


def _quant_state_bytes(p: Any) -> int:
    """A bitsandbytes 4-bit weight's block scales (held beside it, not as parameters or buffers)."""
    state = getattr(p, "quant_state", None)
    if state is None:
        return 0
    tensors = [getattr(state, "absmax", None), getattr(state, "code", None)]
    nested = getattr(state, "state2", None)
    if nested is not None:
        tensors += [getattr(nested, "absmax", None), getattr(nested, "code", None)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _has_lm_head(model: Any) -> bool:
    inner = getattr(model, "module", model)
    try:
        head = inner.get_output_embeddings()
    except Exception:  # noqa: BLE001
        return False
    return isinstance(head, torch.nn.Linear)


# ----------------------------------------------------------------------------------------------------- the plan


def micro_candidates(share: int, cap: int) -> list[int]:
    """Micro-batch sizes worth trying, largest first: for each accumulation count, the smallest micro that does it."""
    out = sorted({math.ceil(share / k) for k in range(1, share + 1)}, reverse=True)
    return [m for m in out if m <= cap]


@dataclass
class Workload:
    """What the planner fits: the run's examples, as the loop will see them."""

    lengths: Sequence[int]  # tokens per training example
    supervised: Sequence[int]  # loss-carrying items per training example
    eval_lengths: Sequence[int] = ()
    generate_lengths: Sequence[int] = ()  # prompt + new tokens, when evaluation generates
    # Runs forward + backward of the given training examples and returns nothing; used by the measured probe.
    train_step: Callable[[list[int]], None] | None = None
    # Runs a forward (no grad) of the given training examples, for the saved-tensor count.
    forward: Callable[[list[int]], Any] | None = None
    # The task's activation store (TrainingWork.activation_store); None: saved activations stay as autograd saves them.
    activation_store: Callable[[torch.dtype], ActivationStore] | None = None


@dataclass
class PlanRequest:
    """The settings the planner fits to the budget.

    Attributes:
        batch_size: the effective (global) batch, which is kept; processes: how many share it.
        requested_micro: the largest micro-batch the settings allow (``batch_size / grad_accum``).
        gradient_checkpointing: on by request (the planner may also turn it on, and says so).
        precision: the compute precision in force ("fp32", "bf16", "fp16").
        eval_batch_size: the evaluation batch asked for.
        budget: (GB or None, where it came from), see :func:`resolve_budget`.
        lora: only adapters train (frozen weights may then be stored in 16 bits under mixed precision).
        device: where the model trains.
        sharding: ``"fsdp"``: weights and AdamW states are sharded over the processes (each holds 1/N).
    """

    batch_size: int
    processes: int
    requested_micro: int
    gradient_checkpointing: bool
    precision: str
    eval_batch_size: int
    budget: tuple[float | None, str]
    lora: bool
    device: torch.device
    sharding: str = "none"


def make_plan(model: Any, work: Workload, request: PlanRequest, probe: Callable[[int, bool], int] | None = None,
              memo: dict[str, Any] | None = None) -> Plan:
    """Choose micro-batch, accumulation, checkpointing and frozen-weight dtype for the budget.

    The choices that change the model are applied to it: checkpointing on or off, and frozen weights stored in
    16 bits under mixed precision with LoRA.

    Args:
        model: the model as it will train (adapters applied).
        work: the examples (lengths and supervised counts) and how to run them.
        request: the settings to fit (:class:`PlanRequest`).
        probe: ``(micro, checkpointing) -> peak bytes`` of the longest micro-batch, forward and backward; raises an
            out-of-memory error if it does not fit. Default: measured on a GPU, none on a CPU.
        memo: measurements of an identical setup (``saved_activations``: [bytes, tokens]; ``probes``: "micro,ckpt"
            -> peak bytes or None for out of memory), used instead of measuring again; new ones are added to it.

    Raises:
        MemoryPlanError: when not even one example of the longest length fits; the message gives the estimate and
            what to change.
    """
    batch_size, processes, requested_micro = request.batch_size, request.processes, request.requested_micro
    gradient_checkpointing, precision, eval_batch_size = (request.gradient_checkpointing, request.precision,
                                                          request.eval_batch_size)
    budget, lora, device = request.budget, request.lora, request.device
    budget_gb, source = budget
    share = math.ceil(batch_size / processes)
    mixed = precision in ("bf16", "fp16")
    frozen_half = bool(lora and mixed)
    quant = quantized_bits(model)
    cast = store_frozen_in(model, torch.bfloat16 if precision == "bf16" else torch.float16) if frozen_half else 0
    store = work.activation_store
    pack_saved = packs_saved(lora, precision, store, device)
    # numpy over the whole column, never a Python list of every example (a store's 2M examples: data/sampling.py)
    order = longest_first(work.lengths, max(share, requested_micro, 1))
    longest = work.lengths[order[0]] if order else 1
    memo = {} if memo is None else memo
    known = memo.get("saved_activations")
    measured_act = (int(known[0]), int(known[1])) if known else None
    forward = work.forward
    if measured_act is None and forward is not None and order:
        packer = None
        if pack_saved and store is not None:
            packer = store(torch.bfloat16)
        measured_act = (measure_saved_bytes(model, lambda: forward([order[0]]), packer),
                        work.lengths[order[0]])
        memo["saved_activations"] = list(measured_act)
    sharded = request.sharding == "fsdp"
    fp = footprint(model, mixed=mixed, measured_act=measured_act, shards=processes if sharded else 1)

    top_supervised: dict[int, int] = {}

    def sup(micro: int) -> int:
        if micro not in top_supervised:
            top_supervised[micro] = sum(work.supervised[i] for i in longest_first(work.supervised, micro))
        return top_supervised[micro]

    def estimate(micro: int, ckpt: bool) -> dict[str, int]:
        return fp.at(micro, longest, sup(micro), ckpt)

    changes: list[str] = []
    cap = max(1, min(requested_micro, share))
    candidates = micro_candidates(share, cap)
    target = budget_gb * GB * FILL if budget_gb else math.inf

    def fits(micro: int, ckpt: bool) -> bool:
        return sum(estimate(micro, ckpt).values()) <= target

    ckpt_options = [True] if gradient_checkpointing else [False, True]
    chosen: tuple[int, bool] | None = None
    if not budget_gb:
        chosen = (cap, gradient_checkpointing)
    else:
        plain = next((m for m in candidates if fits(m, ckpt_options[0])), None)
        with_ckpt = next((m for m in candidates if fits(m, True)), None)
        # Recomputation costs about a third more compute; a micro-batch a quarter the size costs more than that on a
        # GPU (and splits the step into 4x the launches), so checkpointing wins only when it buys a 2x larger batch.
        if plain is not None and (with_ckpt is None or plain * 2 > with_ckpt or gradient_checkpointing):
            chosen = (plain, ckpt_options[0])
        elif with_ckpt is not None:
            chosen = (with_ckpt, True)
    probe = probe if probe is not None else (_gpu_probe(work, order, pack_saved)
                                             if device.type == "cuda" and budget_gb else None)
    if probe is not None:
        probe = _remembered(probe, memo.setdefault("probes", {}))
    measured: dict[str, Any] = {}
    if measured_act:
        measured["saved_activations"] = {"bytes": measured_act[0], "tokens": measured_act[1]}
    # Measured probe: step down (smaller micro, then checkpointing) until the real peak fits.
    if chosen is not None and probe is not None:
        ladder = [(m, c) for c in ckpt_options for m in candidates]
        start = ladder.index(chosen) if chosen in ladder else 0
        chosen = None
        for micro, ckpt in ladder[start:]:
            est = sum(estimate(micro, ckpt).values())
            set_checkpointing(model, ckpt, lora)
            try:
                peak = run_with_restored_rng(probe, micro, ckpt)
            except Exception as e:  # noqa: BLE001 - only out-of-memory moves down the ladder
                if not is_oom(e):
                    raise
                peak = None
            free_memory()
            opt_states = fp.trainable * 8  # AdamW states do not exist yet at the probe
            if peak is not None and peak + opt_states <= (budget_gb or math.inf) * GB * FILL:
                chosen = (micro, ckpt)
                measured.update(peak_bytes=peak + opt_states, how=(
                    f"peak {human_bytes(peak + opt_states)} (forward + backward of the longest micro-batch, {micro} x "
                    f"{longest} tokens, + AdamW states {human_bytes(opt_states)}), estimate {human_bytes(est)}"))
                break
            changes.append(f"micro-batch {micro}{' with checkpointing' if ckpt else ''} measured "
                           + ("out of memory" if peak is None else f"{human_bytes(peak + opt_states)} (over the budget)"))
    if chosen is None:
        one = estimate(1, True)
        shown = " + ".join(f"{k} {human_bytes(v)}" for k, v in one.items() if v)
        raise MemoryPlanError(Problem(
            f"one example of {longest} tokens does not fit in {budget_gb:g} GB even with gradient checkpointing: "
            f"estimate {human_bytes(sum(one.values()))} = {shown}",
            "--gpu_memory_gb",
            "shorten --max_seq_length, train LoRA adapters (--lora_r 16) instead of the full model, compute in "
            "bf16/fp16 (--precision), or use a larger GPU"))
    micro, ckpt = chosen
    set_checkpointing(model, ckpt, lora)
    accum = math.ceil(share / micro)
    if micro < requested_micro and budget_gb:
        changes.append(f"micro-batch {requested_micro} -> {micro} (accumulation {accum}) to fit the budget; the "
                       f"effective batch stays {batch_size}")
    if ckpt and not gradient_checkpointing:
        changes.append("gradient checkpointing turned on to fit the budget (activations recomputed: ~30% slower)")
    if quant:
        changes.append(f"frozen Linear weights quantised to {quant.replace('bit', '-bit')} while loading (bitsandbytes; --quantize), "
                       f"computing in {precision}: the weights in the estimate are their quantised size")
    if frozen_half and not cast:
        changes.append(f"frozen {'embeddings and output layer' if quant else 'weights'} loaded in {precision} "
                       "(read straight into 16 bits: no fp32 copy; embedding lookups come out in fp32, the residual "
                       "stream stays fp32)")
    elif frozen_half:
        changes.append(f"frozen weights stored in {precision} (autocast computes with them in {precision} anyway: "
                       "the same numbers, half the memory, no cast per step; embedding lookups are rounded to "
                       f"{precision} once, the residual stream stays fp32)")
    if pack_saved:
        changes.append("fp32 activations saved for the backward pass stored in bf16 (forward values unchanged; "
                       "the backward pass computes with them rounded, as with everything autocast saves"
                       + ("; bf16, not fp16, for fp32's range" if precision == "fp16" else "") + ")")
    eval_bs = eval_batch_size
    if budget_gb:
        eval_bs = _fit_eval(fp, work, eval_batch_size, target, mixed)
        if eval_bs < eval_batch_size:
            changes.append(f"evaluation batch {eval_batch_size} -> {eval_bs} to fit the budget")
    if not measured.get("how") and measured_act:
        of = memo.get("saved_activations_of") or \
            f"the longest example ({measured_act[1]} token{'s' if measured_act[1] != 1 else ''}"
        measured["how"] = (f"{human_bytes(measured_act[0])} of activations saved for the backward pass of {of}; "
                           "counted, not estimated), scaled to the micro-batch")
    return Plan(batch_size=batch_size, processes=processes, micro_batch_size=micro, grad_accum=accum,
                gradient_checkpointing=ckpt, precision=precision,
                frozen_dtype={"bf16": "bf16", "fp16": "fp16"}[precision] if frozen_half else None,
                eval_batch_size=eval_bs, budget_gb=budget_gb, budget_source=source,
                estimate=estimate(micro, ckpt), measured=measured, changes=changes,
                saved_activations="bf16" if pack_saved else None, quantized=quant, sharding=request.sharding,
                checkpoint_host_bytes=fp.checkpoint_host_bytes(processes, request.sharding))


def packs_saved(lora: bool, precision: str, store: Callable[[torch.dtype], ActivationStore] | None,
                device: torch.device) -> bool:
    """Whether the run stores fp32 saved activations in bf16 (LoRA on 16-bit frozen weights), so that a
    measurement of them must count through the same store."""
    return bool(lora and precision in ("bf16", "fp16") and store is not None and holds_bf16(device))


@dataclass
class MeasuringDryRun:
    """The doctor's dry run that is also the planner's measurement (``Setup.call``): one forward of the doctor's
    batch in training mode through the planner's loss, its saved activations counted as :func:`make_plan` counts
    them, so a cold start runs one forward before step 1 instead of two.

    The doctor's batch is the first row(s) and the longest, padded to the longest as training pads a micro-batch.
    Where the run gives the model no attention mask for it (right padding under causal attention:
    ``training/loss.py: model_attention_mask``), each row computes exactly what it computes alone, so the forward
    runs the longest row only: the planner's own measurement (one longest example, scaled per token) at half the
    cost of two rows. Where a mask is needed (left padding, attention that is not causal) every row runs, padded, so
    the masked path is the one checked and measured. The doctor reads the batch itself in its data checks (ids,
    labels, padding: every row); the forward is the run's loss, which scores every supervised label of the rows it
    runs as ``training/loss.py: causal_lm_dry_run`` does. The logits the doctor's checks read (their shape and dtype)
    are the output layer over one position, without gradients, broadcast to the batch's every row and position.
    Every RNG is put back. Used where the model already sits on the device it trains on and one process plans (a CPU
    run): elsewhere the planner measures on its device, as before.

    Attributes:
        loss_fn: the planner's loss (``PlanInputs.loss_fn``); lora, precision, device, store: as the run's.
        into: where the measurement goes (``PlanInputs.measured``).
        no_backward: a context the forward runs in, handed in by the task: this forward is never backpropagated, so
            the loss's parts may keep their gradient tensors without computing them (the fused head's
            ``gradients_unused``: the same tensors counted, less work).
    """

    loss_fn: Callable[[Any, dict[str, torch.Tensor]], Any]
    lora: bool
    precision: str
    device: torch.device
    store: Callable[[torch.dtype], ActivationStore] | None
    into: dict[str, Any]
    no_backward: Callable[[], AbstractContextManager[Any]] = nullcontext

    def __call__(self, model: Any, batch: Any) -> Any:
        import types

        from surefit.models import inner_model
        from surefit.training.loss import model_attention_mask

        rows, length = (int(n) for n in batch["input_ids"].shape)
        run = batch
        if rows > 1 and batch.get("attention_mask") is not None and \
                model_attention_mask(model, batch["attention_mask"]) is None:
            longest = rows - 1 - int(batch["attention_mask"].sum(1).flip(0).argmax())  # the doctor's is its last
            run = {k: v[longest : longest + 1] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
                   for k, v in batch.items()}
        inner = inner_model(model)
        get_decoder, get_head = getattr(inner, "get_decoder", None), getattr(inner, "get_output_embeddings", None)
        decoder = get_decoder() if callable(get_decoder) else None
        head = get_head() if callable(get_head) else None
        hidden: list[torch.Tensor] = []

        def keep(module: Any, args: Any, out: Any) -> None:
            h = getattr(out, "last_hidden_state", None)
            h = h if h is not None else out[0] if isinstance(out, tuple) and out else None
            if isinstance(h, torch.Tensor):
                hidden[:] = [h.detach()]

        store = self.store
        packer = store(torch.bfloat16) if store is not None and packs_saved(self.lora, self.precision, store,
                                                                            self.device) else None
        handle = decoder.register_forward_hook(keep) if isinstance(decoder, torch.nn.Module) else None
        was = model.training
        try:
            with torch.enable_grad(), self.no_backward():
                model.train()
                saved = run_with_restored_rng(
                    lambda: measure_saved_bytes(model, lambda: self.loss_fn(model, run)[0], packer))
        finally:
            model.train(was)
            if handle is not None:
                handle.remove()
        ran = int(run["input_ids"].shape[0])
        self.into.update(saved_activations=[int(saved), ran * length], saved_activations_of=(
            f"the doctor's dry run ({ran} x {length} tokens: " + (
                "its longest row" if ran < rows else "its first row(s) and the longest, padded as training pads them")))
        if not hidden or head is None:
            return types.SimpleNamespace(loss=None)  # no logits here: the doctor finds them its own way
        with torch.no_grad():
            first = head(hidden[0][:1, :1])
        # The checks read the logits' shape and dtype, never their values, and the run's loss above has already
        # scored every supervised label it ran (a label the head cannot score failed there): the head over one
        # position, broadcast to every row and position, costs 1/(B*T) of the full [B, T, vocabulary] logits.
        return types.SimpleNamespace(logits=first.expand(rows, length, -1))


def _remembered(probe: Callable[[int, bool], int], seen: dict[str, int | None]) -> Callable[[int, bool], int]:
    """``probe``, answering from ``seen`` where that rung was measured before (and recording new measurements)."""

    def run(micro: int, ckpt: bool) -> int:
        rung = f"{micro},{int(ckpt)}"
        if rung in seen:
            known_peak = seen[rung]
            if known_peak is None:
                raise torch.OutOfMemoryError(f"micro-batch {micro} measured out of memory before (start-up cache)")
            return int(known_peak)
        try:
            peak = probe(micro, ckpt)
        except Exception as e:
            if is_oom(e):
                seen[rung] = None
            raise
        seen[rung] = int(peak)
        return peak

    return run


def _fit_eval(fp: Footprint, work: Workload, requested: int, target: float, mixed: bool) -> int:
    """The largest evaluation batch (<= requested) whose forward and generation cache fit next to the weights."""
    fixed = fp.at(1, 1, 0, False)
    base = fixed["weights"] + fixed["gradients"] + fixed["AdamW states"]  # training state stays resident
    seq = max([*work.eval_lengths, *work.generate_lengths, 1])
    width = 2 if mixed else 4
    # Per token: the generation KV cache (2 x kv width per layer), and one layer's transient activations.
    per_token = fp.layers * 2 * fp.kv_width * width + (fp.act_per_token / max(fp.layers, 1))
    for bs in range(requested, 0, -1):
        need = base + bs * seq * per_token + bs * fp.vocab * 4 * 2  # + last-position logits while generating
        if need <= target:
            return bs
    return 1


def _gpu_probe(work: Workload, order: list[int], pack_saved: bool = False) -> Callable[[int, bool], int] | None:
    train_step, store = work.train_step, work.activation_store
    if train_step is None:
        return None

    def probe(micro: int, ckpt: bool) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with store(torch.bfloat16) if pack_saved and store else nullcontext():  # as the run will save them
            train_step(order[:micro])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    return probe


# --------------------------------------------------------------------------------------------------- applying it


def set_checkpointing(model: Any, on: bool, lora: bool) -> None:
    """Turn activation recomputation on or off (no-op for models without transformers' switch)."""
    from surefit.training.memory import enable_gradient_checkpointing

    inner = getattr(model, "module", model)
    if not hasattr(inner, "gradient_checkpointing_enable"):
        return
    flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    if bool(getattr(inner, flag, False)) == on:
        return
    if on:
        enable_gradient_checkpointing(inner, lora)
    else:
        inner.gradient_checkpointing_disable()


def run_with_restored_rng(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` (a probe) and put every RNG back, so a planned run draws the same dropout masks as an unplanned one."""
    import random

    import numpy as np

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        return fn(*args)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


def plan_run(cfg: TrainConfig, model: Any, accelerator: Any, work: TrainingWork, say: Callable[[str], None] = print,
             memo: dict[str, Any] | None = None) -> Plan:
    """Plan a task's run from its config and examples, and print the plan (the run folder saves it).

    The model is moved to the accelerator's device first (the probe runs there). Probes put every RNG back.
    ``memo``: earlier measurements of an identical setup, see :func:`make_plan`.
    """
    features = work.features
    collate = work.plan.collate or work.collate
    loss_fn = work.plan.loss_fn or work.loss_fn
    model.to(accelerator.device)

    def batch(indices: list[int]) -> dict[str, torch.Tensor]:
        b = collate([features[i] for i in indices])
        return {k: v.to(accelerator.device) for k, v in b.items()}

    def forward(indices: list[int]) -> Any:
        was = model.training
        model.train()
        try:
            with accelerator.autocast():
                return loss_fn(model, batch(indices))[0]
        finally:
            model.train(was)

    def train_step(indices: list[int]) -> None:
        loss = forward(indices)
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)

    multiple = collate.pad_to_multiple_of if isinstance(collate, PadCollator) else None
    lengths = [-(-n // multiple) * multiple for n in work.lengths] if multiple else work.lengths
    load = Workload(lengths=lengths, supervised=work.counts, eval_lengths=work.plan.eval_lengths,
                    generate_lengths=work.plan.generate_lengths, train_step=train_step, forward=forward,
                    activation_store=work.activation_store)
    budget = resolve_budget(getattr(cfg, "gpu_memory_gb", None), accelerator.device)
    if memo is not None and "saved_activations" not in memo:
        memo.update(work.plan.measured)  # the doctor's dry run counted them (MeasuringDryRun)
    elif memo is None and work.plan.measured:
        memo = dict(work.plan.measured)
    plan = run_with_restored_rng(
        lambda: make_plan(model, load, PlanRequest(
            batch_size=cfg.batch_size, processes=accelerator.num_processes, requested_micro=cfg.micro_batch_size,
            gradient_checkpointing=cfg.gradient_checkpointing, precision=precision_name(accelerator),
            eval_batch_size=cfg.resolved_eval_batch_size, budget=budget, lora=work.plan.lora,
            device=accelerator.device, sharding=getattr(cfg, "sharding", "none")), memo=memo))
    plan.pad_to_multiple_of = multiple
    say(plan.render())
    return plan


# ------------------------------------------------------------------------------------------- the generation batch

# Rows one decode step runs at most. A step reads every weight once whatever the rows, so its cost grows slowly with
# them (SmolLM2-135M, one CPU thread, CPU time per step: 8 rows 117-158 ms, 32 rows 207-271 ms, 64 rows 304-329 ms).
# Not more: answers end at different steps, so a large batch runs thin while its longest answer keeps the cache wide
# (64 was not measured end to end).
GENERATE_ROWS = 32
# Without a budget (a CPU), the generation cache may take this share of the memory the system reports available.
GENERATE_MEMORY_SHARE = 0.25


@dataclass
class GenerationBatch:
    """How many rows evaluation's generation decodes at once (prompts are still run ``prefill`` at a time), and why."""

    rows: int
    prefill: int
    why: str


def _available_bytes() -> tuple[int | None, str]:
    """Memory this process can still take, and what set it: the system's available memory, or less where the
    process's cgroup limit (a container's) leaves less."""
    from surefit.cgroups import memory_left

    system: int | None = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    system = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if system is None:
        try:
            system = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    left = memory_left()
    if left is not None and (system is None or left < system):
        return left, "left under this process's cgroup memory limit"
    return system, "available"


def generation_batch(model: Any, generate_lengths: Sequence[int], eval_batch_size: int,
                     budget_gb: float | None, mixed: bool) -> GenerationBatch:
    """The rows one decode step of evaluation's generation runs: up to ``GENERATE_ROWS`` (and the number of
    prompts), as many as their KV cache fits, never fewer than ``eval_batch_size`` (which the plan fitted already).

    Per row the cache holds ``2 x layers x kv width`` values for the longest prompt plus the new tokens, twice while
    the parts' caches are stacked, plus the last position's logits. With a budget (a GPU), the memory left beside the
    weights, gradients and AdamW states; without (a CPU), ``GENERATE_MEMORY_SHARE`` of the memory available now.
    """
    prefill = max(1, eval_batch_size)
    cap = max(prefill, min(GENERATE_ROWS, len(generate_lengths)))
    if cap <= prefill:
        return GenerationBatch(prefill, prefill, f"{len(generate_lengths)} prompts: one batch of the evaluation batch")
    fp = footprint(model, mixed=mixed, measured_act=None)
    seq = max([*generate_lengths, 1])
    per_row = 2 * (fp.layers * 2 * fp.kv_width * (2 if mixed else 4) * seq) + fp.vocab * 4 * 2
    if budget_gb:
        room = budget_gb * GB * FILL - fp.weights - fp.trainable_bytes - fp.trainable * 8
        where = f"the {budget_gb:g} GB budget beside the weights and the training state"
    else:
        available, which = _available_bytes()
        room = available * GENERATE_MEMORY_SHARE if available is not None else per_row * cap
        where = (f"{GENERATE_MEMORY_SHARE:.0%} of the {human_bytes(available)} {which}" if available is not None
                 else "no memory figure readable")
    rows = max(prefill, min(cap, int(room // max(per_row, 1))))
    why = (f"at most {GENERATE_ROWS} rows or the {len(generate_lengths)} prompts; {human_bytes(per_row)} of KV cache "
           f"per row of up to {seq} tokens, room: {where}")
    return GenerationBatch(rows, prefill, why)
