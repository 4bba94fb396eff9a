"""Which layer consumes each input, what it expects, and why a shape error happened, from one real forward pass.

``RuntimeError: mat1 and mat2 shapes cannot be multiplied (255744x4000 and 271x256)`` names neither the input nor the
layer. Here a forward pass runs with hooks on every module: a pre-hook notes each module as it is entered and which
batch tensors (or views of them) it receives; when the pass fails, the innermost module still running is the one
that failed, and its own parameters say what it expected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Use:
    """A batch input's first consumer.

    Attributes:
        input: the batch key; module: its qualified name in the model; layer: e.g. ``nn.Linear(271 -> 256)``.
        shape: the shape that arrived; expects: what the layer needs (human text) or ``""`` if unknown;
        agrees: ``True``/``False``, or ``None`` when the layer type has no known rule.
    """

    input: str
    module: str
    layer: str
    shape: tuple[int, ...]
    dtype: str
    expects: str
    agrees: bool | None


@dataclass
class Trace:
    uses: dict[str, Use] = field(default_factory=dict)
    error: BaseException | None = None
    failed_module: str | None = None
    failed_layer: nn.Module | None = None
    failed_inputs: list[tuple[int, ...]] = field(default_factory=list)
    failed_dtypes: list[str] = field(default_factory=list)
    failed_sources: list[str] = field(default_factory=list)  # batch keys the failing module received (if any)


def describe_layer(m: nn.Module) -> str:
    if isinstance(m, nn.Linear):
        return f"nn.Linear({m.in_features} -> {m.out_features})"
    if isinstance(m, nn.modules.conv._ConvNd):
        return f"nn.{type(m).__name__}({m.in_channels} -> {m.out_channels}, kernel {tuple(m.kernel_size)})"
    if isinstance(m, nn.Embedding):
        return f"nn.Embedding({m.num_embeddings} rows, dim {m.embedding_dim})"
    if isinstance(m, nn.LayerNorm):
        return f"nn.LayerNorm({tuple(m.normalized_shape)})"
    if isinstance(m, nn.RNNBase):
        return f"nn.{type(m).__name__}(input_size {m.input_size}, hidden {m.hidden_size})"
    if isinstance(m, nn.MultiheadAttention):
        return f"nn.MultiheadAttention(embed_dim {m.embed_dim})"
    return type(m).__name__


def expectation(m: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[str, bool | None]:
    """What the layer needs of its first input, and whether ``shape``/``dtype`` meet it."""
    if isinstance(m, nn.Linear):
        ok = len(shape) >= 1 and shape[-1] == m.in_features and dtype.is_floating_point
        return f"a last dimension of {m.in_features} (floating point)", ok
    if isinstance(m, nn.modules.conv._ConvNd):
        ok = len(shape) >= 2 and shape[1] == m.in_channels and dtype.is_floating_point
        return f"{m.in_channels} channels at dimension 1 ([batch, channels, ...])", ok
    if isinstance(m, nn.Embedding):
        return f"integer ids below {m.num_embeddings}", not dtype.is_floating_point
    if isinstance(m, nn.LayerNorm):
        n = len(m.normalized_shape)
        return f"trailing dimensions {tuple(m.normalized_shape)}", tuple(shape[-n:]) == tuple(m.normalized_shape)
    if isinstance(m, nn.RNNBase):
        return f"a last dimension of {m.input_size}", len(shape) >= 1 and shape[-1] == m.input_size
    if isinstance(m, nn.MultiheadAttention):
        return f"a last dimension of {m.embed_dim}", len(shape) >= 1 and shape[-1] == m.embed_dim
    return "", None


def trace(model: nn.Module, batch: dict[str, torch.Tensor], call: Callable[[], Any]) -> Trace:
    """Run ``call()`` (a forward pass of ``model`` on ``batch``) with hooks, and record what consumed what."""
    result = Trace()
    storages = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            storages[value.untyped_storage().data_ptr()] = key
    stack: list[tuple[str, nn.Module, list[torch.Tensor]]] = []
    handles = []

    def pre(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict | None = None):
            tensors = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            stack.append((name, module, tensors))
            for t in tensors:
                key = storages.get(t.untyped_storage().data_ptr())
                # Record only leaf-most consumers: a container passing the tensor on is not the consumer.
                if key is not None and not list(module.children()):
                    if key not in result.uses:
                        expects, ok = expectation(module, tuple(t.shape), t.dtype)
                        result.uses[key] = Use(key, name, describe_layer(module), tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                               expects, ok)
        return hook

    def post(module: nn.Module, args: tuple, output: Any):
        if stack and stack[-1][1] is module:
            stack.pop()

    for name, module in model.named_modules():
        if module is model:
            continue
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward is what we diagnose
        result.error = e
        if stack:
            name, module, tensors = stack[-1]
            result.failed_module, result.failed_layer = name, module
            result.failed_inputs = [tuple(t.shape) for t in tensors]
            result.failed_dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
            result.failed_sources = [storages[t.untyped_storage().data_ptr()] for t in tensors
                                     if t.untyped_storage().data_ptr() in storages]
    finally:
        for h in handles:
            h.remove()
    return result


def likely_causes(expected: int, shape: tuple[int, ...], per_example: dict[str, tuple[int, ...]],
                  model_args: dict[str, Any] | None = None) -> list[str]:
    """Why a layer built for ``expected`` features got ``shape``: flattening, transposed axes, or a wrong size."""
    got = shape[-1] if shape else None
    causes = []
    if got is not None and got != expected and got % expected == 0 and len(shape) == 2:
        causes.append(f"flattening: {got} = {got // expected} x {expected}, so [B, {got}] looks like "
                      f"[B, {got // expected}, {expected}] flattened; keep the features 3-D (or x.view(B, -1, {expected}))")
    if expected in shape[1:-1]:
        axis = shape.index(expected, 1)
        causes.append(f"transposed axes: {expected} is dimension {axis} of {list(shape)}; the features must be last "
                      f"(e.g. x.transpose({axis}, {len(shape) - 1}))")
    for key, dims in per_example.items():
        if dims and dims[-1] == got and got is not None and got != expected and not causes:
            arg = next((k for k, v in (model_args or {}).items() if v == expected), None)
            hint = f"--model_args '{{\"{arg}\": {got}}}'" if arg else f"a layer built for {got} features"
            causes.append(f"wrong feature (vocabulary) size: '{key}' has {got} features per position but the layer "
                          f"was built for {expected}; if the data is right, build the model with {hint}; if the model "
                          f"is right, rebuild the data with {expected} features")
            break
    if not causes and got is not None:
        causes.append(f"the input's last dimension is {got}, not {expected}: check how this tensor is built")
    return causes


def diagnose(tr: Trace, batch: dict[str, torch.Tensor], model_args: dict[str, Any] | None = None) -> str | None:
    """One message for a failed forward: which input, which layer, what it expects, what arrived, and why."""
    if tr.error is None:
        return None
    module, layer = tr.failed_module, tr.failed_layer
    if layer is None:
        return f"the forward pass failed outside any submodule: {type(tr.error).__name__}: {tr.error}"
    shape = tr.failed_inputs[0] if tr.failed_inputs else ()
    dtype = tr.failed_dtypes[0] if tr.failed_dtypes else "?"
    source = tr.failed_sources[0] if tr.failed_sources else None
    what = f"'{source}' arrives" if source else "its input arrives"
    per_example = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    shown = "[B, " + ", ".join(map(str, shape[1:])) + "]" if len(shape) > 1 else str(list(shape))
    expects, _ = expectation(layer, shape, getattr(torch, dtype, torch.float32))
    lines = [f"shape mismatch at layer '{module}' ({describe_layer(layer)}): {what} as {shown} ({dtype}), "
             f"but the layer expects {expects or 'something else'}."]
    if isinstance(layer, nn.Linear) and shape and shape[-1] == layer.in_features and not getattr(
            torch, dtype, torch.float32).is_floating_point:
        lines.append(f"likely cause: integer features ({dtype}) reach a floating-point layer; store the features "
                     "as float32 (or convert them in the dataset), not in the model")
    elif isinstance(layer, (nn.Linear, nn.RNNBase, nn.MultiheadAttention)):
        expected = (layer.in_features if isinstance(layer, nn.Linear) else layer.input_size
                    if isinstance(layer, nn.RNNBase) else layer.embed_dim)
        for cause in likely_causes(expected, shape, per_example, model_args):
            lines.append(f"likely cause: {cause}")
    lines.append(f"(the raw error was: {type(tr.error).__name__}: {str(tr.error).splitlines()[0]})")
    return "\n".join(lines)


def first_layers(tr: Trace, keys: list[str], passed: list[str]) -> list[str]:
    """One line per input: its shape and dtype, the layer that first consumes it and whether the shapes agree
    (``surefit inspect --model`` and the custom task's check before step 1 print these)."""
    lines = []
    for key in keys:
        use = tr.uses.get(key)
        if use is None:
            status = "passed but not consumed by a layer before the pass ended" if key in passed else "not passed"
            lines.append(f"  {key}: {status}")
        else:
            verdict = "" if use.agrees is None else " - shapes agree" if use.agrees else f" - MISMATCH: expects {use.expects}"
            lines.append(f"  {key} {list(use.shape)} {use.dtype} -> first consumed by {use.module} ({use.layer}){verdict}")
    return lines
