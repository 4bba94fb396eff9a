"""A faster, mixed-precision-safe forward for peft's LoRA ``Linear`` layers (weights and checkpoints unchanged).

- Under bf16 autocast peft adds the adapter's output to a bf16 base output and rounds the sum to bf16, so a young
  adapter's small contribution rounds away. Here every matmul still runs in 16 bits, but the sum (and the input's
  gradient) is formed in fp32 (``_LoraMixed``); a gated MLP's gate and up, in training on a CPU, are summed in one
  matmul's fp32 accumulator and rounded once instead (:data:`GATE_UP_16`).
- Dropout draws 16-bit random numbers, keeps its mask as one bit per element (:func:`pack_mask`) and recomputes the
  dropped input in the backward pass (same distribution; seeds, resume and checkpoint replays draw the same masks).
- :class:`SavedActivationsIn` stores fp32 saved activations in bf16, and ``_SwiGLUDown`` (16-bit frozen weights) and
  ``_SwiGLULora`` (fp32) keep only ``gate`` and ``up`` of a gated MLP for the backward pass.
- On a CPU the gated MLP's backward and the RMSNorm run their elementwise chains on cache-sized row chunks.

Anything else (merged or disabled adapters, several active adapters, DoRA, ``lora_bias``, hooks, a non-``nn.Linear``
base) falls back to peft's own forward at call time. Why and what was measured: docs/performance.md.
"""

from __future__ import annotations

import math
import re
import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from surefit.models import plain_lora_adapter
from surefit.threads import check_threads
from surefit.training.dropout import SeededDropout
from surefit.training.heap import release_free_memory

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


def _draw(shape: torch.Size, p: float, drop: nn.Module | None, device: torch.device) -> tuple[torch.Tensor, float]:
    """``(keep mask, the drop probability it keeps by)``: a :class:`SeededDropout`'s mask in a training micro-batch
    (the same one peft's path draws, whatever rows share the micro-batch), else :func:`keep_mask`'s."""
    if isinstance(drop, SeededDropout):
        keep = drop.keep(shape, device)
        if keep is not None:
            return keep, effective_p(p)
    return keep_mask(shape, p, device), effective_p(p)


# The adapter's weight gradients are sums over every token of a micro-batch. Computed by 16-bit matmuls they would be
# rounded to 16 bits once per micro-batch, so how a step is cut into micro-batches (an out-of-memory split) would
# change the update by up to 2^-9 of it; they are rank-r, so summing them in fp32 is cheap (docs/memory.md).
ADAPTER_GRADS_FP32 = True


def _reduce(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left^T @ right`` over all tokens (``[..., m]``, ``[..., n]`` -> ``[m, n]``), in fp32 (see above)."""
    left, right = left.reshape(-1, left.shape[-1]), right.reshape(-1, right.shape[-1])
    dtype = torch.float32 if ADAPTER_GRADS_FP32 else right.dtype
    if right.device.type == "cpu" and right.shape[1] < left.shape[1]:
        # B's gradient ([out, r]): as (right^T @ left)^T with right^T made row-major in the cast, the CPU's matmul
        # runs 1.4-1.6x as fast as over left's transposed view. The same sums; the same bits with one thread, while
        # with several the library may split them otherwise (docs/performance.md).
        rt = torch.empty((right.shape[1], right.shape[0]), dtype=dtype, device=right.device).copy_(right.t())
        return (rt @ left.to(dtype)).t()
    return left.t().to(dtype) @ right.to(dtype)


def _row_major_t(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``b`` in ``dtype`` as the transposed view of a row-major ``b^T`` (one copy, as the cast alone was): the
    forward's ``u @ b^T`` (inner dimension r) then reads a row-major operand, 1.7x as fast on a CPU (the same bits
    with one thread; see :func:`_reduce`)."""
    return torch.empty((b.shape[1], b.shape[0]), dtype=dtype, device=b.device).copy_(b.t()).t()


def _masked(x: torch.Tensor, kf: torch.Tensor | None) -> torch.Tensor:
    """``x * kf`` (``x`` 16-bit, ``kf`` its mask as :func:`_as` gives it) as :func:`_reduce` takes it: in fp32 under
    :data:`ADAPTER_GRADS_FP32`, written by the product itself (the product is exact, so these are the numbers of the
    product and a cast after it, in one operation instead of two)."""
    if kf is None or not ADAPTER_GRADS_FP32:
        return x if kf is None else x * kf
    return torch.mul(x, kf, out=torch.empty(x.shape, dtype=torch.float32, device=x.device))


# Masks kept for the backward pass as bits rather than bytes: one byte per element was 26% of what a SmolLM2-135M chat
# step saved (217 of 842 MB). The same mask comes back, so the gradients are unchanged to the bit (tested).
PACK_MASKS = True


def pack_mask(keep: torch.Tensor) -> torch.Tensor:
    """A boolean mask as uint8 bits, eight elements per byte (:func:`unpack_mask` gives it back).

    On a CPU numpy's ``packbits`` (one pass; the torch version below took 3-7x longer both ways on SmolLM2's
    shapes). Elsewhere, and under torch.compile, two torch operations (each one a kernel launch on a GPU): the mask's
    bytes, eight to a row, times their bits' values, summed (distinct powers of two: at most 255, exact)."""
    flat = keep.reshape(-1)
    if flat.device.type == "cpu" and not torch.compiler.is_compiling():
        import numpy as np

        return torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
    flat = flat.view(torch.uint8)
    n = flat.numel()
    if n % 8:
        flat = torch.cat([flat, flat.new_zeros(-n % 8)])
    words = flat.view(-1, 8).mul(_bit_values(flat.device))
    if torch.compiler.is_compiling():
        # inductor's vectorised uint8 sum on an AVX2 CPU (torch 2.13) kept only the low bits of each byte, and the
        # gradients came out wrong with the loss right; summed in int32 and cast back, every bit is kept
        return words.sum(-1, dtype=torch.int32).to(torch.uint8)
    return words.sum(-1, dtype=torch.uint8)


def unpack_mask(bits: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """:func:`pack_mask`'s input back, as uint8 0/1 of ``shape`` (what :func:`_as` takes)."""
    n = math.prod(shape)
    if bits.device.type == "cpu" and not torch.compiler.is_compiling():
        import numpy as np

        return torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little")).view(tuple(shape))
    y = bits[:, None].bitwise_right_shift(_bit_values(bits.device, shifts=True)).bitwise_and_(1)
    return y.view(-1)[:n].view(tuple(shape))


_bits: dict[tuple[str, bool], torch.Tensor] = {}


def _bit_values(device: torch.device, shifts: bool = False) -> torch.Tensor:
    """uint8 ``[1, 2, 4, ..., 128]`` (or ``[0, 1, ..., 7]`` for ``shifts``) on ``device``, made once per device."""
    key = (str(device), shifts)
    if key not in _bits:
        k = torch.arange(8, dtype=torch.uint8)
        _bits[key] = (k if shifts else torch.ones(8, dtype=torch.uint8) << k).to(device)
    return _bits[key]


def _saved_mask(ctx: Any, keep: torch.Tensor | None) -> torch.Tensor | None:
    """What a function saves of its mask: bits under :data:`PACK_MASKS` (the shape kept on ``ctx``)."""
    ctx.mask_shape = None
    if keep is None or not PACK_MASKS:
        return keep
    ctx.mask_shape = keep.shape
    return pack_mask(keep)


def _restored_mask(ctx: Any, keep: torch.Tensor | None) -> torch.Tensor | None:
    return keep if ctx.mask_shape is None or keep is None else unpack_mask(keep, ctx.mask_shape)


# Devices where a mask is converted to the other operand's dtype before a product. Elsewhere the product takes the
# boolean mask as it is: one kernel launch instead of two on a GPU, the same products (x * 1 and x * 0).
CAST_MASKS_ON = {"cpu"}


def _as(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as a factor of a product with a ``dtype`` tensor: 0/1 in ``dtype`` on a CPU (through uint8:
    converting bool directly, or ``where``, or multiplying by a bool tensor was 3-7x slower there than this conversion
    and a same-dtype multiply together); elsewhere the mask itself (:data:`CAST_MASKS_ON`)."""
    if keep.device.type not in CAST_MASKS_ON:
        return keep.view(torch.bool)
    return keep.view(torch.uint8).to(dtype)


def _check_threads() -> None:
    """Per layer, so that a neighbour arriving mid-step is seen within the step (threads.py); not traced by
    torch.compile, which would otherwise fold the governor's clock readings into the graph."""
    if not torch.compiler.is_compiling():
        check_threads()


def plus_product(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``y + u @ b.T`` as one ``addmm`` (the product accumulates onto ``y``), for any leading dimensions."""
    return torch.addmm(y.reshape(-1, y.shape[-1]), u.reshape(-1, u.shape[-1]), b.t()).view(y.shape)


class _LoraBranch(torch.autograd.Function):
    """``y + scaling * B(A(dropout(x)))`` in the adapter's dtype, ``y`` the base layer's output. Saves ``x`` (no
    copy), a bit mask and the rank-r projection; the dropped input is recomputed in the backward pass.

    The sum is the last product's accumulation (``addmm``): a separate ``y + branch`` writes and reads another
    output-sized tensor per layer, which cost as much as the product itself in a profiled fp32 step."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, p: float,
                scaling: float, drop: nn.Module | None = None) -> torch.Tensor:
        _check_threads()
        dtype = a.dtype
        with torch.autocast(x.device.type, enabled=False):
            xa = x.to(dtype)
            keep, scale = None, 1.0
            if p > 0:
                keep, p_used = _draw(x.shape, p, drop, x.device)
                scale = 1.0 / (1.0 - p_used)
                xa = xa * _as(keep, dtype)  # a new tensor: x itself is never modified
                xa.mul_(scale)
            u = (xa @ a.t()).mul_(scaling)  # [..., r]: scaled here, on r values per token rather than out_features
            out = plus_product(y, u, b)
        ctx.scale, ctx.scaling = scale, scaling
        recipe = _norm_recipe(x)
        ctx.norm_dtype = None if recipe is None else recipe[3]
        if recipe is None:
            ctx.save_for_backward(x, _saved_mask(ctx, keep), u, a, b, None, None, None)
        else:  # x is a norm's output: keep what the norm keeps anyway and make x again in the backward pass
            ctx.save_for_backward(None, _saved_mask(ctx, keep), u, a, b, *recipe[:3])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _check_threads()
        x, keep, u, a, b, nx, nr, nw = ctx.saved_tensors
        if ctx.norm_dtype is not None:
            x = _norm_again(nx, nr, nw, ctx.norm_dtype)
        keep = _restored_mask(ctx, keep)
        dtype = a.dtype
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.to(dtype)
            r = u.shape[-1]
            grad_b = g.reshape(-1, g.shape[-1]).t() @ u.reshape(-1, r)
            grad_u = (g @ b).mul_(ctx.scaling)  # through u = scaling * (xa @ a.t())
            xa = x.to(dtype)
            kf = None
            if keep is not None:
                kf = _as(keep, dtype)
                xa = (xa * kf).mul_(ctx.scale)
            grad_a = grad_u.reshape(-1, r).t() @ xa.reshape(-1, xa.shape[-1])
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = grad_u @ a
                if kf is not None:
                    grad_x.mul_(kf).mul_(ctx.scale)
                grad_x = grad_x.to(x.dtype)
        return grad if ctx.needs_input_grad[0] else None, grad_x, grad_a, grad_b, None, None, None


class _LoraMixed(torch.autograd.Function):
    """``base(x) + scaling * B(A(dropout(x)))`` for 16-bit frozen base weights: every matmul in 16 bits (where the
    FLOPs are, and what autocast would run), the sum and the output in fp32 (where the adapter's contribution would
    otherwise round away), the input gradient summed in fp32.

    Saves the shared 16-bit copy of ``x`` (one for q, k and v), a bit mask, the rank-r projection and 16-bit copies
    of the adapter; the dropped input is recomputed in the backward pass. The adapter's gradients come from 16-bit
    matmuls with fp32 accumulation, as under autocast, and are returned in the adapter's dtype.

    Where ``x`` is an RMSNorm's output (q/k/v, gate/up), the 16-bit copy is not kept: the norm's input and row scale,
    which the norm keeps anyway, make it again in the backward pass, once for the adapters sharing it
    (:func:`_low_norm_again`). Only the A gradient reads it. Under :class:`SavedActivationsIn` the norm's input comes
    back rounded to bf16, so the copy made again can differ from the forward's by one bf16 step in some elements.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, xh: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, adapter: tuple[float, float, nn.Module | None, bool]
                ) -> torch.Tensor:
        _check_threads()
        # dropout p, LoRA scaling, the dropout module, whether the output stays 16-bit (_gate_up): one argument
        p, scaling, drop, low = adapter
        dt = w.dtype
        with torch.autocast(x.device.type, enabled=False):
            ah, bh = a.to(dt), _row_major_t(b, dt)
            keep, xd = None, xh
            if p > 0:
                keep, p_used = _draw(x.shape, p, drop, x.device)
                xd = xh * _as(keep, dt)  # a new tensor: xh is shared with the other adapters reading x
                scaling = scaling / (1.0 - p_used)  # dropout's rescale, applied to r values per token
            u = (xd @ ah.t()).mul_(scaling)  # [..., r]
            if low:
                # One matmul over [x | u] and [W | B]: the adapter is summed with the frozen product in the matmul's
                # fp32 accumulator and the sum rounded once. Rounding W x to 16 bits first and adding u B^T to it
                # (an addmm onto the 16-bit product) would drop whatever part of a young adapter's term is below
                # half a 16-bit step, every time: measured as a step-2 loss 0.019 above fp32's, against 0.001.
                out = F.linear(torch.cat([xh, u], dim=-1), torch.cat([w, bh], dim=1))
            else:
                out = F.linear(xh, w).to(a.dtype)
                out.add_(u @ bh.t())
            if bias is not None:
                out.add_(bias)
        ctx.scaling, ctx.x_dtype = scaling, x.dtype
        recipe = _norm_recipe(x) if NORM_RECIPES_16 else None
        ctx.norm = None if recipe is None else (recipe[3], recipe[5])
        if recipe is None:
            ctx.save_for_backward(xh, _saved_mask(ctx, keep), u, w, ah, bh, None, None, None)
        else:  # x is a norm's output: keep what the norm keeps anyway and make xh again in the backward pass
            ctx.save_for_backward(None, _saved_mask(ctx, keep), u, w, ah, bh, *recipe[:3])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _check_threads()
        xh, keep, u, w, ah, bh, nx, nr, nw = ctx.saved_tensors
        keep = _restored_mask(ctx, keep)
        needs = ctx.needs_input_grad
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.to(w.dtype)
            grad_b = _reduce(grad if ADAPTER_GRADS_FP32 else g, u) if needs[5] else None
            grad_u = (g @ bh).mul_(ctx.scaling)  # through u = scaling * (dropout(x) @ a.t())
            grad_a = None
            if needs[4]:
                if ctx.norm is not None:
                    xh = _low_norm_again(nx, nr, nw, ctx.norm, w.dtype)
                kf = None if keep is None else _as(keep, xh.dtype)
                grad_a = _reduce(grad_u, _masked(xh, kf))
            grad_x = None
            if needs[0]:
                gx = grad_u @ ah
                if keep is not None:
                    gx.mul_(kf if needs[4] else _as(keep, gx.dtype))
                grad_x = (g @ w).float().add_(gx).to(ctx.x_dtype)  # the two paths summed in fp32
        return (grad_x, None, None, None, None if grad_a is None else grad_a.float(),
                None if grad_b is None else grad_b.float(), None)


class _SwiGLUDown(torch.autograd.Function):
    """``down_proj(silu(gate) * up)`` for a LoRA ``down_proj`` on 16-bit frozen weights: what ``_LoraMixed`` computes
    for it, with the MLP's product made here.

    Why: the product ``h`` is only ever used rounded to 16 bits (both of ``down_proj``'s matmuls run in 16 bits), yet
    unfused, autograd kept ``silu(gate)``, ``up`` and ``gate`` for the product and the activation, and ``down_proj``
    kept its 16-bit copy of ``h``: four tensors of the MLP's width per token. Here only ``gate`` and ``up`` are saved
    (in 16 bits as :func:`_gate_up` makes them, or in bf16 under :class:`SavedActivationsIn`, read so by the backward)
    and ``h`` is recomputed in the backward pass:
    on SmolLM2-135M, 12.3 -> 6.1 KB per token and layer, a fifth of everything saved. Dropout draws its mask as
    ``_LoraMixed`` does, at the same point of the random stream.
    """

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, adapter: tuple[float, float, nn.Module | None]) -> torch.Tensor:
        _check_threads()
        p, scaling, drop = adapter  # as _LoraMixed's, without its last element
        dt = w.dtype
        with torch.autocast(gate.device.type, enabled=False):
            h = _swiglu_low(gate, up, dt)
            ah, bh = a.to(dt), _row_major_t(b, dt)
            keep, xd = None, h
            if p > 0:
                keep, p_used = _draw(h.shape, p, drop, h.device)
                xd = h * _as(keep, dt)
                scaling = scaling / (1.0 - p_used)
            u = (xd @ ah.t()).mul_(scaling)
            out = F.linear(h, w).to(a.dtype)
            out.add_(u @ bh.t())
            if bias is not None:
                out.add_(bias)
        ctx.scaling, ctx.dtypes = scaling, (gate.dtype, up.dtype)
        ctx.save_for_backward(_read_low(gate), _read_low(up), _saved_mask(ctx, keep), u, w, ah, bh)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _check_threads()
        gate, up, keep, u, w, ah, bh = ctx.saved_tensors
        keep = _restored_mask(ctx, keep)
        needs = ctx.needs_input_grad
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.to(w.dtype)
            grad_b = _reduce(grad if ADAPTER_GRADS_FP32 else g, u) if needs[5] else None
            grad_u = (g @ bh).mul_(ctx.scaling)
            kf = None if keep is None else _as(keep, w.dtype)
            paths = None
            if needs[0] or needs[1]:
                paths = (g @ w, grad_u @ ah)  # dL/dh through the frozen weight and through the adapter
            hd, grad_gate, grad_up = _swiglu_backward(gate, up, kf, paths, w.dtype, (needs[4], *ctx.dtypes))
            grad_a = _reduce(grad_u, hd) if hd is not None else None
        return (grad_gate if needs[0] else None, grad_up if needs[1] else None, None, None,
                None if grad_a is None else grad_a.float(), None if grad_b is None else grad_b.float(), None)


def _read_low(t: torch.Tensor) -> torch.Tensor:
    """``t`` to save, marked as read in 16 bits by its backward: :class:`SavedActivationsIn` then gives it back in
    bf16 as it stored it, and the backward turns it into fp32 chunk by chunk rather than whole. Elsewhere (no store,
    or gradient checkpointing's own hooks, which recompute it) it is saved and comes back as it is."""
    if t.dtype != torch.float32:
        return t
    t = t.detach()  # a new tensor object: the mark is this save's, not the tensor's other readers'
    t._surefit_read_low = True  # type: ignore[attr-defined]  # a new attribute, read by SavedActivationsIn.pack
    return t


# Elements of the gated MLP's backward and the RMSNorm handled at a time on a CPU: their chains of elementwise passes
# over [tokens, width] then run in the core's cache instead of streaming fp32 tensors through memory each
# (docs/performance.md, benchmarks/row_chunks.py). Elsewhere the whole tensor is one chunk (one launch per operation).
CPU_CHUNK_ELEMENTS = 1 << 17


def _swiglu_low(gate: torch.Tensor, up: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32 and rounded to ``low``, on row chunks of :data:`CPU_CHUNK_ELEMENTS` on a
    CPU: no fp32 tensor of the MLP's width is made whole (the chunks change no value)."""
    width = gate.shape[-1]
    g2, u2 = gate.reshape(-1, width), up.reshape(-1, width)
    h = torch.empty(g2.shape, dtype=low, device=gate.device)
    rows = g2.shape[0]
    step = max(1, CPU_CHUNK_ELEMENTS // width) if gate.device.type == "cpu" else max(rows, 1)
    for i in range(0, rows, step):
        rs = slice(i, i + step)
        torch.mul(F.silu(g2[rs].float()), u2[rs], out=h[rs])
    return h.view(gate.shape)


def _swiglu_backward(gate: torch.Tensor, up: torch.Tensor, kf: torch.Tensor | None,
                     paths: tuple[torch.Tensor, torch.Tensor] | None, low: torch.dtype,
                     want: tuple[bool, torch.dtype, torch.dtype]) -> tuple[torch.Tensor | None, ...]:
    """``(h dropped, dL/dgate, dL/dup)`` of ``h = silu(gate) * up``, each None unless asked for.

    ``paths``: dL/dh's two 16-bit parts (through the frozen weight, through the adapter), summed here in fp32 after the
    adapter's part is masked; ``want``: whether the adapter's A needs ``h`` rounded to ``low`` and dropped (returned in
    fp32 under :data:`ADAPTER_GRADS_FP32`, as :func:`_masked` gives it), and the dtypes of the gate and up gradients.
    All arithmetic in fp32, on row chunks of :data:`CPU_CHUNK_ELEMENTS` on a CPU.
    """
    want_h, gate_dtype, up_dtype = want
    width = gate.shape[-1]
    g2, u2 = gate.reshape(-1, width), up.reshape(-1, width)
    k2 = None if kf is None else kf.reshape(-1, width)
    rows, dev = g2.shape[0], gate.device

    def empty(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((rows, width), dtype=dtype, device=dev)

    hd = empty(torch.float32 if ADAPTER_GRADS_FP32 else low) if want_h else None
    grads = None
    if paths is not None:
        gw, gx = (p.reshape(-1, width) for p in paths)
        grads = empty(gate_dtype), empty(up_dtype)
    step = max(1, CPU_CHUNK_ELEMENTS // width) if dev.type == "cpu" else rows
    for i in range(0, rows, step):
        rs = slice(i, i + step)
        gf, uc = g2[rs].float(), u2[rs]
        silu = F.silu(gf)
        kc = None if k2 is None else k2[rs]
        if hd is not None:
            h = (silu * uc).to(low)
            if kc is None:
                hd[rs].copy_(h)
            else:
                torch.mul(h, kc, out=hd[rs])
        if grads is not None:
            gxc = gx[rs] if kc is None else gx[rs] * kc
            grad_h = gw[rs].float().add_(gxc)  # the two paths summed in fp32, as in _LoraMixed
            torch.mul(grad_h, silu, out=grads[1][rs])
            torch.ops.aten.silu_backward.grad_input(grad_h.mul_(uc), gf, grad_input=grads[0][rs])
    shape = gate.shape
    if grads is None:
        return None if hd is None else hd.view(shape), None, None
    return None if hd is None else hd.view(shape), grads[0].view(shape), grads[1].view(shape)


_SWIGLU_FORWARDS = {  # the MLP forwards whose computation _fused_mlp_forward reproduces (125 transformers models)
    ("down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))", "return down_proj"),
    ("return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",),
}
_swiglu_classes: dict[type, bool] = {}


def _is_swiglu_mlp(m: nn.Module) -> bool:
    """True for a module whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU
    ``act_fn`` (Llama, Qwen2/3, Mistral, SmolLM and most decoder MLPs in transformers), read from its source."""
    act = getattr(m, "act_fn", None)
    if act is None or not (type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation"):
        return False
    if not all(isinstance(getattr(m, k, None), nn.Module) for k in ("gate_proj", "up_proj", "down_proj")):
        return False
    cls = type(m)
    if cls not in _swiglu_classes:
        head, body = _forward_body(cls)
        _swiglu_classes[cls] = head.startswith("defforward(self,x)") and body in _SWIGLU_FORWARDS
    return _swiglu_classes[cls]


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, saving gate and up only: autograd's two operations also keep ``silu(gate)``, another
    tensor of the MLP's width per layer, which the backward pass recomputes here (one elementwise pass). The same
    forward and the same gradients, bit for bit: the backward runs autograd's own formulas in its order."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


class _SwiGLULora(torch.autograd.Function):
    """``down_proj(silu(gate) * up)`` for a LoRA ``down_proj`` whose frozen base is a plain ``nn.Linear`` in the
    adapter's dtype (fp32 LoRA, a CPU's default): what ``_SwiGLU``, the base layer and ``_LoraBranch`` compute, with
    the same operations in the same order (the same bits, tested), saving ``gate`` and ``up`` only.

    Why: unfused, the product ``h`` was kept for the adapter's A gradient beside the ``gate`` and ``up`` it is made
    from: a third tensor of the MLP's width per token and layer (on SmolLM2-135M a fifth of everything saved). The
    backward pass makes ``h`` again (one elementwise pass) and frees it with the layer's gradients. Dropout draws its
    mask as ``_LoraBranch`` does, at the same point of the random stream."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, adapter: tuple[float, float, nn.Module | None]) -> torch.Tensor:
        _check_threads()
        p, scaling, drop = adapter
        with torch.autocast(gate.device.type, enabled=False):
            h = F.silu(gate) * up
            y = F.linear(h, w, bias)  # the base nn.Linear's forward
            keep, scale, xa = None, 1.0, h
            if p > 0:
                keep, p_used = _draw(h.shape, p, drop, h.device)
                scale = 1.0 / (1.0 - p_used)
                xa = h * _as(keep, h.dtype)
                xa.mul_(scale)
            u = (xa @ a.t()).mul_(scaling)
            out = plus_product(y, u, b)
        ctx.scale, ctx.scaling = scale, scaling
        ctx.save_for_backward(gate, up, _saved_mask(ctx, keep), u, w, a, b)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _check_threads()
        gate, up, keep, u, w, a, b = ctx.saved_tensors
        keep = _restored_mask(ctx, keep)
        needs = ctx.needs_input_grad
        with torch.autocast(grad.device.type, enabled=False):
            r = u.shape[-1]
            grad_b = grad.reshape(-1, grad.shape[-1]).t() @ u.reshape(-1, r) if needs[5] else None
            grad_u = (grad @ b).mul_(ctx.scaling)
            silu = F.silu(gate)
            kf = None if keep is None else _as(keep, gate.dtype)
            grad_a = None
            if needs[4]:
                xa = silu * up  # h, as the forward made it
                if kf is not None:
                    xa = (xa * kf).mul_(ctx.scale)
                grad_a = grad_u.reshape(-1, r).t() @ xa.reshape(-1, xa.shape[-1])
                del xa
            grad_gate = grad_up = None
            if needs[0] or needs[1]:
                grad_h = grad_u @ a  # through the adapter, then through the frozen weight: autograd's two terms
                if kf is not None:
                    grad_h.mul_(kf).mul_(ctx.scale)
                grad_h = (grad @ w) + grad_h
                if needs[1]:
                    grad_up = grad_h * silu
                if needs[0]:
                    grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        return grad_gate, grad_up, None, None, grad_a, grad_b, None


def _fused_mlp_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    down = self.down_proj
    name = fast_adapter(down, (), {}) if not (args or kwargs) and is_lora_linear(down) else None
    w: Any = down.base_layer.weight if name is not None else None
    if name is None or w.dtype not in (torch.float16, torch.bfloat16) or w.requires_grad \
            or (down.base_layer.bias is not None and down.base_layer.bias.requires_grad) \
            or type(self.act_fn) is not self._surefit_act or _hooked(down) or _hooked(self.act_fn):
        # (down_proj and act_fn are not called as modules here, so their hooks would not run: peft's path then)
        if not (args or kwargs) and torch.is_grad_enabled() and type(self.act_fn) is self._surefit_act \
                and not _hooked(self.act_fn) and not torch.compiler.is_compiling():
            # fp32 LoRA, QLoRA's bitsandbytes down_proj: the same computation without silu(gate) kept
            gate, up = self.gate_proj(x), self.up_proj(x)
            if gate.is_floating_point() and up.is_floating_point() and gate.shape == up.shape:
                if name is not None and type(down.base_layer) is nn.Linear and not w.requires_grad \
                        and gate.dtype == up.dtype == w.dtype == down.lora_A[name].weight.dtype \
                        and (down.base_layer.bias is None or not down.base_layer.bias.requires_grad) \
                        and not _hooked(down) and not _hooked(down.base_layer):
                    # fp32 LoRA: the product not kept either, made again in the backward pass
                    drop = down.lora_dropout[name]
                    p = drop.p if down.training and isinstance(drop, nn.Dropout) else 0.0
                    return _SwiGLULora.apply(gate, up, w, down.base_layer.bias, down.lora_A[name].weight,
                                             down.lora_B[name].weight, (p, float(down.scaling[name]), drop))
                return self.down_proj(_SwiGLU.apply(gate, up))
            return self.down_proj(self.act_fn(gate) * up)
        return type(self).forward(self, x, *args, **kwargs)
    gate, up = _gate_up(self, x)
    if not (gate.is_floating_point() and up.is_floating_point()):
        return down(self.act_fn(gate) * up)
    drop = down.lora_dropout[name]
    p = drop.p if down.training and isinstance(drop, nn.Dropout) else 0.0
    bias = None if down.base_layer.bias is None else down.base_layer.bias.to(down.lora_A[name].weight.dtype)
    return _SwiGLUDown.apply(gate, up, w, bias, down.lora_A[name].weight, down.lora_B[name].weight,
                             (p, float(down.scaling[name]), drop))


# The RMSNorm forward of Llama, Qwen2/3, Mistral, SmolLM and most decoders in transformers, line for line.
_RMS_NORM_FORWARD = (
    "input_dtype = hidden_states.dtype",
    "hidden_states = hidden_states.to(torch.float32)",
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
    "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
    "return self.weight * hidden_states.to(input_dtype)",
)
_rms_norm_classes: dict[type, bool] = {}
FUSED_RMS_NORM = True  # False: transformers' own norm forward (benchmarks/gpu_profile.py --norm transformers)
# False: 16-bit adapters (_LoraMixed) keep their copy of a norm's output rather than make it again in the backward pass
NORM_RECIPES_16 = True


def _is_rms_norm(m: nn.Module) -> bool:
    """True for a module whose forward is exactly :data:`_RMS_NORM_FORWARD` (read from its source)."""
    cls = type(m)
    if cls not in _rms_norm_classes:
        _rms_norm_classes[cls] = isinstance(getattr(m, "weight", None), torch.Tensor) \
            and _forward_body(cls) == ("defforward(self,hidden_states)", _RMS_NORM_FORWARD)
    return _rms_norm_classes[cls]


def _forward_body(cls: type) -> tuple[str, tuple[str, ...]]:
    """A class's ``forward``: its ``def`` line without spaces or annotations, and its statements (comments out)."""
    try:
        import inspect

        lines = inspect.getsource(cls.forward).splitlines()  # type: ignore[attr-defined]
    except (OSError, TypeError, AttributeError):
        return "", ()
    lines = [ln for ln in lines if not ln.lstrip().startswith("@")]
    if not lines:
        return "", ()
    head = re.sub(r":[^,)]*", "", re.sub(r"->.*", "", lines[0]).strip().rstrip(":")).replace(" ", "")
    return head, tuple(ln.strip() for ln in lines[1:] if ln.strip() and not ln.strip().startswith("#"))


def _rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # torch's rms_norm: on a GPU one fused kernel each way where the forward above launches seven and its backward
    # about ten (113 norms in a Qwen3-0.6B step). On a CPU the same operations as above (bitwise equal, tested), in
    # training by _RmsNormCpu, whose backward is written out.
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    if x.device.type == "cpu" and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        if torch.compiler.is_compiling():  # dynamo traces no list filled inside a Function: no recipe there
            return _RmsNormCpu.apply(x, self.weight, self.variance_epsilon, dtype)
        box: list[torch.Tensor] = []
        y = _RmsNormCpu.apply(x, self.weight, self.variance_epsilon, dtype, box)
        if box:
            # How to make y again from what the norm saves anyway: an fp32 adapter reading y keeps these rather than
            # y itself (_LoraBranch). y's version now: an in-place change before the adapter reads it voids the recipe.
            y._surefit_norm = (x, box[0], self.weight, dtype, y._version, _NormKey())
        return y
    normed = F.rms_norm(x, (x.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed.to(dtype)


class _RmsNormCpu(torch.autograd.Function):
    """:data:`_RMS_NORM_FORWARD` on a CPU with its backward written out, both on row chunks of
    :data:`CPU_CHUNK_ELEMENTS`: autograd's backward of the norm is about ten passes over [tokens, width] in fp32, each
    streamed through memory, and it saved the input, the normed input and more; this saves the input and the row
    scale ``r`` and computes ``dx = r * (dn - x * r^2 * mean(dn * x))`` (``dn``: the gradient of the normed input)
    chunk by chunk. The forward's operations are the forward's above, in its order (bitwise equal, tested)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                box: list | None = None) -> torch.Tensor:
        _check_threads()
        width = x.shape[-1]
        x2 = x.reshape(-1, width)
        rows = x2.shape[0]
        r = torch.empty((rows, 1), dtype=torch.float32)
        # y itself is returned, not a view of a buffer: a model may then change it in place, as autograd allows
        y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, dtype))
        y2 = y.view(rows, width)
        step = max(1, CPU_CHUNK_ELEMENTS // width)
        for i in range(0, rows, step):
            xc, rc = x2[i:i + step], r[i:i + step]
            torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps, out=rc)
            torch.mul(weight, (xc * rc).to(dtype), out=y2[i:i + step])
        ctx.dtype = dtype
        ctx.save_for_backward(x, r, weight)
        if box is not None:
            box.append(r)  # the row scale, for _norm_again
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _check_threads()
        x, r, weight = ctx.saved_tensors
        width = x.shape[-1]
        x2, g2 = x.reshape(-1, width), grad.reshape(-1, width)
        rows = x2.shape[0]
        need_x, need_w = ctx.needs_input_grad[:2]
        dx = torch.empty((rows, width), dtype=torch.float32) if need_x else None
        dw = torch.zeros(width, dtype=torch.float32) if need_w else None
        step = max(1, CPU_CHUNK_ELEMENTS // width)
        for i in range(0, rows, step):
            xc, rc, gc = x2[i:i + step].float(), r[i:i + step], g2[i:i + step]
            if dw is not None:
                dw.add_((gc * (xc * rc).to(ctx.dtype)).sum(0))
            if dx is not None:
                dn = gc * weight  # the normed input's rounding to dtype passes the gradient straight through
                s = (dn * xc).sum(-1, keepdim=True).mul_(rc.pow(3)).div_(width)
                torch.mul(dn, rc, out=dx[i:i + step]).sub_(xc * s)
        return (None if dx is None else dx.view(x.shape), None if dw is None else dw.to(weight.dtype), None, None,
                None)


def _norm_again(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output of :class:`_RmsNormCpu` for input ``x`` and row scale ``r``, by the forward's own operations on the
    same row chunks (the same bits)."""
    width = x.shape[-1]
    x2 = x.reshape(-1, width)
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, dtype))
    step = max(1, CPU_CHUNK_ELEMENTS // width)
    for i in range(0, x2.shape[0], step):
        torch.mul(weight, (x2[i:i + step] * r[i:i + step]).to(dtype), out=y[i:i + step])
    return y.view(x.shape)


def _norm_recipe(x: torch.Tensor) -> tuple | None:
    """``(input, row scale, weight, dtype, version, key)`` when ``x`` is an RMSNorm's output that
    :func:`_norm_again` makes again (tagged by :func:`_rms_norm_forward`, not changed in place since); None
    otherwise. ``key`` names this norm call (for :func:`_low_norm_again`)."""
    if torch.compiler.is_compiling():  # first: nothing to trace (the norm tags nothing under the compiler)
        return None
    tag = getattr(x, "_surefit_norm", None)
    if tag is None or tag[4] != x._version:
        return None
    return tag


class _NormKey:
    """Names one norm call: the adapters reading its output hold it (in their ctx) until their backward is done."""

    __slots__ = ("__weakref__",)


# The 16-bit norm output last made again: (the norm call's key, weakly; its dtype; the tensor). q, k and v (gate and
# up) run their backward one after another and share it, as their forward shared the cast (_shared_cast).
_last_norm: list[Any] = [None]


def _forget_norm(ref: Any) -> None:
    last = _last_norm[0]
    if last is not None and last[0] is ref:
        _last_norm[0] = None


def _low_norm_again(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, norm: tuple, dtype: torch.dtype
                    ) -> torch.Tensor:
    """The 16-bit copy (``dtype``) of a norm's output that ``_LoraMixed`` did not keep, made again from what the norm
    saved; ``norm`` is ``(the norm's dtype, its call's key)``. Made once for the adapters sharing it; the copy lives
    until its norm call's last adapter is done (the key dies) or the next norm's copy replaces it."""
    norm_dtype, key = norm
    last = _last_norm[0]
    if last is not None and last[0]() is key and last[1] == dtype:
        return last[2]
    xh = _norm_again(x, r, weight, norm_dtype).to(dtype)
    ref = weakref.ref(key, _forget_norm)
    _last_norm[0] = (ref, dtype, xh)
    return xh


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


# peft's layer classes, looked up once (the forwards ask on every call). Kept in a global rather than by
# functools.cache: dynamo inlines a cached function, and its import then broke the graph where it had failed once.
_peft_classes: dict[str, Any] = {}


def _lora_linear_class() -> type | None:
    """peft's LoRA ``Linear``."""
    if "linear" not in _peft_classes:
        found: type | None = None
        try:
            from peft.tuners.lora import Linear as LoraLinear

            found = LoraLinear
        except ImportError:  # pragma: no cover - peft is a dependency
            pass
        _peft_classes["linear"] = found
    return _peft_classes["linear"]


def _quantized_lora_classes() -> tuple[type, ...]:
    """peft's LoRA layers on bitsandbytes 4-bit and 8-bit bases (present only where bitsandbytes imports)."""
    if "quantized" not in _peft_classes:
        try:
            from peft.tuners.lora import bnb
        except ImportError:  # pragma: no cover - peft is a dependency
            found: tuple[type, ...] = ()
        else:
            found = tuple(c for c in (getattr(bnb, "Linear4bit", None), getattr(bnb, "Linear8bitLt", None))
                          if c is not None)
        _peft_classes["quantized"] = found
    return _peft_classes["quantized"]


def is_lora_linear(m: Any) -> bool:
    return type(m) is _lora_linear_class()


_last_cast: list[Any] = [None]


def _shared_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, made once for the adapters that read the same input (q/k/v, gate/up) in a row.

    Weak references only: the copy lives as long as a backward pass (or a caller) holds it, and a new tensor at a
    freed address is never mistaken for the old one."""
    if torch.compiler.is_compiling() or x.is_inference():
        # Inference tensors have no version counter (and nothing is saved for a backward pass anyway). Under
        # torch.compile the identity test below would be traced wrongly (a cast of another tensor came back, with
        # the wrong shape), and the compiler merges equal casts itself. is_compiling() first: dynamo cannot trace
        # is_inference() and would break the graph at every adapter.
        return x.detach().to(dtype)
    last = _last_cast[0]
    if last is not None and last[0]() is x and last[1] == x._version and last[2] == dtype:
        cast = last[3]()
        if cast is not None:
            return cast
    cast = _packed_view(x, dtype)
    if cast is None:
        cast = x.detach().to(dtype)
    _last_cast[0] = (weakref.ref(x), x._version, dtype, weakref.ref(cast))
    return cast


# The fp32 activation SavedActivationsIn packed last: (its source, weakly; the source's version; the bf16 copy, weakly).
_last_packed: list[Any] = [None]


def _packed_view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``x`` in ``dtype`` as a view of the bf16 copy SavedActivationsIn just packed of the tensor ``x`` is a view of, or
    None. Why: fp32 attention's output is saved by the attention (packed into bf16) and then read by ``o_proj``
    through a transposed view; without this its 16-bit copy was made twice, one more tensor per layer kept for the
    backward pass. The copy has the source's strides (``Tensor.to`` preserves them), so the view is exact."""
    last, base = _last_packed[0], x._base
    if last is None or base is None or last[1] != x._version:
        return None
    src, low = last[0](), last[2]()
    if src is None or low is None or base is not src or low.dtype != dtype or low.stride() != src.stride():
        return None
    return low.as_strided(x.shape, x.stride(), x.storage_offset() - src.storage_offset())


def fast_adapter(layer: Any, args: tuple, kwargs: dict) -> str | None:
    """The active adapter's name when the fused forward computes what peft's would; None otherwise."""
    name = None if args or kwargs else plain_lora_adapter(layer, quantized_base=type(layer) in _quantized_lora_classes())
    if name is None:
        return None
    base, a, b, drop = layer.base_layer, layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if a.bias is not None or b.bias is not None or type(drop) not in (nn.Dropout, SeededDropout, nn.Identity):
        return None
    if isinstance(drop, nn.Dropout) and (not 0.0 <= drop.p < 1.0 or (drop.p > 0 and effective_p(drop.p) == 0)):
        return None  # p below 2^-17 would round to no dropout at all: peft's own dropout keeps it
    if any(m._forward_hooks or m._forward_pre_hooks for m in (base, a, b, drop)):
        return None
    return name


def fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = fast_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    mixed = _mixed_args(self, name, x, low=False)
    if mixed is not None:
        # Frozen weights stored in 16 bits (mixed precision with LoRA): all matmuls in 16 bits, as autocast would
        # run them, whether autocast is on or not; the adapter's contribution is added in fp32.
        return _LoraMixed.apply(*mixed)
    a, b, drop = self.lora_A[name].weight, self.lora_B[name].weight, self.lora_dropout[name]
    p = drop.p if self.training and isinstance(drop, nn.Dropout) else 0.0
    return _LoraBranch.apply(self.base_layer(x).to(a.dtype), x, a, b, p, float(self.scaling[name]), drop)


def _mixed_args(layer: Any, name: str, x: torch.Tensor, low: bool) -> tuple | None:
    """The arguments of :class:`_LoraMixed` for the fused ``layer(x)`` (adapter ``name``) where its frozen weights are
    16-bit and nothing of the base trains; None otherwise. ``low``: the output stays 16-bit (:func:`_gate_up`)."""
    base = layer.base_layer
    w = base.weight
    if w.dtype not in (torch.float16, torch.bfloat16) or w.requires_grad or not x.is_floating_point() \
            or (base.bias is not None and base.bias.requires_grad):
        return None
    a, b, drop = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.lora_dropout[name]
    p = drop.p if layer.training and isinstance(drop, nn.Dropout) else 0.0
    bias = None if base.bias is None else base.bias.to(a.dtype)
    return x, _shared_cast(x, w.dtype), w, bias, a, b, (p, float(layer.scaling[name]), drop, low)


# In training on a CPU with 16-bit frozen weights, gate_proj and up_proj hand the fused MLP (_SwiGLUDown) 16-bit
# outputs, each one matmul over [x | u] and [W | B] (the adapter summed in its fp32 accumulator, rounded once), instead
# of fp32 sums: their only reader, the MLP's product, is rounded to 16 bits for down_proj and the backward pass reads
# them in 16 bits anyway, while the fp32 sums cost tensors of the MLP's width, their casts and a 16-bit copy to save
# (docs/performance.md, "Precision and LoRA speed"). Not on a GPU, where it is not measured. False: fp32 sums.
GATE_UP_16 = True


def _gate_up(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_proj(x), up_proj(x))`` for :func:`_fused_mlp_forward`: in training on a CPU, in 16 bits
    (:data:`GATE_UP_16`) where both are fused LoRA layers on 16-bit frozen weights that the module call would run as
    :class:`_LoraMixed`, with no hooks that a direct call would skip; otherwise the module calls, as the MLP's own
    forward makes them (evaluation keeps the fp32 sums: its tokens stay ``generate``'s)."""
    if GATE_UP_16 and x.device.type == "cpu" and torch.is_grad_enabled() and x.is_floating_point():
        calls = [_low_call(m, x) for m in (mlp.gate_proj, mlp.up_proj)]
        if calls[0] is not None and calls[1] is not None:
            return _LoraMixed.apply(*calls[0]), _LoraMixed.apply(*calls[1])
    return mlp.gate_proj(x), mlp.up_proj(x)


def _low_call(layer: Any, x: torch.Tensor) -> tuple | None:
    """The arguments of the :class:`_LoraMixed` call ``layer(x)`` would make, asking for a 16-bit output; None
    where the module call does something else."""
    if not is_lora_linear(layer) or getattr(layer.forward, "__func__", None) is not fused_forward or _hooked(layer):
        return None
    name = fast_adapter(layer, (), {})
    return None if name is None else _mixed_args(layer, name, x, low=True)


def fuse_lora(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` of ``model`` the fused forward; returns how many layers have it. Gated MLPs
    over a LoRA ``down_proj`` and transformers' RMSNorm get theirs too (:func:`_rms_norm_forward`).

    QLoRA's layers (a bitsandbytes 4-bit or 8-bit base) get it too: the base is called as peft calls it, the adapter
    runs as :class:`_LoraBranch` (a bit mask saved, not the dropped input per adapter, which peft's forward keeps).

    The output is in the adapter's dtype (fp32), so the adapter's contribution is never rounded to 16 bits (a gated
    MLP's gate and up in training on a CPU: rounded once with the frozen product, :func:`_gate_up`); with
    frozen weights in fp32 (no mixed precision) every matmul is fp32 and the numbers are peft's.
    The modules holding such layers (attention, MLP) are marked: in training on a CPU their attention then takes the
    fused layers' fp32 outputs as they are (:data:`FP32_ATTENTION_ON_CPU`).
    Idempotent; saving, loading and merging stay peft's (only ``forward`` changes, per instance).
    """
    LoraLinear = _lora_linear_class()
    if LoraLinear is None:  # pragma: no cover - peft is a dependency
        return 0
    fused = (LoraLinear, *_quantized_lora_classes())
    n = 0
    for m in model.modules():
        if type(m) in fused:
            m.forward = types.MethodType(fused_forward, m)
            n += 1
        elif _is_swiglu_mlp(m):
            # Fused whole when down_proj is a LoRA layer on 16-bit frozen weights; in training, also on fp32 ones
            # (_SwiGLULora); otherwise only the SwiGLU product (_SwiGLU) and down_proj called as it is (checked at
            # each call).
            m._surefit_act = type(m.act_fn)  # type: ignore[assignment]  # a new attribute on the module
            m.forward = types.MethodType(_fused_mlp_forward, m)
        elif FUSED_RMS_NORM and _is_rms_norm(m):
            m.forward = types.MethodType(_rms_norm_forward, m)
    for m in model.modules():
        if any(type(c) in fused for c in m.children()):
            m._surefit_fp32_attention = True  # type: ignore[assignment]  # a new attribute, read by _fp32_attention
    _install_fp32_attention()
    return n


# On a CPU, training's attention takes q, k and v as the fused layers return them (fp32) rather than the bf16 copies
# autocast makes: torch's CPU flash kernel computes in fp32 blocks either way where there is no AMX, its backward ran
# faster on fp32 inputs on both CPUs measured, and the scores come from unrounded inputs (docs/performance.md,
# "Precision and LoRA speed"). Only where a backward pass follows (evaluation and generation keep bf16: a forward
# alone was not faster in fp32) and never on a GPU, whose bf16 kernels are the fast ones. False: autocast's bf16
# attention (benchmarks/step_parts.py --attention bf16,fp32).
FP32_ATTENTION_ON_CPU = True


def _fp32_attention(original: Any) -> Any:
    """transformers' ``sdpa`` attention function wrapped: for a module :func:`fuse_lora` marked, in training on a CPU
    under 16-bit autocast with fp32 queries, the call runs with autocast off on fp32 q/k/v (and mask); otherwise it
    is ``original`` exactly."""

    def sdpa_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if FP32_ATTENTION_ON_CPU and getattr(module, "_surefit_fp32_attention", False) \
                and query.device.type == "cpu" and query.dtype == torch.float32 and query.requires_grad \
                and torch.is_grad_enabled() and torch.is_autocast_enabled("cpu"):
            if attention_mask is not None and attention_mask.is_floating_point():
                attention_mask = attention_mask.float()  # an additive mask must match the queries' dtype
            with torch.autocast("cpu", enabled=False):
                return original(module, query, key.float(), value.float(), attention_mask, *args, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    sdpa_attention_forward._surefit_original = original  # type: ignore[attr-defined]  # marks it as installed
    return sdpa_attention_forward


def _install_fp32_attention() -> None:
    """Put :func:`_fp32_attention` in front of transformers' ``sdpa`` attention function, once per process. Models
    that :func:`fuse_lora` did not mark call through to the original unchanged."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    current = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if current is not None and getattr(current, "_surefit_original", None) is None:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _fp32_attention(current)


class Packed:
    __slots__ = ("tensor", "dtype")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype):
        self.tensor, self.dtype = tensor, dtype


class _Kept:
    """A saved tensor kept as it is, but without its autograd history.

    Why not return the tensor itself from the pack hook: an operation that saves its own output (tanh, SDPA, a norm's
    rsqrt) would then hold that output, which holds the operation: a reference cycle through C++ that Python's garbage
    collector cannot see. A backward pass breaks it; a forward that never gets one (an exception, an out-of-memory
    error caught to retry with a smaller micro-batch, a measuring forward) kept its whole graph alive, measured at
    220 MB for one 287-token example of SmolLM2-135M. ``detach()`` shares the storage and the version counter, so the
    in-place check autograd makes without hooks is made here too."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor.detach(), tensor._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            t = self.tensor
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.dtype} {list(t.shape)}] is at version {t._version}; expected version {self.version} instead. "
                f"Fix: compute a new tensor instead of changing this one in place (e.g. `x = x * 2`, not `x.mul_(2)`) "
                f"between the forward pass and backward().")
        return self.tensor


def keep_saved(t: torch.Tensor) -> torch.Tensor | _Kept:
    """What a pack hook should return for a tensor it leaves as it is (see :class:`_Kept`)."""
    return _Kept(t) if t.requires_grad and not t.is_inference() else t


class SavedActivationsIn:
    """Within this context, fp32 activations that autograd saves for the backward pass are stored in ``dtype``.

    Why: the fused LoRA forward keeps layer outputs in fp32 so that the adapters' contribution is not rounded away,
    and everything downstream (norms, the MLP's activation, the residual stream) then runs and is saved in fp32:
    on SmolLM2-135M (batch 4 x 287 tokens) 794 MB of the 1411 MB saved for the backward pass were fp32. Storing those
    in bf16 changes no forward value; the backward pass computes with the bf16-rounded activations, as it does with
    everything autocast saves. Measured in a bare training loop on that model (2-core CPU, 15 steps): peak RSS
    3.56 -> 3.32 GB, live peak 2.90 -> 2.52 GB, speed unchanged (276 vs 280 tokens/s).

    Only activations are packed: fp32, not leaves (so no parameter and nothing outside the autograd graph), not a
    view of a trainable leaf (a parameter's ``weight.t()``), at least ``MIN_NUMEL`` elements. A view of a tensor that
    an autograd Function made with grad off (its output buffer: the fused LoRA and norm forwards return such views)
    is an activation and is packed. A tensor saved by several operations (a norm's input, an input
    read by q, k and v) is packed once. bf16 only, under fp16 runs too (GPUs without bf16 arithmetic still convert
    to and from it): fp16's range (65504) is too narrow for a residual stream.
    """

    MIN_NUMEL = 4096
    # Bytes of packed activations between two hand-backs of the C heap's free pages (None: never); see RELEASE_EVERY.
    release_every: int | None = None

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        if dtype != torch.bfloat16:
            raise ValueError(f"saved activations can be stored in bfloat16 only, not {dtype}")
        self.dtype = dtype
        self._memo: dict[int, tuple[Any, int, Packed]] = {}
        self._hooks: Any = None
        self._since_release = 0

    def _count(self, nbytes: int) -> None:
        self._since_release += nbytes
        if self.release_every is not None and self._since_release >= self.release_every:
            self._since_release = 0
            release_free_memory()

    def pack(self, t: torch.Tensor) -> torch.Tensor | Packed | _Kept:
        if getattr(t, "_surefit_read_low", False) and t.dtype == torch.float32 and t.numel() >= self.MIN_NUMEL:
            low = Packed(t.to(self.dtype), self.dtype)  # given back in bf16 (see _read_low); a detached copy: a leaf
            if t.is_cpu:
                self._count(low.tensor.nbytes)
            return low
        if t.dtype != torch.float32 or t.is_leaf or t.numel() < self.MIN_NUMEL \
                or (t._base is not None and t._base.is_leaf and t._base.requires_grad):
            return keep_saved(t)
        hit = self._memo.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        packed = Packed(t.detach().to(self.dtype), t.dtype)
        self._memo[id(t)] = (weakref.ref(t), t._version, packed)
        _last_packed[0] = (weakref.ref(t), t._version, weakref.ref(packed.tensor))  # for _packed_view
        if t.is_cpu:
            self._count(packed.tensor.nbytes)
        return packed

    @staticmethod
    def unpack(p: torch.Tensor | Packed | _Kept) -> torch.Tensor:
        if isinstance(p, Packed):
            return p.tensor.to(p.dtype)
        return p.get() if isinstance(p, _Kept) else p

    def __enter__(self) -> SavedActivationsIn:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def forget(self) -> None:
        """Drop the references kept to recognise a tensor saved twice; the packed tensors then live as long as the
        graph that saved them."""
        self._memo.clear()

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.forget()
