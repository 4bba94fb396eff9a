"""The fused LoRA forward of :mod:`surefit.training.speedups.lora_fast`, without its per-call overhead, for
generation: the same numbers bit for bit, fewer operations per decode step.

Why: a decode step multiplies one token per row, so the matmuls are small and the fixed cost per layer dominates. The
training forward casts the adapter to 16 bits, goes through an autograd ``Function`` and looks up a shared cast of the
input at every call, in every adapted layer. Here the 16-bit copies of A and B are made once for the whole
generation and each layer runs the same matmuls and additions, in the same order and dtypes, and nothing else. The
adapter stays unmerged, so nothing is rounded differently (merging into 16-bit weights would round ``W + B @ A``,
dropping most of a young adapter's contribution: ``--eval_merge_lora``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from surefit.eval.generate_speedups import LastCast
from surefit.training.speedups.lora_fast import fast_adapter, fused_forward, is_lora_linear


def _lean_mixed(x: torch.Tensor, *, w: torch.Tensor, bias: torch.Tensor | None, ah: torch.Tensor, bh: torch.Tensor,
                scaling: float, out_dtype: torch.dtype, cast: LastCast) -> torch.Tensor:
    # _LoraMixed.forward with p = 0, its 16-bit adapter copies made once, the input's cast shared.
    with torch.autocast(x.device.type, enabled=False):
        xh = cast(x, w.dtype)
        u = (xh @ ah.t()).mul_(scaling)
        out = F.linear(xh, w).to(out_dtype)
        out.add_(u @ bh.t())
        if bias is not None:
            out.add_(bias)
    return out


def _lean_full(x: torch.Tensor, *, base: Any, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    # fused_forward's fp32 branch (base output + _LoraBranch with p = 0), without the autograd Function.
    y = base(x).to(a.dtype)
    with torch.autocast(x.device.type, enabled=False):
        out = (x.to(a.dtype) @ a.t()).mul_(scaling) @ b.t()
    return y + out


@contextlib.contextmanager
def lean_lora(model: Any) -> Iterator[int]:
    """Within this context (no gradients), each LoRA layer that runs surefit's fused forward computes the same output
    with fewer operations; yields how many layers. Layers on peft's own forward are left as they are. Restored on
    exit, also after an error; the adapter and base weights are only read."""
    changed: list[tuple[Any, Any]] = []
    cast = LastCast()
    try:
        for layer in model.modules():
            forward = layer.__dict__.get("forward")
            if not is_lora_linear(layer) or getattr(forward, "__func__", None) is not fused_forward:
                continue
            name = fast_adapter(layer, (), {})
            if name is None:
                continue
            base = layer.base_layer
            a, b = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()
            w, scaling = base.weight, float(layer.scaling[name])
            if w.dtype in (torch.float16, torch.bfloat16) and not w.requires_grad \
                    and (base.bias is None or not base.bias.requires_grad):
                bias = None if base.bias is None else base.bias.detach().to(a.dtype)
                lean = functools.partial(_lean_mixed, w=w.detach(), bias=bias, ah=a.to(w.dtype), bh=b.to(w.dtype),
                                         scaling=scaling, out_dtype=a.dtype, cast=cast)
            else:
                lean = functools.partial(_lean_full, base=base, a=a, b=b, scaling=scaling)
            changed.append((layer, forward))
            layer.forward = lean
        yield len(changed)
    finally:
        cast.source = cast.cast = None
        for layer, forward in reversed(changed):
            layer.forward = forward
