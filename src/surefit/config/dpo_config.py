"""The config of the dpo task (preference tuning on chosen / rejected pairs): SFT's settings plus the loss's.

Defaults are TRL's (``DPOConfig``: beta 0.1, sigmoid loss, dropout off; ``CPOConfig``: simpo_gamma 0.5;
``ORPOConfig``: beta, here ``orpo_lambda``, 0.1), so a run compares with theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from surefit.config import SFTConfig, opt
from surefit.errors import Problem

PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class DPOConfig(SFTConfig):
    """Preference tuning of a causal LM on chosen / rejected pairs (DPO, IPO, hinge, SimPO, ORPO)."""

    # Another task's name on SFT's settings: a narrower Literal than the base class's, on purpose.
    task: Literal["dpo"] = opt("dpo", "Training path. 'dpo': preference tuning on chosen / rejected pairs.")  # type: ignore[assignment]
    data: str | None = opt(None, "Preference pairs: prompt/chosen/rejected, chosen/rejected conversations, ShareGPT or "
                           "Alpaca with chosen/rejected, or Anthropic HH text (detected; see docs/preference.md).")
    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = opt(
        "sigmoid", "Preference loss: sigmoid (DPO), ipo, hinge, simpo (reference-free), orpo (reference-free).")
    beta: float = opt(0.1, "The loss's beta: DPO's KL strength (sigmoid, ipo, hinge), SimPO's reward scale.")
    gamma: float = opt(0.5, "SimPO's target reward margin (--loss simpo; TRL's simpo_gamma).")
    orpo_lambda: float = opt(0.1, "Weight of ORPO's odds-ratio term next to the chosen answer's NLL (--loss orpo).")
    precompute_ref: bool = opt(
        False, "Compute the reference log-probabilities once before step 1 and store them in the run folder (always "
        "so with full fine-tuning). LoRA default: the reference is the model with its adapters off, computed per step.")
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch (0: as TRL's disable_dropout, so that the policy and "
                              "reference log-probabilities of a pair are comparable).")
    lr: float = opt(5e-5, "Peak learning rate (AdamW).")
    epochs: int = opt(1, "Passes over the training pairs.")
    eval_generate: bool = opt(False, "Not used by dpo runs (the held-out pairs are scored by their log-probabilities).")
    output_dir: str = opt("runs/dpo", "Where the config, metrics, checkpoints and final model go.")

    def problems(self) -> list[Problem]:
        p = super().problems()  # every float setting finite, beta and gamma included (one walk over the fields)
        if math.isfinite(self.beta) and self.beta <= 0:
            p.append(Problem(f"must be > 0 (got {self.beta})", "--beta", "e.g. --beta 0.1 (TRL's default)"))
        if self.template:
            p.append(Problem("--template writes the prompt of SFT's input/target rows; a pair's prompt is used as "
                             "written (text) or rendered by the chat template (messages)", "--template",
                             "drop --template"))
        # SFT settings that a preference run does not read: refused rather than silently ignored.
        unused = {"eval_generate": False, "metric": "auto", "max_new_tokens": None, "input_field": "input",
                  "target_field": "target", "train_on": "all_assistant", "role_map": None, "augmentation_factor": 1}
        for name, default in unused.items():
            if getattr(self, name) != default:
                p.append(Problem(f"--{name} {getattr(self, name)} does nothing in a dpo run (pairs are scored by their "
                                 "log-probabilities; the shapes are detected; every answer turn is trained)",
                                 f"--{name}", f"drop --{name}"))
        if self.format != "auto":
            p.append(Problem(f"--format {self.format} names an SFT row shape; pair shapes are detected",
                             "--format", "drop --format (see docs/preference.md for the pair shapes)"))
        return p

    @property
    def reference_free(self) -> bool:
        return self.loss in REFERENCE_FREE
