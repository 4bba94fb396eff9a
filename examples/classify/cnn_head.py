"""The seeds' shape of model: a pretrained backbone + a small CNN over its token states + pooled features.

Used as ``surefit train --task classify --head examples/classify/cnn_head.py:CNNHead``. A head factory takes
``hidden_size`` and ``num_labels`` (plus anything in ``--head_args``) and returns a module whose
``forward(hidden_states, attention_mask, pooled=None)`` returns logits.
"""

from __future__ import annotations

import torch
from torch import nn


class CNNHead(nn.Module):
    """Convolutions of several widths over the token states, max-pooled over real tokens, concatenated with the
    mean-pooled sentence vector, then a linear layer.

    Args:
        hidden_size: the backbone's hidden size; num_labels: outputs.
        filters: channels per convolution; kernels: convolution widths; dropout: before the output layer.
    """

    def __init__(self, hidden_size: int, num_labels: int, filters: int = 64, kernels: tuple[int, ...] = (3, 4),
                 dropout: float = 0.1):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(hidden_size, filters, k, padding=k // 2) for k in kernels)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(filters * len(kernels) + hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                pooled: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        if attention_mask is None:
            attention_mask = hidden_states.new_ones(batch, length)
        mask = attention_mask.bool()
        x = hidden_states.transpose(1, 2)  # Conv1d wants [batch, channels, time]
        features = []
        for conv in self.convs:
            h = torch.relu(conv(x))[..., :length]  # even kernels pad one extra step: trim back to the input length
            # Padding must never win the max: mask it before pooling over time.
            h = h.masked_fill(~mask[:, None, :], torch.finfo(h.dtype).min)
            features.append(h.max(dim=-1).values)
        # Mean over real tokens: all-MiniLM-L6-v2 was trained with mean pooling; its BERT pooler is untrained.
        weights = mask.unsqueeze(-1).to(hidden_states.dtype)
        sentence = (hidden_states * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.out(self.dropout(torch.cat(features + [sentence], dim=-1)))
