"""A faster, mixed-precision-safe forward for peft's LoRA ``Linear`` layers (weights and checkpoints unchanged).

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` and casts the sum back to the base output's dtype.
Two things follow, both measured on SmolLM2-135M (LoRA r=16 on every linear layer, batch 4 x ~290 tokens, 2-core
CPU; ``benchmarks/cpu_sft.py``):

- Under bf16 autocast the adapter's contribution is added to a base output that is already a bf16 number, and the
  sum is rounded back to bf16. A young adapter's contribution (a few 1e-3 of the output) is below half a bf16 step
  (2^-9 relative), so it rounds away: an update makes the model no better although its gradient says it should.
  After one to five AdamW steps the loss was 0.08-0.22 above fp32 (``benchmarks/results/lora_bf16_drift.md``). Here
  the sum is formed in the adapter's dtype (fp32) and stays there, while the base matmul still runs in 16 bits
  (where the FLOPs are); the same steps then match fp32 within 0.035.
- ``nn.Dropout`` draws a float Bernoulli mask with a slow RNG path, and the dropped copy of ``x`` is saved for
  ``lora_A``'s gradient: on a CPU about a third of the step went to dropout. Here the mask comes from 16 random bits
  per element (four per 64-bit draw), is saved as one byte per element, and the dropped input is recomputed in the
  backward pass from ``x``, which is saved once however many adapters read it (q/k/v share it, as do gate/up).

The distribution is the same: each element is kept independently with probability ``1 - p`` (``p`` rounded to a
multiple of 2^-16, and the kept values scaled by the inverse of that exact keep rate, so the expectation is ``x``).
The random numbers come from torch's generator, so seeding, checkpoint/resume and activation-checkpointing
recomputation (which restores the RNG state) draw the same masks; only the stream differs from ``nn.Dropout``'s.

Anything this path does not cover (merged or disabled adapters, several active adapters, DoRA and other variants,
``lora_bias``, mixed-adapter batches, hooks on the adapter modules, a base layer that is not ``nn.Linear``) falls back
to peft's own forward at call time.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_SPAN = 1 << 16
_LOWEST = -(1 << 15)


def effective_p(p: float) -> float:
    """The drop probability actually used: ``p`` rounded to a multiple of 2^-16."""
    return round(p * _SPAN) / _SPAN


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str) -> torch.Tensor:
    """Boolean mask, True where an element is kept: each independently with probability ``1 - effective_p(p)``.

    One 64-bit draw gives four uniform 16-bit numbers: a quarter of the generator calls of a float mask.
    """
    n = math.prod(shape)
    draws = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    return (draws.view(torch.int16)[:n] >= _LOWEST + round(p * _SPAN)).view(tuple(shape))


class _LoraBranch(torch.autograd.Function):
    """``scaling * B(A(dropout(x)))`` in the adapter's dtype. Saves ``x`` (no copy), a byte mask and the rank-r
    projection; the dropped input is recomputed in the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, p: float, scaling: float) -> torch.Tensor:
        dtype = a.dtype
        with torch.autocast(x.device.type, enabled=False):
            xa = x.to(dtype)
            keep, scale = None, 1.0
            if p > 0:
                keep = keep_mask(x.shape, p, x.device)
                scale = 1.0 / (1.0 - effective_p(p))
                xa = xa * keep.to(dtype)  # a new tensor: x itself is never modified
                xa.mul_(scale)
            u = (xa @ a.t()).mul_(scaling)  # [..., r]: scaled here, on r values per token rather than out_features
            out = u @ b.t()
        ctx.scale, ctx.scaling = scale, scaling
        ctx.save_for_backward(x, keep, u, a, b)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, keep, u, a, b = ctx.saved_tensors
        dtype = a.dtype
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.to(dtype)
            r = u.shape[-1]
            grad_b = g.reshape(-1, g.shape[-1]).t() @ u.reshape(-1, r)
            grad_u = (g @ b).mul_(ctx.scaling)  # through u = scaling * (xa @ a.t())
            xa = x.to(dtype)
            kf = None
            if keep is not None:
                kf = keep.to(dtype)
                xa = (xa * kf).mul_(ctx.scale)
            grad_a = grad_u.reshape(-1, r).t() @ xa.reshape(-1, xa.shape[-1])
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = grad_u @ a
                if kf is not None:
                    grad_x.mul_(kf).mul_(ctx.scale)
                grad_x = grad_x.to(x.dtype)
        return grad_x, grad_a, grad_b, None, None


def _fast_adapter(layer: Any, args: tuple, kwargs: dict) -> str | None:
    """The active adapter's name when the fused forward computes what peft's would; None otherwise."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "lora_bias", {}).get(name, False):
        return None
    base, a, b, drop = layer.base_layer, layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if type(base) is not nn.Linear or type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None \
            or b.bias is not None or type(drop) not in (nn.Dropout, nn.Identity):
        return None
    if type(drop) is nn.Dropout and (not 0.0 <= drop.p < 1.0 or (drop.p > 0 and effective_p(drop.p) == 0)):
        return None  # p below 2^-17 would round to no dropout at all: peft's own dropout keeps it
    if any(m._forward_hooks or m._forward_pre_hooks for m in (base, a, b, drop)):
        return None
    return name


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = _fast_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    a, b, drop = self.lora_A[name].weight, self.lora_B[name].weight, self.lora_dropout[name]
    w = base.weight
    if w.dtype in (torch.float16, torch.bfloat16):
        # Frozen weights stored in 16 bits (mixed precision with LoRA): the matmul runs in 16 bits, as autocast
        # would run it, whether autocast is on or not; the bias is added in the adapter's dtype.
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x.to(w.dtype), w).to(a.dtype)
        if base.bias is not None:
            y = y + base.bias.to(a.dtype)
    else:
        y = base(x).to(a.dtype)
    p = drop.p if self.training and type(drop) is nn.Dropout else 0.0
    return y + _LoraBranch.apply(x, a, b, p, float(self.scaling[name]))


def fuse_lora(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` of ``model`` the fused forward; returns how many layers have it.

    The output is in the adapter's dtype (fp32), so the adapter's contribution is never rounded to 16 bits.
    Idempotent; saving, loading and merging stay peft's (only ``forward`` changes, per instance).
    """
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency
        return 0
    n = 0
    for m in model.modules():
        if type(m) is LoraLinear:
            m.forward = types.MethodType(_fused_forward, m)
            n += 1
    return n
