"""Speed-only parts of generation (``generate.py`` says what each buys): a KV cache whose room is reserved once and
written in place, and LoRA adapters merged into a temporary copy of the weights (an option).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from surefit.models import plain_lora_adapter


class Reserved(DynamicLayer):
    """A full-attention cache layer whose room for the new tokens is reserved once and written in place.

    The model sees what transformers' ``DynamicLayer`` gives it (the keys and values so far, as views of the
    reserved tensors), without the copy of the whole cache at every step that concatenation makes.

    ``dtype``: under autocast, fp32 keys and values are stored in autocast's 16-bit dtype. Attention reads them
    through autocast, which would round them to exactly that at every step (a copy of the whole cache per layer and
    step); stored rounded once, attention gets the same values without the copies, in half the memory."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, dtype: torch.dtype | None = None):
        super().__init__()
        n = keys.shape[-2]
        self._k = keys.new_empty(*keys.shape[:-2], n + room, keys.shape[-1], dtype=dtype or keys.dtype)
        self._v = values.new_empty(*values.shape[:-2], n + room, values.shape[-1], dtype=dtype or values.dtype)
        self._k[..., :n, :] = keys
        self._v[..., :n, :] = values
        self._n = n
        self.device, self.is_initialized = keys.device, True
        self._views()

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._k[..., : self._n, :], self._v[..., : self._n, :]
        self.keys, self.values = keys, values
        return keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        m = key_states.shape[-2]
        if self._n + m > self._k.shape[-2]:  # more than reserved: grow (not reached by greedy_generate)
            self._k = torch.cat([self._k, torch.empty_like(self._k[..., :m, :])], dim=-2)
            self._v = torch.cat([self._v, torch.empty_like(self._v[..., :m, :])], dim=-2)
        self._k[..., self._n : self._n + m, :] = key_states
        self._v[..., self._n : self._n + m, :] = value_states
        self._n += m
        return self._views()

    def get_seq_length(self) -> int:
        return self._n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices, ...], self._v[indices, ...]
        self._views()

    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - generation never crops
        raise NotImplementedError("a reserved generation cache is not cropped")


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep (or repeat) the cache's batch rows ``rows``, layer by layer: attention layers select their keys and
    values; the states of linear-attention and convolution layers (LFM2, Qwen3-Next, hybrid Mamba models), which
    transformers' ``batch_select_indices`` does not cover, are selected as beam search reorders them."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        cache.batch_select_indices(rows)
        return
    for layer in layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(rows)
        else:
            layer.reorder_cache(rows)


def reserve(cache: Any, room: int) -> int:
    """Replace each plain full-attention layer of ``cache`` by a :class:`Reserved` one with ``room`` more slots;
    other layer kinds (sliding windows, linear attention, quantized) stay as they are. Returns how many changed."""
    n = 0
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is not DynamicLayer:  # a linear-attention or convolution layer has no keys at all
            continue
        keys, values = layer.keys, layer.values
        if layer.is_initialized and keys is not None and values is not None and keys.dim() == 4:
            kind = keys.device.type
            dtype = None
            if keys.dtype == torch.float32 and values.dtype == torch.float32 and torch.is_autocast_enabled(kind):
                dtype = torch.get_autocast_dtype(kind)
            cache.layers[i] = Reserved(keys, values, room, dtype)
            n += 1
    return n


class LastCast:
    """The 16-bit copy of the last input cast, for the layers that read the same input in a row (q, k and v; gate and
    up): one cast instead of three (two). Held strongly only for the generation; the input's identity, shape and
    version counter (bumped by any in-place write) make sure the copy is of this tensor as it is now."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.source: torch.Tensor | None = None
        self.cast: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.is_inference():  # no version counter to check: cast each time
            return x.to(dtype)
        key = (x.data_ptr(), x.shape, x.stride(), x._version, dtype)
        if self.source is x and self.key == key and self.cast is not None:
            return self.cast
        self.source, self.key, self.cast = x, key, x.to(dtype)
        return self.cast


def _merged_forward(x: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, cast: LastCast) -> torch.Tensor:
    # What a plain Linear holding the merged weight gives (peft's merge_and_unload): under autocast its output in the
    # 16-bit compute dtype, with no cast back to fp32 and the next layer's cast avoided with it; without autocast, in
    # the adapter's dtype, as surefit's unmerged forward gives it (the residual stream stays fp32).
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        if torch.get_autocast_dtype(kind) != weight.dtype:
            return F.linear(x, weight, bias)  # autocast casts the weight too, as it would for the plain Linear
        # The input cast as autocast casts it, once for q/k/v, gate/up; the call stays under autocast, as the plain
        # Linear's does.
        return F.linear(cast(x, weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return F.linear(cast(x, weight.dtype), weight, bias).to(out_dtype)


def _mergeable(layer: Any) -> str | None:
    """The active adapter of a plain peft LoRA ``Linear`` that a merged weight computes exactly; None otherwise."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    name = plain_lora_adapter(layer) if type(layer) is LoraLinear else None  # DoRA, biases: not a plain W + B @ A
    if name is None:
        return None
    base = layer.base_layer
    if type(base.weight.data) is not torch.Tensor or base.weight.data.is_meta:
        return None  # sharded (DTensor) or offloaded weights
    return name


@dataclass
class Merged:
    """What :func:`merged_lora` did: layers merged, and whether it ran out of memory (and so merged none)."""

    layers: int = 0
    out_of_memory: bool = False


@contextlib.contextmanager
def merged_lora(model: Any) -> Iterator[Merged]:
    """Within this context, each plain LoRA ``Linear`` of ``model`` computes ``x @ (W + scale * B @ A)^T`` with one
    matmul on a merged copy of its weight; yields a :class:`Merged` (how many layers, and whether memory ran out).

    Under autocast the model computes what peft's ``merge_and_unload()`` of it computes (tested token for token
    against ``generate`` on such a copy): 16-bit layer outputs, no fp32 adapter sum. That drops the casts around
    every layer (the prompts' forward on SmolLM2-135M took about 0.65x the time of the unmerged one in a measurement
    on the shared machine; ``benchmarks/results/generation.md``).

    The copy is made in the base weight's dtype (so 16-bit weights stay 16-bit), and costs the memory of the adapted
    layers' weights while it lives. Neither the base weight nor the adapter is written: the layer's ``forward`` is
    replaced for the duration (peft's ``merged_adapters`` says the adapter is in it, so no fused path adds it twice)
    and restored on exit, also after an error. Out of memory while merging: the layers merged so far are restored and
    the context runs unmerged (``out_of_memory`` is True, ``layers`` 0).
    """
    changed: list[tuple[Any, Any, list[str]]] = []
    info = Merged()
    cast = LastCast()

    def restore() -> None:
        for layer, forward, merged in reversed(changed):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward
            layer.merged_adapters = merged
        changed.clear()

    try:
        for layer in model.modules():
            name = _mergeable(layer)
            if name is None:
                continue
            base, a, b = layer.base_layer, layer.lora_A[name].weight, layer.lora_B[name].weight
            w = base.weight
            # fp32 whatever autocast is on where the context is entered (as peft's merge computes it)
            with torch.autocast(w.device.type, enabled=False):
                delta = (b.detach().float() @ a.detach().float()) * float(layer.scaling[name])
                merged_w = (w.detach().float() + delta.to(w.device)).to(w.dtype)
            del delta
            changed.append((layer, layer.__dict__.get("forward"), list(layer.merged_adapters)))
            layer.forward = functools.partial(_merged_forward, weight=merged_w,
                                              bias=None if base.bias is None else base.bias.detach(),
                                              out_dtype=torch.promote_types(w.dtype, a.dtype), cast=cast)
            layer.merged_adapters = [*layer.merged_adapters, name]
    except torch.OutOfMemoryError:
        # Free what was made before anything else (outside the except block, so the traceback holds no tensors).
        info.out_of_memory = True
    if info.out_of_memory:
        restore()
    info.layers = len(changed)
    try:
        yield info
    finally:
        cast.source = cast.cast = None
        restore()


# Longest n-gram a draft is looked up by (HF's prompt lookup uses 3 by default, falling back to shorter ones).
LOOKUP_NGRAM = 3


class PromptLookup:
    """Draft tokens for each row from its own context (prompt lookup decoding, ``model.generate``'s
    ``prompt_lookup_num_tokens``): the tokens that followed the earliest earlier occurrence of the row's last
    ``LOOKUP_NGRAM`` tokens (or fewer) in its prompt and answer so far. An extractive answer (a SQuAD span, a name
    copied from a tool's output) is mostly such a copy, so one forward can confirm several tokens.

    The first occurrence of every n-gram is indexed as tokens arrive, so a draft costs a few dictionary reads, not a
    scan of the context. Each row's share of confirmed draft tokens is kept for :class:`DraftWidth`."""

    def __init__(self, prompts: list[list[int]], tokens: int) -> None:
        self.tokens = tokens
        self._ctx: list[list[int]] = [[] for _ in prompts]
        self._first: list[dict[tuple[int, ...], int]] = [{} for _ in prompts]
        self._drafted = [0] * len(prompts)
        self._kept = [0] * len(prompts)
        for row, p in enumerate(prompts):
            self.extend(row, p)

    def extend(self, row: int, tokens: list[int]) -> None:
        """Append ``tokens`` to the row's context and index the n-grams that end in them."""
        ctx, first = self._ctx[row], self._first[row]
        start = len(ctx)
        ctx.extend(tokens)
        for end in range(start + 1, len(ctx) + 1):
            for n in range(1, min(LOOKUP_NGRAM, end) + 1):
                first.setdefault(tuple(ctx[end - n : end]), end - n)

    def draft(self, row: int, most: int) -> list[int]:
        """Up to ``most`` (and ``tokens``) tokens that may come next in ``row``; [] where its tail occurs nowhere
        earlier."""
        most = min(most, self.tokens)
        ctx, first = self._ctx[row], self._first[row]
        size = len(ctx)
        if most <= 0:
            return []
        for n in range(min(LOOKUP_NGRAM, size - 1), 0, -1):
            start = first.get(tuple(ctx[size - n :]))
            if start is not None and start < size - n:  # an earlier occurrence, so a continuation exists
                return ctx[start + n : start + n + most]
        return []

    def confirmed(self, row: int, drafted: int, kept: int) -> None:
        """Count what the model kept of the row's draft."""
        self._drafted[row] += drafted
        self._kept[row] += kept

    def odds(self, row: int) -> float:
        """The chance that the row's next draft token is confirmed: its share so far, starting from one half."""
        return (self._kept[row] + 1) / (self._drafted[row] + 2)


# What one more token row costs a decode forward, as a share of the forward's fixed cost (reading every weight once):
# forward seconds ~ 1 + RATIO x (rows x width). Fitted to SmolLM2-135M decode forwards of 1-32 rows x 1-6 columns
# over a 250-token cache (docs/performance.md): a CPU core in fp32 0.048, in bf16 0.007 (AVX-512 BF16), a GPU far
# below either (its forwards are latency-bound at these sizes). Both parts grow with the model's size, so the ratio
# carries over to other sizes better than either part does.
COLUMN_COST = {("cpu", False): 0.048, ("cpu", True): 0.007}
GPU_COLUMN_COST = 0.0005


class DraftWidth:
    """How many columns each decode forward runs: the pending token and up to ``width - 1`` draft tokens per row.

    A wider forward costs more, by how much depends on the hardware: in fp32 on a CPU core 6 columns of 24 rows took
    3.7x one column, in bf16 on the same core 1.7x, on a GPU about the same as one. Each step takes the width with the
    most expected progress per unit of cost. A batch runs until its last row ends, so the progress that counts is
    that of the rows furthest behind: ``1 + mean over them of p + p^2 + ...`` up to the row's draft length (``p`` the
    row's confirmed share so far), against ``1 + ratio x rows x width``; the rows ahead fill the same columns with
    their own drafts for free. The ratio is the device's and
    precision's (``COLUMN_COST``), never a timing, so the same run chooses the same widths and gives the same
    answers every time."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    @classmethod
    def on(cls, device: Any, sixteen_bit: bool) -> DraftWidth:
        kind = torch.device(device).type
        return cls(COLUMN_COST.get((kind, sixteen_bit), COLUMN_COST[("cpu", False)]) if kind == "cpu"
                   else GPU_COLUMN_COST)

    def choose(self, drafts: list[list[int]], odds: list[float], behind: list[bool]) -> int:
        """The width for these drafts (1: decode one token per row). ``behind``: the rows with the fewest tokens so
        far, whose progress sets how many more forwards the batch runs (it runs until its last row ends)."""
        longest = max(map(len, drafts), default=0)
        rows, late = len(drafts), max(1, sum(behind))
        best, best_rate = 1, 1 / (1 + self.ratio * rows)
        for width in range(2, longest + 2):
            gain = sum(sum(p**j for j in range(1, min(width - 1, len(d)) + 1))
                       for d, p, b in zip(drafts, odds, behind, strict=True) if b)
            rate = (1 + gain / late) / (1 + self.ratio * rows * width)
            if rate > best_rate:
                best, best_rate = width, rate
        return best
