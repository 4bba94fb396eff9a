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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from surefit.eval.generate_speedups import LastCast
from surefit.training.speedups.lora_fast import fast_adapter, fused_forward, is_lora_linear, plus_product


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


def _lean_base(x: torch.Tensor, *, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
               cast: LastCast) -> torch.Tensor:
    # _lean_mixed for an adapter whose B is all zeros (as peft initialises it: the evaluation before training). Its
    # term u @ B^T is exactly zero and adding it changes no value, so it is skipped: the same numbers for any finite
    # input, without the adapter's two matmuls and the addition over the layer's output.
    with torch.autocast(x.device.type, enabled=False):
        out = F.linear(cast(x, w.dtype), w).to(out_dtype)
        if bias is not None:
            out.add_(bias)
    return out


def _lean_full_base(x: torch.Tensor, *, base: Any, out_dtype: torch.dtype) -> torch.Tensor:
    # _lean_full for an adapter whose B is all zeros: its term adds exactly zero, so the base layer alone (as
    # _lean_base does for 16-bit frozen weights).
    return base(x).to(out_dtype)


def _lean_full(x: torch.Tensor, *, base: Any, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    # fused_forward's fp32 branch (base output + _LoraBranch with p = 0), without the autograd Function.
    y = base(x).to(a.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return plus_product(y, (x.to(a.dtype) @ a.t()).mul_(scaling), b)


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
                if not bool(b.any()):  # a new adapter: it adds nothing yet
                    lean = functools.partial(_lean_base, w=w.detach(), bias=bias, out_dtype=a.dtype, cast=cast)
                else:
                    lean = functools.partial(_lean_mixed, w=w.detach(), bias=bias, ah=a.to(w.dtype),
                                             bh=b.to(w.dtype), scaling=scaling, out_dtype=a.dtype, cast=cast)
            elif not bool(b.any()):
                lean = functools.partial(_lean_full_base, base=base, out_dtype=a.dtype)
            else:
                lean = functools.partial(_lean_full, base=base, a=a, b=b, scaling=scaling)
            changed.append((layer, forward))
            layer.forward = lean
        yield len(changed)
    finally:
        cast.source = cast.cast = None
        for layer, forward in reversed(changed):
            layer.forward = forward



# Sibling layers that a model calls in a row on the same input; each group becomes one GEMM (a layer outside a group,
# or a group called otherwise, still gets its own packed GEMM).
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))


class _Pack:
    """LoRA layers that read the same input, as one 16-bit GEMM: ``[x | s * x @ A^T] @ [W | B]^T``.

    The adapter's rank-r projection ``u`` is the one surefit's forward makes (16-bit, scaled); then the base and the
    adapter are summed in the GEMM's fp32 accumulator and the layer's output is rounded to 16 bits once, where the
    training forward rounds the base output and the adapter's output to 16 bits each and adds them in fp32. W and B
    are copied side by side once per generation (zeros where an adapter does not feed an output), never rounded into
    each other as merging does. A base layer's bias is added to the 16-bit output (a second rounding, where there is
    a bias). The siblings after the first reuse its GEMM only for the same input tensor, not written since."""

    def __init__(self, layers: list[Any], names: list[str]):
        ws = [layer.base_layer.weight.detach() for layer in layers]
        dt, device = ws[0].dtype, ws[0].device
        a_s = [layer.lora_A[n].weight.detach().to(dt) for layer, n in zip(layers, names, strict=True)]
        b_s = [layer.lora_B[n].weight.detach().to(dt) for layer, n in zip(layers, names, strict=True)]
        scales = [float(layer.scaling[n]) for layer, n in zip(layers, names, strict=True)]
        k = ws[0].shape[1]
        self.w = ws[0].new_zeros(sum(w.shape[0] for w in ws), k + sum(a.shape[0] for a in a_s))  # [out, K + R]
        row, col = 0, k
        for w, b in zip(ws, b_s, strict=True):
            self.w[row : row + w.shape[0], :k] = w
            self.w[row : row + w.shape[0], col : col + b.shape[1]] = b
            row, col = row + w.shape[0], col + b.shape[1]
        self.a = torch.cat(a_s).t().contiguous()  # [K, R]
        # one scaling for all (the usual case), else one per adapter column: the same products either way
        self.scale: float | torch.Tensor = scales[0] if len(set(scales)) == 1 else torch.tensor(
            [s for s, a in zip(scales, a_s, strict=True) for _ in range(a.shape[0])], dtype=dt, device=device)
        self.sizes = [w.shape[0] for w in ws]
        self.biases = [None if layer.base_layer.bias is None else layer.base_layer.bias.detach()
                       for layer in layers]
        self.out_dtype = torch.promote_types(dt, layers[0].lora_A[names[0]].weight.dtype)
        self.dtype = dt
        self.source: torch.Tensor | None = None
        self.key: tuple[Any, ...] | None = None
        self.outs: list[torch.Tensor] = []

    def gemm(self, xcat: torch.Tensor, mixed: bool) -> list[torch.Tensor]:
        """The layers' outputs from ``[x | u]`` (a 16-bit tensor of the packed weight's width); ``mixed``: whether
        the model runs under autocast (else the outputs are given in the adapter's dtype)."""
        y = F.linear(xcat, self.w)
        outs = list(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [y]
        if not mixed:
            # without autocast the model around runs in the adapter's dtype (the lean forward's output dtype)
            outs = [o.to(self.out_dtype) for o in outs]
        return [o if b is None else o + b.to(o.dtype) for o, b in zip(outs, self.biases, strict=True)]

    def project(self, xh: torch.Tensor) -> torch.Tensor:
        return (xh @ self.a).mul_(self.scale)

    def run(self, x: torch.Tensor, i: int, cast: LastCast) -> torch.Tensor:
        key = (x.data_ptr(), x.shape, x.stride(), None if x.is_inference() else x._version)
        if i == 0 or self.source is not x or self.key != key or x.is_inference():
            mixed = torch.is_autocast_enabled(x.device.type)
            with torch.autocast(x.device.type, enabled=False):
                xh = cast(x, self.dtype)
                self.outs = self.gemm(torch.cat([xh, self.project(xh)], dim=-1), mixed)
            self.source, self.key = x, key
        return self.outs[i]

    def forget(self) -> None:
        self.source, self.key, self.outs = None, None, []


def _packed_mlp(x: torch.Tensor, *, mlp: Any, down: _Pack) -> torch.Tensor:
    # down_proj(silu(gate) * up) with gate and up from one packed GEMM; the product is written straight into the
    # left part of down_proj's packed input, in 16 bits as the merged model computes it.
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if gate.dtype != down.dtype or up.dtype != down.dtype:
        gate, up = gate.to(down.dtype), up.to(down.dtype)
    mixed = torch.is_autocast_enabled(x.device.type)
    with torch.autocast(x.device.type, enabled=False):
        k = gate.shape[-1]
        xcat = gate.new_empty(*gate.shape[:-1], down.w.shape[1])
        h = torch.mul(F.silu(gate), up, out=xcat[..., :k])
        xcat[..., k:] = down.project(h)
        return down.gemm(xcat, mixed)[0]


def _packable(layer: Any) -> str | None:
    """The adapter of a LoRA layer on surefit's fused forward with frozen 16-bit weights; None otherwise."""
    forward = layer.__dict__.get("forward")
    if not is_lora_linear(layer) or getattr(forward, "__func__", None) is not fused_forward:
        return None
    name = fast_adapter(layer, (), {})
    base = layer.base_layer
    if name is None or base.weight.dtype not in (torch.float16, torch.bfloat16) or base.weight.requires_grad \
            or (base.bias is not None and base.bias.requires_grad) or type(base.weight.data) is not torch.Tensor:
        return None
    return name


@dataclass
class Packed:
    """What :func:`packed_lora` did: modules that run packed, and whether packing ran out of memory (and so none
    do: the lean forward runs instead)."""

    modules: int = 0
    out_of_memory: bool = False


def _hooks(m: Any) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


@contextlib.contextmanager
def packed_lora(model: Any) -> Iterator[Packed]:
    """Within this context (no gradients), LoRA layers on frozen 16-bit weights run as packed GEMMs (:class:`_Pack`):
    q, k and v as one, gate and up as one, each other adapted layer as one, and a SwiGLU MLP's product is formed in
    16 bits inside down_proj's packed input; the other LoRA layers (fp32 weights, say) take :func:`lean_lora`, as do
    all of them where packing runs out of memory. Yields a :class:`Packed` (how many modules run packed, and whether
    packing ran out of memory).

    Not bit for bit the training forward's numbers: every layer output is rounded to 16 bits once (the adapter is
    summed inside the GEMM, never rounded into the weight as ``--eval_merge_lora`` does), and so is the MLP's
    ``silu(gate)``. How far its answers are from an fp32 reference, against the lean forward's:
    ``benchmarks/results/generation.md``. Costs a copy of the adapted layers' weights while it lives. Restored on
    exit, also after an error; the adapter and base weights are only read.
    """
    changed: list[tuple[Any, Any]] = []
    packs: list[_Pack] = []
    cast = LastCast()

    def install(module: Any, forward: Any) -> None:
        changed.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def restore() -> None:
        for module, forward in reversed(changed):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        changed.clear()
        for p in packs:
            p.forget()
        packs.clear()

    out_of_memory = False
    try:
        for parent in list(model.modules()):
            kids = dict(parent.named_children())
            done: set[str] = set()
            for group in _SIBLINGS:
                names = [_packable(kids[k]) if k in kids else None for k in group]
                if all(names):
                    pack = _Pack([kids[k] for k in group], names)  # type: ignore[arg-type]
                    packs.append(pack)
                    for i, k in enumerate(group):
                        install(kids[k], functools.partial(pack.run, i=i, cast=cast))
                    done.update(group)
            down = kids.get("down_proj")
            if {"gate_proj", "up_proj"} <= done and down is not None and (name := _packable(down)) \
                    and type(getattr(parent, "act_fn", None)) is getattr(parent, "_surefit_act", None) \
                    and not _hooks(down) and not _hooks(parent.act_fn):
                # a SwiGLU MLP that fuse_lora recognised (it set _surefit_act): down_proj runs inside the MLP
                pack = _Pack([down], [name])
                packs.append(pack)
                install(parent, functools.partial(_packed_mlp, mlp=parent, down=pack))
                done.add("down_proj")
            for k, layer in kids.items():
                if k not in done and (name := _packable(layer)) is not None:
                    pack = _Pack([layer], [name])
                    packs.append(pack)
                    install(layer, functools.partial(pack.run, i=0, cast=cast))
    except torch.OutOfMemoryError:
        out_of_memory = True  # handled outside the except block, so the traceback holds no tensors
    try:
        if out_of_memory:
            restore()
        with lean_lora(model):  # the layers left unpacked (fp32 weights, other forwards) take the lean forward
            yield Packed(len(changed), out_of_memory)
    finally:
        cast.source = cast.cast = None
        restore()
