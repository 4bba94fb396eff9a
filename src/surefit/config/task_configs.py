"""The configs of the classify and custom tasks, and the table from a task's name to its config (``--task``).

They add to :class:`~surefit.config.TrainConfig` what their task needs; ``config/__init__.py`` holds the shared settings and
``SFTConfig``, which is all the SFT path reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from surefit.config import SFTConfig, TrainConfig, opt
from surefit.config.dpo_config import DPOConfig
from surefit.config.yaml_files import load_json
from surefit.errors import Problem


@dataclass
class ClassifyConfig(TrainConfig):
    """Sequence classification with a pretrained encoder (or any sequence-classification model) and optional head."""

    task: Literal["classify"] = opt("classify", "Training path. 'classify': sequence classification.")
    model: str | None = opt(
        None, "A local Hugging Face folder or a hub id. Default: the embedded all-MiniLM-L6-v2 encoder."
    )
    text_field: str | None = opt(None, "Column holding the text. Default: detected (sentence, text, sentence1, ...).")
    text_pair_field: str | None = opt(None, "Column holding the second text of a pair (e.g. sentence2). Default: detected.")
    label_field: str | None = opt(None, "Column holding the label. Default: detected (label, labels, class, ...).")
    problem_type: Literal["auto", "single", "multi", "regression"] = opt(
        "auto", "single-label, multi-label (list labels) or regression (float labels); 'auto' infers it and says how."
    )
    head: str | None = opt(
        None, "Custom head 'package.module:Factory' or 'path/to/file.py:Factory', built on the backbone's hidden states."
    )
    head_args: str | None = opt(None, "JSON object of keyword arguments for the head factory, e.g. '{\"filters\": 64}'.")
    lora_r: int = opt(0, "LoRA rank; 0 (the default here) means full fine-tuning.")
    max_seq_length: int = opt(128, "Longest text (or text pair) in tokens; longer texts are truncated and counted.")
    batch_size: int = opt(16, "Examples per optimizer step (the effective batch).")
    lr: float = opt(5e-5, "Peak learning rate (AdamW).")
    weight_decay: float = opt(0.01, "AdamW weight decay.")
    warmup_ratio: float = opt(0.06, "Fraction of optimizer steps spent warming up (then cosine decay).")
    quantize_refused: ClassVar[str | None] = (
        "QLoRA is implemented for causal LMs (--task sft) only; a classifier's base trains in 16 or 32 bits")
    output_dir: str = opt("runs/classify", "Where the config, metrics, predictions, checkpoints and final model go.")

    def problems(self) -> list[Problem]:
        p = super().problems()
        if self.head is not None and ":" not in self.head:
            p.append(
                Problem(
                    f"expected 'package.module:Factory' or 'file.py:Factory' (got {self.head!r})",
                    "--head",
                    "e.g. --head examples/classify/cnn_head.py:CNNHead",
                )
            )
        if self.head_args is not None:
            try:
                args = load_json(self.head_args)
                if not isinstance(args, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                p.append(Problem(f"not a JSON object ({e}): {_short(self.head_args)}", "--head_args", "e.g. '{\"filters\": 64}'"))
        if self.head_args is not None and self.head is None:
            p.append(Problem("--head_args given without --head", "--head_args", "pass --head too, or drop --head_args"))
        return p


@dataclass
class CustomConfig(TrainConfig):
    """Any ``nn.Module`` built by a factory, trained on named tensors."""

    task: Literal["custom"] = opt("custom", "Training path. 'custom': any nn.Module on tensor data.")
    model: str | None = opt(
        None, "Model factory 'package.module:build' or 'path/to/file.py:build' returning an nn.Module (required)."
    )
    model_args: str | None = opt(None, "JSON object of keyword arguments for the model factory, e.g. '{\"vocab\": 271}'.")
    data: str | None = opt(
        None, "A folder of shards (.npy, .npz, .safetensors, .pt) of named arrays, or a factory 'module:make'."
    )
    val_data: str | None = opt(None, "Validation shards (same forms). Default: split --val_fraction off --data.")
    loss: Literal["auto", "cross_entropy", "mse", "bce"] = opt(
        "auto", "'auto': the model returns its loss; otherwise it returns logits and this loss is applied to 'labels'."
    )
    labels_key: str = opt("labels", "The batch key holding the targets (for --loss and the label checks).")
    max_memory_gb: float | None = opt(
        None, "RAM the data may take, in GiB: shards are streamed so that only the batch (and small shard caches) are held."
    )
    lora_r: int = opt(0, "LoRA is not available for custom models: full training (0).")
    batch_size: int = opt(32, "Examples per optimizer step (the effective batch).")
    lr: float = opt(1e-3, "Peak learning rate (AdamW).")
    weight_decay: float = opt(0.01, "AdamW weight decay.")
    quantize_refused: ClassVar[str | None] = (
        "surefit cannot tell which layers of your module hold frozen weights (quantise inside your factory if you "
        "need it)")
    output_dir: str = opt("runs/custom", "Where the config, metrics, checkpoints and final model go.")

    def problems(self) -> list[Problem]:
        p = super().problems()
        if self.model is None:
            p.append(Problem("no model factory given", "--model", "pass --model package.module:build or file.py:build"))
        elif ":" not in self.model:
            p.append(Problem(f"expected 'package.module:build' or 'file.py:build' (got {self.model!r})", "--model",
                             "e.g. --model examples/custom/projection_model.py:build"))
        if self.model_args is not None:
            try:
                if not isinstance(load_json(self.model_args), dict):
                    raise ValueError("not an object")
            except ValueError as e:
                p.append(Problem(f"not a JSON object ({e}): {_short(self.model_args)}", "--model_args", "e.g. '{\"vocab\": 271}'"))
        if self.lora_r:
            p.append(Problem(f"LoRA is not available for --task custom (got --lora_r {self.lora_r})", "--lora_r",
                             "drop --lora_r (custom models train in full)"))
        if self.max_memory_gb is not None and math.isfinite(self.max_memory_gb) and not self.max_memory_gb > 0:
            p.append(Problem(f"must be > 0 (got {self.max_memory_gb})", "--max_memory_gb"))
        return p


def _short(text: str) -> str:
    # A value of megabytes (a generated JSON) is named by its start and size, not printed whole.
    return repr(text) if len(text) <= 200 else f"{text[:60]!r}... ({len(text):,} characters)"


TASK_CONFIGS: dict[str, type[TrainConfig]] = {"sft": SFTConfig, "classify": ClassifyConfig, "custom": CustomConfig, "dpo": DPOConfig}
