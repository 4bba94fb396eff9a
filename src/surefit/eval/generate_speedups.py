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


def reserve(cache: Any, room: int) -> int:
    """Replace each plain full-attention layer of ``cache`` by a :class:`Reserved` one with ``room`` more slots;
    other layer kinds (sliding windows, linear attention, quantized) stay as they are. Returns how many changed."""
    n = 0
    for i, layer in enumerate(getattr(cache, "layers", [])):
        keys, values = layer.keys, layer.values
        if type(layer) is DynamicLayer and layer.is_initialized and keys is not None and values is not None \
                and keys.dim() == 4:
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
