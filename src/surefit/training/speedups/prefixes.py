"""Prompt prefixes shared by rows of a micro-batch, computed once.

Why: in a causal LM a token's hidden states depend only on the tokens before it, so rows that begin with the same
tokens (several questions on one SQuAD paragraph, one few-shot preamble, one long system prompt) compute the same
prefix states again for every row. On the benchmark's 64 SQuAD rows, 40% of the tokens of surefit's length-grouped
batches repeat a prefix already in the same batch (``benchmarks/cpu_sft.py``).

How: each group of rows with a common prefix becomes one row, ``[prefix | rest of row 1 | rest of row 2 | ...]``;
every rest carries its original position ids and attends to the prefix and causally to itself, through a 4D mask
the model uses as given. Each rest starts before the row's first supervised token, so every position whose output
carries loss sits in its own rest and sees exactly the tokens it saw in its own row: the loss and its gradients are
the same (in fp32 to rounding; tested per model family against the unshared batch). Rows without a partner stay
whole. The batch is laid out this way only when it has at most ``max_share`` of the plain batch's padded tokens;
otherwise the plain batch (no mask, the causal kernel) is cheaper.

One difference, with LoRA dropout: the prefix is computed once, so the rows of a group share its dropout masks there
(each row still sees a correctly distributed mask; the masks are no longer independent across those rows).
``--share_prefixes false`` gives every row its own.

Only the model families whose masks and positions are verified by the tests are laid out this way (others train as
before, and the run says why): a custom mask replaces transformers' own, so a family that derives anything else from
the 2D mask (ALiBi slopes, mixed sliding/full layers) would silently compute something else.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from surefit.data.collate import IGNORE_INDEX
from surefit.training.dropout import relayout, share_prefix_keys
from surefit.training.loss import attends_causally, base_forward_params, inner_model

# Model types whose attention takes a custom 4D mask and whose positions come from position_ids alone, each tested
# (tests/training/test_prefixes.py): shared-prefix loss and gradients equal the unshared batch's.
SHAREABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"})
_ATTENTION = {"sdpa", "eager"}

_reasons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _window(model_config: Any) -> tuple[str | None, int | None]:
    """``(why not, sliding window)``: a window every layer applies is kept in the mask; mixed layers are refused."""
    types = set(getattr(model_config, "layer_types", None) or [])
    window = getattr(model_config, "sliding_window", None)
    if getattr(model_config, "use_sliding_window", True) is False:
        window = None
    if types - {"full_attention", "sliding_attention"}:
        return f"it has {', '.join(sorted(types - {'full_attention', 'sliding_attention'}))} layers", None
    if types == {"full_attention", "sliding_attention"}:
        return "it mixes sliding-window and full-attention layers (one mask cannot serve both)", None
    if types == {"full_attention"}:
        return None, None
    return None, int(window) if window else None


def why_not_shared(model: Any) -> str | None:
    """None when rows' shared prefixes can be computed once for this model, else the reason (read once per model)."""
    try:
        return _reasons[model]
    except (KeyError, TypeError):
        pass
    inner = inner_model(model)
    cfg = getattr(inner, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    kind = getattr(cfg, "model_type", None)
    params = base_forward_params(model)
    reason: str | None
    if kind not in SHAREABLE_MODEL_TYPES:
        reason = (f"model type {kind!r} is not one of those verified for it "
                  f"({', '.join(sorted(SHAREABLE_MODEL_TYPES))})")
    elif getattr(cfg, "_attn_implementation", None) not in _ATTENTION:
        reason = f"attention implementation {getattr(cfg, '_attn_implementation', None)!r} takes no custom mask"
    elif not {"position_ids", "logits_to_keep"} <= params:
        reason = "its forward takes no position_ids or logits_to_keep"
    elif not attends_causally(model):
        reason = "not every attention layer is causal"
    else:
        reason = _window(text)[0]
    try:
        _reasons[model] = reason
    except TypeError:  # pragma: no cover - every nn.Module can be weakly referenced
        pass
    return reason


def _common(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):  # rows of different lengths
        if x != y:
            break
        n += 1
    return n


def prefix_groups(rows: list[list[int]], caps: list[int], min_tokens: int) -> list[tuple[list[int], int]]:
    """Rows grouped by a common prefix: ``[(row indices, prefix length)]``, singletons with length 0.

    ``caps[r]`` is the longest prefix row ``r`` may share (up to the position before its first supervised token).
    Sorted by their tokens, rows that share a prefix are adjacent, and a group's prefix is the shortest common prefix
    of its neighbouring rows; the grouping into runs of sorted rows that saves the most tokens (a group of ``k`` rows
    sharing ``p`` tokens saves ``(k - 1) * p``, each prefix at least ``min_tokens`` long) is found exactly, by
    dynamic programming over the few rows of a micro-batch. So a row that shares only a short template with its
    neighbours never shortens the long paragraph two of them share.
    """
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    n = len(order)
    # link[i]: the prefix rows order[i] and order[i + 1] may share
    link = [min(caps[order[i]], caps[order[i + 1]],
                _common(rows[order[i]], rows[order[i + 1]], min(caps[order[i]], caps[order[i + 1]])))
            for i in range(n - 1)]
    best = [0] * (n + 1)  # best[i]: tokens saved by the best grouping of the first i sorted rows
    cut = [0] * (n + 1)  # where the last group of that grouping starts
    for i in range(1, n + 1):
        best[i], cut[i] = best[i - 1], i - 1  # order[i - 1] alone
        p = None
        for j in range(i - 2, -1, -1):  # the group order[j .. i - 1]
            p = link[j] if p is None else min(p, link[j])
            if p < min_tokens:
                break
            if best[j] + (i - 1 - j) * p > best[i]:
                best[i], cut[i] = best[j] + (i - 1 - j) * p, j
    groups: list[tuple[list[int], int]] = []
    i = n
    while i > 0:
        j = cut[i]
        members = [order[k] for k in range(j, i)]
        groups.append((members, min(link[j : i - 1]) if len(members) > 1 else 0))
        i = j
    return groups[::-1]


@dataclass
class PrefixSharing:
    """Lays out micro-batches so that prompt prefixes shared by several rows are computed once, and counts it.

    ``pack`` returns the model inputs of the shared layout, or None when the plain batch is the better one (no
    shared prefix of ``min_tokens`` or more, too little saved, a model it does not cover, left padding).
    """

    min_tokens: int = 32
    # The 4D mask costs less than the tokens it saves, so nearly any saving is worth it (docs/performance.md).
    max_share: float = 0.95
    max_mask_values: int = 2**27  # the 4D mask (one byte per value) stays under 128 MiB
    batches: int = 0
    shared_batches: int = 0
    rows: int = 0
    tokens_saved: int = 0
    tokens: int = 0
    reason: str | None = field(default=None)

    _COUNTS = ("batches", "shared_batches", "rows", "tokens_saved", "tokens")

    def state(self) -> dict[str, int]:
        """The counts so far (a checkpoint keeps them, so a resumed epoch reports what an uninterrupted one does)."""
        return {k: getattr(self, k) for k in self._COUNTS}

    def load(self, state: dict[str, int]) -> None:
        for k in self._COUNTS:
            setattr(self, k, int(state.get(k, 0)))

    def take(self) -> dict[str, int]:
        """The counts since the last call, then zeroed."""
        out = self.state()
        self.load({})
        return out

    def pack(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor] | None:
        """``(model kwargs, logits_to_keep mask, targets)`` for the shared layout, or None for the plain batch."""
        ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
        if mask is None or ids.dim() != 2:
            return None
        lengths = mask.sum(1).tolist()
        self.batches += 1
        self.tokens += int(sum(lengths))
        self.reason = why_not_shared(model)
        if self.reason is not None:
            return None
        if not bool((mask[:, 1:] <= mask[:, :-1]).all()):
            return None  # left padding or holes: the rows' positions are not 0..length-1
        supervised = labels[:, 1:] != IGNORE_INDEX
        first = torch.where(supervised.any(1), supervised.int().argmax(1), supervised.shape[1]).tolist()
        caps = [min(f, n - 1) for f, n in zip(first, lengths, strict=True)]
        # Whether a prefix is computed once depends on the rows sharing the micro-batch; its dropout masks must not
        # (an out-of-memory split regroups rows): before its first supervised token, a row is keyed by its tokens.
        share_prefix_keys(ids, caps)
        if ids.shape[0] < 2:
            return None
        rows = [r[:n] for r, n in zip(ids.tolist(), lengths, strict=True)]
        groups = prefix_groups(rows, caps, self.min_tokens)
        if all(len(m) == 1 for m, _ in groups):
            return None
        width = max(sum(lengths[r] for r in m) - (len(m) - 1) * p for m, p in groups)
        if len(groups) * width > self.max_share * ids.numel() or len(groups) * width * width > self.max_mask_values:
            return None
        self.shared_batches += 1
        self.rows += sum(len(m) - 1 for m, _ in groups)
        self.tokens_saved += sum((len(m) - 1) * p for m, p in groups)
        return self._layout(model, ids, labels, lengths, groups, width)

    def _layout(self, model: Any, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int],
                groups: list[tuple[list[int], int]], width: int) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        n, dev = len(groups), ids.device
        new_ids = ids.new_zeros((n, width))
        targets = labels.new_full((n, width), IGNORE_INDEX)  # what each position predicts (the next token of its row)
        positions = torch.zeros((n, width), dtype=torch.long, device=dev)
        segment = torch.full((n, width), -2, dtype=torch.long, device=dev)  # -1 the shared prefix, k >= 0 a row, -2 pad
        source = torch.zeros((n, width), dtype=torch.long, device=dev)  # the collated row each position comes from
        for i, (members, p) in enumerate(groups):
            pieces = [(members[0], 0, p, -1)] if p else []
            pieces += [(r, p, lengths[r], k) for k, r in enumerate(members)]
            o = 0
            for r, start, end, seg in pieces:
                m = end - start
                new_ids[i, o : o + m] = ids[r, start:end]
                targets[i, o : o + m - 1] = labels[r, start + 1 : end]  # a piece's last token predicts nothing here
                positions[i, o : o + m] = torch.arange(start, end, device=dev)
                segment[i, o : o + m] = seg
                source[i, o : o + m] = r
                o += m
            positions[i, o:] = torch.arange(width - o, device=dev)
        relayout(source, positions)  # each position keeps its dropout masks (training/dropout.py)
        q = torch.arange(width, device=dev)
        sq, sk = segment[:, :, None], segment[:, None, :]
        allowed = (q[:, None] >= q[None, :]) & (((sq == sk) & (sq != -2)) | ((sk == -1) & (sq >= 0)))
        _, window = _window(_text_config(model))
        if window:
            allowed &= (positions[:, :, None] - positions[:, None, :]) < window
        allowed |= torch.eye(width, dtype=torch.bool, device=dev)  # a pad sees itself: no row of the softmax is empty
        mask4d = allowed[:, None]
        if inner_model(model).config._attn_implementation == "eager":  # eager attention adds the mask to its scores
            mask4d = torch.zeros(mask4d.shape, device=dev).masked_fill_(~mask4d, torch.finfo(torch.float32).min)
        keep = targets != IGNORE_INDEX
        kwargs = {"input_ids": new_ids, "attention_mask": mask4d, "position_ids": positions, "use_cache": False}
        return kwargs, keep, targets[keep]


def _text_config(model: Any) -> Any:
    cfg = inner_model(model).config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
