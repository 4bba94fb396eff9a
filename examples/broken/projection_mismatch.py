"""Seed 003 rebuilt: a model whose ``projection = nn.Linear(271, 256)`` is fed ``inputs_embeds [B, 20, 4000]``.

The model was built for a 271-word vocabulary and the data was made with a 4,000-word one. PyTorch's error,
``mat1 and mat2 shapes cannot be multiplied (80x4000 and 271x256)``, names neither the input nor the layer.

Run: ``python examples/broken/projection_mismatch.py`` (a small nn.Module; nothing downloaded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from surefit.doctor import check, explain


class ProjectionClassifier(nn.Module):
    """Per-position features [B, 20, vocab] -> nn.Linear(vocab, 256) -> GRU -> mean -> classes (the seed's model)."""

    def __init__(self, vocab: int = 271, hidden: int = 256, classes: int = 3):
        super().__init__()
        self.projection = nn.Linear(vocab, hidden)
        self.encoder = nn.GRU(hidden, 32, batch_first=True)
        self.head = nn.Linear(32, classes)

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out, _ = self.encoder(self.projection(inputs_embeds))
        logits = self.head(out.mean(dim=1))
        return {"logits": logits, **({"loss": F.cross_entropy(logits, labels)} if labels is not None else {})}


def main() -> None:
    torch.manual_seed(0)
    model = ProjectionClassifier(vocab=271)
    # the data: 20 positions x 4000 features (a 4,000-word vocabulary), built elsewhere
    rows = [{"inputs_embeds": torch.rand(20, 4000), "labels": torch.tensor(i % 3)} for i in range(8)]
    args = {"batch_size": 4}

    print("1. one training step, raw:")
    error: Exception | None = None
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = next(iter(DataLoader(rows, batch_size=4)))
        model(**batch)["loss"].backward()
        optimizer.step()
        print("   (no error)")
    except Exception as exc:  # noqa: BLE001 - shown, then explained
        error = exc
        print(f"   {type(exc).__name__}: {exc}")

    print("\n2. surefit.doctor.check(...):")
    print(check(model, train_dataset=rows, args=args, task="custom"))

    if error is not None:
        finding = explain(error, model, train_dataset=rows, args=args, task="custom")
        print(f"\n3. explain(error, ...): [{finding.code}] {finding.message}")
        if finding.fix:
            print(f"   fix: {finding.fix}")


if __name__ == "__main__":
    main()
