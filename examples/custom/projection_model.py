"""The seeds' projection model: per-position features [batch, 20, vocab] -> nn.Linear(vocab, 256) -> pooled -> classes.

Used as ``--model examples/custom/projection_model.py:build --model_args '{"vocab": 271}'``. The forward takes the
batch's arrays by name and returns a dict with ``loss`` (when labels are given) and ``logits``: surefit's protocol.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ProjectionClassifier(nn.Module):
    def __init__(self, vocab: int = 271, hidden: int = 256, classes: int = 4):
        super().__init__()
        self.projection = nn.Linear(vocab, hidden)  # the layer the seed's data did not fit
        self.mix = nn.Sequential(nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.mix(self.projection(inputs_embeds))  # [B, 20, hidden]
        logits = self.classifier(h.mean(dim=1))  # mean over positions keeps "how often" signals
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def build(vocab: int = 271, hidden: int = 256, classes: int = 4) -> nn.Module:
    return ProjectionClassifier(vocab, hidden, classes)
