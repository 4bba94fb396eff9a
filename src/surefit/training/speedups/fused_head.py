"""The LM head and the cross-entropy fused, chunk by chunk: no full logits tensor in the forward or the backward pass.

Used by :func:`surefit.training.loss.causal_lm_loss_sum` (``--fused_cross_entropy``, on by default); the same loss and
gradients as the unfused head (tests/training/test_fused_head.py). See docs/performance.md.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from surefit.data.collate import IGNORE_INDEX
from surefit.eval.generate import HeadInput
from surefit.models import inner_model
from surefit.training.loss import HEAD_PATHS

# The fused head computes the logits of at most this many values (tokens x vocabulary) at a time: 2**23 values are
# 32 MiB in fp32, about 170 supervised tokens per chunk for SmolLM2's 49k vocabulary and 55 for a 152k one. Each chunk
# is a [chunk, hidden] x [hidden, vocab] matmul, still large enough to run at the CPU's matmul speed, while the
# transients of one chunk (logits in the compute dtype and in fp32, their softmax, its gradient) stay near 100 MiB.
FUSED_CHUNK_VALUES = 2**23
MIN_CHUNK_TOKENS = 8

_not_fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNUSED_GRADIENTS = threading.local()


@contextlib.contextmanager
def gradients_unused() -> Iterator[None]:
    """Within: the fused head's forward keeps its gradient tensors, allocated but not computed. For a forward that is
    measured and never backpropagated (the doctor's dry run on a CPU, ``training/plan.py: MeasuringDryRun``): what
    autograd saves is the same tensors, so the count is exact, without the softmax and the matmul of the gradient
    (on chat rows about a sixth of that forward). A backward pass through such a forward would read garbage."""
    was = getattr(_UNUSED_GRADIENTS, "on", False)
    _UNUSED_GRADIENTS.on = True
    try:
        yield
    finally:
        _UNUSED_GRADIENTS.on = was


def softcap_of(model: Any) -> float | None:
    cfg = getattr(inner_model(model), "config", None)
    cap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
    return float(cap) if cap else None


def why_not_fused(model: Any) -> str | None:
    """None when the LM head and the loss of ``model`` can run fused (:func:`fused_linear_cross_entropy`), else why.

    Fused needs a plain ``nn.Linear`` output layer (not a LoRA-wrapped or quantised one), a forward taking
    ``logits_to_keep``, and logits that are the head's output as is or soft-capped (``final_logit_softcapping``, which
    the fused head applies). Models that scale their logits after the head (Cohere's ``logit_scale``, Granite's
    ``logits_scaling``) keep the unfused head. A model whose output turns out to differ from the head's input in
    another way is found at its first batch and falls back from then on (the reason is kept here)."""
    if model in _not_fused:
        return _not_fused[model]
    from torch import nn

    inner = inner_model(model)
    cfg = getattr(inner, "config", None)
    if "logits_to_keep" not in inspect.signature(type(inner_model(model)).forward).parameters:
        return "its forward takes no logits_to_keep"
    for key, neutral in (("logit_scale", 1), ("logits_scaling", 1)):
        value = getattr(cfg, key, None)
        if value is not None and value != neutral:
            return f"its config scales the logits after the head ({key}={value})"
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return "it has no output layer"
    if type(head) is not nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain Linear"
    if not any(m is head for _, m in inner.named_children()):
        return "its output layer is not a direct child of the model"
    return None


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's, when it is on for this device, else the weight's."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``cross_entropy(softcap(hidden @ weight.T + bias), targets)``, chunk by chunk.

    The forward computes each chunk's logits, its loss and, when a gradient is wanted, the loss's gradients with
    respect to the chunk's hidden states and the head (``softmax - one_hot``, through the soft-cap), then drops the
    chunk. The backward only scales what the forward kept by the incoming gradient: ``grad_hidden`` ([n, hidden]) and,
    for a trainable head, ``grad_weight`` / ``grad_bias``. So neither pass ever holds more than one chunk of logits,
    and the head's matmul runs twice per chunk (logits, grad_hidden; three with a trainable head) instead of the
    three (four) of recomputing the logits in the backward pass. The loss is a sum, so a scalar incoming gradient
    scales every one of these exactly.

    Numerics follow the unfused path: the matmuls in ``compute_dtype`` (bf16 under autocast), logits then made fp32
    for the soft-cap and the softmax, their gradient cast back to ``compute_dtype`` for the matmuls.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, how: tuple[int, float | None, torch.dtype, int]) -> torch.Tensor:
        chunk, softcap, compute_dtype, ignore_index = how  # not tensors: one argument, one None in backward
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        n = hidden.shape[0]
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and need_b else None
        unused = getattr(_UNUSED_GRADIENTS, "on", False)
        for i in range(0, n, chunk):
            h = hidden[i : i + chunk].to(compute_dtype)
            t = targets[i : i + chunk]
            z = F.linear(h, w, b).float()  # [c, V]: the only chunk-sized tensors are this one and its gradient
            capped = None
            if softcap:
                capped = z.div_(softcap).tanh_()  # kept for the soft-cap's derivative, 1 - tanh^2
                z = capped * softcap
            valid = t != ignore_index
            safe = torch.where(valid, t, torch.zeros_like(t))
            lse = torch.logsumexp(z, dim=1)
            picked = z.gather(1, safe[:, None]).squeeze(1)
            loss += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if not (need_h or need_w or need_b) or unused:
                continue
            g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, safe] -= valid.to(g.dtype)
            if not bool(valid.all()):
                g.mul_(valid[:, None].to(g.dtype))
            if capped is not None:
                g.mul_(1 - capped * capped)
            g = g.to(compute_dtype)
            if grad_h is not None:
                grad_h[i : i + chunk] = (g @ w).to(hidden.dtype)
            if grad_w is not None and g.dtype == torch.float32:
                grad_w.addmm_(g.t(), h)  # in place: no [vocab, hidden] temporary per chunk
            elif grad_w is not None:
                grad_w += (g.t() @ h).float()
            if grad_b is not None:
                grad_b += g.float().sum(0)
        ctx.save_for_backward(*(x for x in (grad_h, grad_w, grad_b) if x is not None))
        ctx.kept = (need_h, need_w, need_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        need_h, need_w, need_b = ctx.kept
        gh = saved.pop(0) if need_h else None
        gh = gh * grad_out.to(gh.dtype) if gh is not None else None
        gw = (saved.pop(0) * grad_out).to(ctx.dtypes[0]) if need_w else None
        gb = (saved.pop(0) * grad_out).to(ctx.dtypes[1]) if need_b else None
        return gh, gw, gb, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               targets: torch.Tensor, *, chunk_values: int = FUSED_CHUNK_VALUES,
                               softcap: float | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``F.cross_entropy(softcap(F.linear(hidden, weight, bias)).float(), targets, reduction="sum")`` without the
    full logits tensor: rows run in chunks of ``max(chunk_values // vocab, MIN_CHUNK_TOKENS)`` (see
    :class:`_FusedLinearCrossEntropy`). Same loss and gradients; targets equal to ``ignore_index`` add nothing.

    Args:
        hidden: ``[n, hidden]`` states at the positions that carry loss.
        weight, bias: the output layer's (``[vocab, hidden]``, ``[vocab]`` or None); a frozen one gets no gradient.
        targets: ``[n]`` token ids.
        chunk_values: logits values per chunk.
        softcap: ``final_logit_softcapping``: logits become ``softcap * tanh(logits / softcap)``.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if not torch.is_grad_enabled():  # evaluation: no gradient is computed or kept, even for a trainable head
        hidden, weight = hidden.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    chunk = max(MIN_CHUNK_TOKENS, chunk_values // max(1, weight.shape[0]))
    how = (chunk, softcap, _compute_dtype(hidden, weight), ignore_index)
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets.reshape(-1), how)


def fused_loss(model: Any, kwargs: dict[str, Any], keep: torch.Tensor, targets: torch.Tensor,
                chunk_values: int) -> torch.Tensor | None:
    """The fused head's loss sum, or None when this model's output shows a transform the fused head does not apply
    (then it is remembered, and the caller computes this batch unfused)."""
    inner = inner_model(model)
    head = inner.get_output_embeddings()
    name = next(n for n, m in inner.named_children() if m is head)
    capture = HeadInput()
    setattr(inner, name, capture)
    try:
        out = model(**kwargs, logits_to_keep=keep).logits
    finally:
        setattr(inner, name, head)
    hidden = capture.seen
    assert hidden is not None  # the head ran inside model(...)
    softcap = softcap_of(model)
    if out is not hidden:
        expected = hidden if softcap is None else torch.tanh(hidden / softcap) * softcap
        if out.shape != expected.shape or not torch.allclose(out.float(), expected.float(), rtol=1e-5, atol=1e-6):
            _not_fused[model] = ("its output after the head differs from the head's output (a transform of the "
                                 "logits the fused head does not apply)")
            warnings.warn(f"fused LM head + cross-entropy off for this model: {_not_fused[model]}", stacklevel=3)
            return None
    HEAD_PATHS["fused"] += 1
    return fused_linear_cross_entropy(hidden, head.weight, head.bias, targets, chunk_values=chunk_values,
                                      softcap=softcap)
