"""Custom classification heads on a pretrained backbone, by composition.

A head factory is any callable ``Factory(hidden_size=H, num_labels=K, **head_args) -> nn.Module`` whose module's
``forward(hidden_states, attention_mask, pooled=None)`` returns logits ``[batch, num_labels]``. surefit wraps it with
the backbone in :class:`HeadModel`; nobody subclasses anything of ours.

Factories are named as ``package.module:Factory`` or ``path/to/file.py:Factory``. Loading one imports (runs) the
user's module, exactly as ``import`` would: it is done only because the user named it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surefit.errors import ConfigError, Problem


def load_factory(spec: str, flag: str = "--head") -> Any:
    """Resolve ``module:Name`` or ``file.py:Name`` to the object it names; problems name ``flag``."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"no such file: {path}")
            mod_name = f"surefit_user_head_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
            sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module; show its cause
        raise ConfigError(
            Problem(f"cannot import {target!r}: {type(e).__name__}: {e}", flag, "check the module path and that it imports")
        ) from e
    factory = getattr(module, name, None)
    if factory is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ConfigError(
            Problem(f"{target!r} has no attribute {name!r}", flag, f"callables it defines: {', '.join(public) or 'none'}")
        )
    return factory


class HeadModel(nn.Module):
    """Backbone (any transformers encoder/decoder returning hidden states) + a user head.

    ``forward`` takes the tokenizer's outputs and returns an object with ``.logits``, like a transformers
    sequence-classification model, so the loop, evaluation and the doctor treat both the same.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module, problem_type: str = "single"):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.problem_type = problem_type
        self._accepts = set(inspect.signature(backbone.forward).parameters)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> Any:
        """Logits, and with ``labels`` the mean loss over the batch (as a transformers classifier returns it)."""
        from transformers.modeling_outputs import SequenceClassifierOutput

        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and "token_type_ids" in self._accepts:
            kwargs["token_type_ids"] = token_type_ids
        out = self.backbone(**kwargs)
        pooled = getattr(out, "pooler_output", None)
        logits = self.head(out.last_hidden_state, attention_mask, pooled)
        loss = None
        if labels is not None:
            from surefit.tasks.classify import loss_from_logits

            loss = loss_from_logits(logits, labels, self.problem_type) / labels.shape[0]
        return SequenceClassifierOutput(loss=loss, logits=logits)


def build_head(spec: str, head_args: dict[str, Any], hidden_size: int, num_labels: int) -> nn.Module:
    factory = load_factory(spec)
    try:
        head = factory(hidden_size=hidden_size, num_labels=num_labels, **head_args)
    except TypeError as e:
        raise ConfigError(
            Problem(
                f"{spec} could not be called as Factory(hidden_size={hidden_size}, num_labels={num_labels}, "
                f"**{head_args}): {e}",
                "--head",
                "a head factory takes hidden_size and num_labels keywords, plus what --head_args gives",
            )
        ) from e
    if not isinstance(head, nn.Module):
        raise ConfigError(Problem(f"{spec} returned {type(head).__name__}, not a torch.nn.Module", "--head"))
    return head
