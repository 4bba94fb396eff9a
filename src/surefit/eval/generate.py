"""Batched greedy generation with left padding that stops at EOS: an own decode loop over a KV cache.

What makes it fast. The first three, and the caller's lean adapter forward, keep every row's greedy tokens bit for
bit (tested against transformers' ``generate`` on the same batches, row by row); the two options after them can
round differently in 16 bits and are off unless asked for:

- Prompts are sorted by length, so a batch has little padding; a row that has ended leaves the batch.
- ``prefill_batch``: a decode batch larger than the prefill's. A decode step reads every weight once whatever the
  number of rows, so more rows per step cost little more (SmolLM2-135M on one CPU thread: a step of 32 rows took
  about 1.8x a step of 8); a prompt's forward costs the same per token at any batch. So prompts are run in batches of
  ``prefill_batch`` rows of similar length (no more padding than before), and their KV caches are stacked, left
  padded to the longest, into one decode batch of ``batch_size`` rows. Each prompt is computed in the batch shape
  ``model.generate`` would use with ``batch_size = prefill_batch``; the decode steps see more (masked) rows, which
  can round differently in 16 bits (counted in ``benchmarks/generation.py``).
- The LM head runs at the last position only (``logits_to_keep=1``).
- ``loss_pass``: the evaluation's validation loss and the prompts' forward are one forward. Each row is laid out
  ``[pad | prompt | answer | pad]`` with every prompt ending in the same column; one forward over the whole example
  gives the loss of its supervised tokens, and the keys and values of the columns up to that one are the prompt's
  own (a causal model's prompt positions never see the answer), so the cache is cut there and decoding continues
  from it. The same numbers as a separate loss pass and prefill in exact arithmetic; computed in another batch
  shape, 16-bit rounding can differ (agreement measured in ``benchmarks/generation.py``).
- The KV cache is reserved once per batch for prompt + ``max_new_tokens`` and written in place (``Reserved``):
  transformers' default cache concatenates every layer's keys and values at every step, copying the whole cache.
- ``share_prefixes``: rows that begin with the same tokens (questions on one SQuAD paragraph) compute that prefix
  once: its keys and values are copied to each row, then each row's own rest is run. The same numbers in exact
  arithmetic; computed in another batch shape, 16-bit rounding can differ and flip a near-tie.
- ``lora_context``: the caller's lean adapter forward (surefit's: the training forward's numbers without its
  per-call casts and autograd bookkeeping; layers that read the same input share its 16-bit cast), or
  ``merge_lora``: adapters merged into a temporary copy of the frozen weights, one matmul per linear layer, and
  under autocast the numbers of peft's ``merge_and_unload()`` model (16-bit layer outputs, no fp32 adapter sum, no
  casts around each layer). The trained adapter and the base weights are never changed. Merging rounds
  ``W + scale * B @ A`` to the weights' dtype (16 bits under mixed precision), so its answers can differ from the
  unmerged model's (counted in ``benchmarks/generation.py``); it is an option, not the default.
- ``lookup_tokens``: prompt lookup decoding (an option, ``--prompt_lookup_num_tokens``). Each decode forward also runs
  draft tokens copied from the row's own context (``PromptLookup``) and keeps those that are the model's greedy choice
  after the ones before them: the same tokens in exact arithmetic, in fewer forwards where answers copy from the
  prompt. Turned-down drafts stay in the cache as masked columns (room for ``max_new_tokens`` of them is reserved, and
  no draft goes past it); ``DraftWidth`` chooses each forward's columns. Computed in another shape, 16-bit rounding
  can differ.
- Both of the last two leave gaps between a row's cache columns (a shared prefix's padding, turned-down drafts).
  A sliding window is counted in columns, so a batch whose cache could grow past the model's window is generated
  without them (counted in ``stats``): with the gaps the window would drop tokens it keeps in ``generate``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from surefit.data.collate import IGNORE_INDEX, PadCollator, length_parts, part_cost
from surefit.eval.generate_speedups import DraftWidth, Merged, PromptLookup, merged_lora, reserve, select_rows
from surefit.models import inner_model
from surefit.threads import check_threads

# A prefix shorter than this is computed with each row: sharing it saves less than the extra forward costs.
MIN_SHARED_PREFIX = 16


class LossPassUnfit(RuntimeError):
    """The model's KV cache holds layers other than plain attention ones (linear attention, convolutions), so
    a prompt's keys and values cannot be cut out of the whole example's, or the model transforms its logits after the
    head. Raised at the first batch, before any loss is added: the caller computes the loss in a pass of its own."""


@dataclass
class LossPass:
    """The validation loss computed in the prompts' forward (see the module's ``loss_pass``).

    Attributes:
        features: per prompt, ``input_ids`` (the prompt, then its answer) and ``labels`` (-100 where no loss); the
            prompt must be the beginning of ``input_ids`` (:func:`why_no_loss_pass`).
        head_loss: ``(model, hidden [n, H], targets [n]) -> loss sum``: the LM head and the cross-entropy on the hidden
            states at supervised positions, as the loss pass computes them.
        loss_sum, tokens: summed over every batch (the caller reads them after the generation).
    """

    features: list[dict[str, list[int]]]
    head_loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    loss_sum: float = 0.0
    tokens: int = 0


@dataclass
class Decode:
    """What a greedy decode needs beyond the model and the prompts.

    Attributes:
        pad_token_id: pad id; eos_token_ids: ids that end an answer.
        max_new_tokens: longest continuation; batch_size: prompts per batch.
        prefill_batch: prompts run through the model at once before decoding (None: the whole batch); a batch of
            ``batch_size`` rows is prefilled in parts of this size and decoded together.
        merge_lora: decode with LoRA adapters merged into a temporary copy of the weights (see :func:`merged_lora`).
        reuse_cache: reserve each batch's KV cache once and write it in place (False: transformers' growing cache).
        share_prefixes: compute a prompt prefix of ``MIN_SHARED_PREFIX`` tokens or more that several prompts start
            with once per batch (the caller checks that the model family takes a mask with a hole in it).
        prefill_by_length: prefill a batch in parts of up to ``prefill_batch`` rows of similar length, as many as
            :func:`length_parts` finds cheapest, instead of parts of exactly ``prefill_batch`` (their caches are stacked
            as always). False: the tokens of ``generate()`` on the same batches, bit for bit in 16 bits too.
    """

    pad_token_id: int
    eos_token_ids: list[int]
    max_new_tokens: int
    batch_size: int
    prefill_batch: int | None = None
    merge_lora: bool = False
    reuse_cache: bool = True
    share_prefixes: bool = False
    loss_pass: LossPass | None = None
    lookup_tokens: int = 0
    prefill_by_length: bool = False


def why_no_loss_pass(model: Any, prompts: list[list[int]], features: list[dict[str, list[int]]], *,
                     merge_lora: bool, share_prefixes: bool) -> str | None:
    """Why the loss cannot be computed in the prompts' forward here (None: it can): merged adapters or shared
    prefixes compute the prompts otherwise than the loss pass, a forward without ``logits_to_keep`` gives no hidden
    states to score, a prompt that is not the beginning of its example cannot be cut out of it."""
    if merge_lora or share_prefixes:
        return "the prompts are computed with merged adapters or shared prefixes"
    if "logits_to_keep" not in _forward_kwargs(model)[0]:
        return "the model's forward takes no logits_to_keep"
    if any(not p or f["input_ids"][: len(p)] != p for p, f in zip(prompts, features, strict=True)):
        return "a prompt is not the beginning of its example"
    return None


@torch.no_grad()
def greedy_generate(model: Any, prompts: list[list[int]], decode: Decode, *, device: torch.device | str = "cpu",
                    autocast: Any = None, progress: Any = None,
                    lora_context: Callable[[Any], AbstractContextManager] | None = None,
                    stats: dict[str, int] | None = None) -> list[list[int]]:
    """Greedy continuations of tokenized prompts, in the prompts' order.

    Prompts are sorted by length so each batch has little padding, padded on the LEFT (a decoder continues from the
    last position, so right padding would put pad tokens between the prompt and the answer), and each continuation is
    cut at its first EOS.

    Args:
        model: a causal LM (or peft model) whose forward takes ``position_ids``, ``attention_mask`` and a KV cache.
        prompts: token ids per prompt.
        decode: ids, lengths, batch and speed switches (:class:`Decode`).
        autocast: a context-manager factory (e.g. ``accelerator.autocast``) or ``None``.
        progress: called as ``progress(done, total)`` after each batch (prompts done of all), or ``None``.
        lora_context: without merged adapters (or when merging ran out of memory), a context entered with the model
            around the whole generation, e.g. surefit's lean LoRA forward (``training/speedups/lora_generate.py``).
        stats: if given, receives counters: ``merged_layers``, ``merge_out_of_memory`` (0/1), ``lora_out_of_memory``
            (0/1: ``lora_context`` yielded an object whose ``out_of_memory`` is true), ``prompt_tokens``,
            ``prefill_tokens`` (computed), ``prefill_parts`` (the prompts' forwards, one per part); ``window`` and
            ``window_rows``: the model's sliding window and the prompts generated without shared prefixes and drafts
            because their cache could pass it.

    Returns:
        The generated token ids per prompt, without the prompt and without the EOS.
    """
    pad_token_id, eos_token_ids, max_new_tokens = decode.pad_token_id, decode.eos_token_ids, decode.max_new_tokens
    batch_size, merge_lora, reuse_cache, share_prefixes = (decode.batch_size, decode.merge_lora, decode.reuse_cache,
                                                           decode.share_prefixes)
    was_training = model.training
    model.eval()
    stats = stats if stats is not None else {}
    stats.update(prompt_tokens=sum(map(len, prompts)), prefill_tokens=0)
    if decode.loss_pass is not None:
        why = why_no_loss_pass(model, prompts, decode.loss_pass.features, merge_lora=merge_lora,
                               share_prefixes=share_prefixes)
        if why is not None:
            raise ValueError(f"loss_pass: {why}")
    batches = _batches(prompts, batch_size, share_prefixes)
    window = sliding_window(model)
    counts: dict[str, int] = {}
    out: list[list[int]] = [[] for _ in prompts]
    eos = set(eos_token_ids)
    done = 0
    try:
        merging = merged_lora(model) if merge_lora else contextlib.nullcontext(Merged())
        with contextlib.ExitStack() as stack:
            merged = stack.enter_context(merging)
            stats["merged_layers"], stats["merge_out_of_memory"] = merged.layers, int(merged.out_of_memory)
            if lora_context is not None and not merged.layers:
                entered = stack.enter_context(lora_context(model))
                # a context that can run out of memory setting itself up (packed layers) says so as merging does
                stats["lora_out_of_memory"] = int(bool(getattr(entered, "out_of_memory", False)))
            for idx, shared in batches:
                ctx = autocast() if autocast is not None else contextlib.nullcontext()
                lookup_tokens = decode.lookup_tokens
                if window is not None and (any(shared) or lookup_tokens) and _columns(
                        [prompts[i] for i in idx], shared, max_new_tokens, lookup_tokens) > window:
                    # A gap in the cache (a shared prefix's padding, a turned-down draft) moves the columns apart
                    # while the positions stay: the window, counted in columns, would cut tokens it should keep.
                    shared, lookup_tokens = [0] * len(idx), 0
                    stats.update(window=window, window_rows=stats.get("window_rows", 0) + len(idx))
                how = _Step(pad_token_id, eos, max_new_tokens, device, reuse_cache, decode.prefill_batch,
                            decode.loss_pass, lookup_tokens, counts, decode.prefill_by_length)
                feats = None if decode.loss_pass is None else [decode.loss_pass.features[i] for i in idx]
                with ctx:
                    new, computed = _decode(model, [prompts[i] for i in idx], shared, how, feats)
                stats["prefill_tokens"] += computed
                for i, seq in zip(idx, new, strict=True):
                    out[i] = seq
                done += len(idx)
                if progress is not None:
                    progress(done, len(prompts))
    finally:
        model.train(was_training)
    stats.update(decode_forwards=counts.get("decode_forwards", 0), drafted=counts.get("drafted", 0),
                 confirmed=counts.get("confirmed", 0), prefill_parts=counts.get("prefill_parts", 0))
    return out


def sliding_window(model: Any) -> int | None:
    """The narrowest attention window any layer of the model applies, in tokens (None: every layer sees the whole
    context). Read from the config as transformers builds the masks from it: ``sliding_window`` unless
    ``use_sliding_window`` is false or ``layer_types`` names no sliding layer."""
    cfg = getattr(inner_model(model), "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window or getattr(text, "use_sliding_window", True) is False or (
            types is not None and "sliding_attention" not in types):
        return None
    return int(window)


def other_layer_kinds(model: Any) -> list[str]:
    """The model's layer kinds other than full and sliding-window attention (convolutions, linear attention, Mamba
    mixers; layers that reuse another's keys), from its config: their cache holds states, not keys and values, so
    the loss pass cannot cut it. Empty for a plain attention model."""
    cfg = getattr(inner_model(model), "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    kinds = sorted(set(getattr(text, "layer_types", None) or []) - {"full_attention", "sliding_attention"})
    if getattr(text, "num_kv_shared_layers", 0):
        kinds.append("shared key/value")
    return kinds


def _columns(prompts: list[list[int]], shared: list[int], max_new_tokens: int, lookup_tokens: int) -> int:
    """The most cache columns a batch can reach: its prompts as :func:`_prefill` lays them out (the longest shared
    prefix, then the longest rest) and room for the answers (twice with prompt lookup: turned-down drafts)."""
    if any(shared):
        heads = [n or len(p) - 1 for p, n in zip(prompts, shared, strict=True)]
        width = max(heads) + max(len(p) - n for p, n in zip(prompts, heads, strict=True))
    else:
        width = max(map(len, prompts))
    return width + max_new_tokens * (2 if lookup_tokens else 1)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _batches(prompts: list[list[int]], batch_size: int, share: bool) -> list[tuple[list[int], list[int]]]:
    """``(prompt indices, shared prefix length per row)`` per batch.

    Without sharing: longest prompts first, every prefix length 0. With sharing: prompts sorted by their tokens put
    those with a common beginning next to each other; a run of neighbours whose common prefix is at least
    ``MIN_SHARED_PREFIX`` tokens forms a group (a row starts a new group where its common prefix with the next row is
    longer than with the previous one, so a long shared paragraph is not cut back to a shorter system prompt). Groups
    go longest first; each row keeps at least its last token to itself.
    """
    if not share:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        return [(order[s : s + batch_size], [0] * len(order[s : s + batch_size]))
                for s in range(0, len(order), batch_size)]
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    lcp = [_lcp(prompts[a], prompts[b]) for a, b in zip(order, order[1:], strict=False)]
    groups: list[tuple[list[int], int]] = []
    k = 0
    while k < len(order):
        common = lcp[k] if k < len(lcp) else 0
        if common < MIN_SHARED_PREFIX or (k + 1 < len(lcp) and lcp[k + 1] > common):
            groups.append(([order[k]], 0))
            k += 1
            continue
        j = k + 1
        while j < len(lcp) and lcp[j] >= common:
            j += 1
        groups.append((order[k : j + 1], common))
        k = j + 1
    groups.sort(key=lambda g: -max(len(prompts[i]) for i in g[0]))
    rows = [(i, min(p, len(prompts[i]) - 1)) for g, p in groups for i in g]
    return [([i for i, _ in rows[s : s + batch_size]], [p for _, p in rows[s : s + batch_size]])
            for s in range(0, len(rows), batch_size)]


def _prefill(model: Any, prompts: list[list[int]], shared: list[int], pad_token_id: int, device: Any,
             extra: dict, cache_arg: str) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
    """Run the prompts; returns ``(output with logits and cache, attention mask, last positions, tokens computed)``.

    With shared prefixes, each distinct prefix of the batch is run once (left padded, as a batch of its own), its
    keys and values are copied to the rows that share it, and then every row's rest is run on top, left padded within
    the rest: a row is ``[pad | prefix | pad | rest]`` with the pads masked out and positions counting real tokens
    only, so each token attends to exactly the tokens of its own prompt at their own positions.
    """
    collate = PadCollator(pad_token_id=pad_token_id, padding_side="left")
    if not any(shared) or min(map(len, prompts)) < 2:
        batch = collate([{"input_ids": p} for p in prompts])
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                     **_own_cache(model, cache_arg), **extra)
        return step, mask, positions[:, -1], int(mask.sum())
    heads: dict[tuple[int, ...], int] = {}
    which, rests = [], []
    for p, n in zip(prompts, shared, strict=True):
        # A row without a partner runs all but its last token as its own "prefix": one path for every row.
        n = n or len(p) - 1
        which.append(heads.setdefault(tuple(p[:n]), len(heads)))
        rests.append(p[n:])
    pre = collate([{"input_ids": list(h)} for h in heads])
    pre_ids, pre_mask = pre["input_ids"].to(device), pre["attention_mask"].to(device)
    pre_pos = (pre_mask.long().cumsum(-1) - 1).clamp(min=0)
    first = model(input_ids=pre_ids, attention_mask=pre_mask, position_ids=pre_pos, use_cache=True,
                  **_own_cache(model, cache_arg), **extra)
    cache = getattr(first, cache_arg)
    rows = torch.tensor(which, device=device)
    select_rows(cache, rows)
    rest = collate([{"input_ids": r} for r in rests])
    rest_ids, rest_mask = rest["input_ids"].to(device), rest["attention_mask"].to(device)
    mask = torch.cat([pre_mask[rows], rest_mask], dim=1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    step = model(input_ids=rest_ids, attention_mask=mask, position_ids=positions[:, pre_ids.shape[1]:],
                 use_cache=True, **{cache_arg: cache}, **extra)
    return step, mask, positions[:, -1], int(pre_mask.sum() + rest_mask.sum())


@dataclass
class _Step:
    """What one batch's decode needs besides the model and prompts (the fields of :class:`Decode` it reads)."""

    pad_token_id: int
    eos: set[int]
    max_new_tokens: int
    device: Any
    reuse_cache: bool
    prefill_batch: int | None
    loss_pass: LossPass | None = None
    lookup_tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # decode_forwards, drafted and confirmed tokens
    prefill_by_length: bool = False


def _loss_prefill(model: Any, prompts: list[list[int]], feats: list[dict[str, list[int]]], how: _Step,
                  cache_arg: str) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
    """One forward over the whole examples: adds their loss to ``how.loss_pass`` and returns what :func:`_prefill`
    does for the prompts (the last prompt position's logits, the cache cut after the prompts, their mask and last
    positions, the tokens computed).

    Rows are ``[pad | prompt | answer | pad]`` with every prompt ending in column ``P - 1``; the LM head's input is
    kept at the supervised positions and at that column (the head swapped for an identity while the model runs)."""
    from types import SimpleNamespace

    assert how.loss_pass is not None
    inner = inner_model(model)
    head = inner.get_output_embeddings()
    name = next(n for n, m in inner.named_children() if m is head)
    width = max(map(len, prompts))
    total = max(width - len(p) + len(f["input_ids"]) for p, f in zip(prompts, feats, strict=True))
    rows = len(prompts)
    ids = torch.full((rows, total), how.pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, total), dtype=torch.long)
    labels = torch.full((rows, total), IGNORE_INDEX, dtype=torch.long)
    for r, (p, f) in enumerate(zip(prompts, feats, strict=True)):
        start, n = width - len(p), len(f["input_ids"])
        ids[r, start : start + n] = torch.tensor(f["input_ids"])
        labels[r, start : start + n] = torch.tensor(f["labels"])
        mask[r, start : start + n] = 1
    ids, mask, labels = ids.to(how.device), mask.to(how.device), labels.to(how.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # position t predicts token t + 1
    keep = scored.clone()
    keep[:, width - 1] = True
    capture = HeadInput()
    setattr(inner, name, capture)
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=keep,
                    **_own_cache(model, cache_arg))
    finally:
        setattr(inner, name, head)
    if out.logits is not capture.seen:
        # the model transforms the head's output (soft-capping, scaling): the loss would have to apply it too
        raise LossPassUnfit("the model transforms its logits after the LM head")
    cache = getattr(out, cache_arg)
    layers = _plain_layers(cache)
    if layers is None:
        raise LossPassUnfit("the model's cache has layers other than plain full-attention ones")
    seen = capture.seen
    assert seen is not None  # the head ran inside model(...)
    hidden = seen.reshape(-1, seen.shape[-1])  # the head's input at the kept positions, row by row
    targets = labels[:, 1:][scored[:, :-1]]
    if targets.numel():
        how.loss_pass.loss_sum += float(how.loss_pass.head_loss(model, hidden[scored[keep]], targets))
        how.loss_pass.tokens += int(targets.numel())
    last = torch.zeros_like(keep)
    last[:, width - 1] = True
    logits = head(hidden[last[keep]])  # [rows, vocab]
    for layer in layers:  # sliced, not crop(): its argument changed meaning between transformers versions
        layer.keys, layer.values = layer.keys[..., :width, :], layer.values[..., :width, :]
    step = SimpleNamespace(logits=logits[:, None, :], **{cache_arg: cache})
    return step, mask[:, :width], positions[:, width - 1], int(mask.sum())


def _own_cache(model: Any, cache_arg: str) -> dict[str, Any]:
    """A cache of plain full-length layers for a model whose every layer is full or sliding-window attention (none
    where it has other kinds: linear attention, convolutions, shared keys keep the model's own cache).

    transformers gives a sliding-window layer a cache that keeps only the window's last tokens; the mask applies the
    window either way (counted in columns, which are the positions where a row's cache has no gaps), so a full-length
    cache gives the same numbers, and is one the loss pass can cut, the stacked prefill can stack and ``Reserved``
    can write in place. The planner already sizes the generation cache as full-length in every layer."""
    if sliding_window(model) is None or other_layer_kinds(model):
        return {}
    from transformers.cache_utils import DynamicCache

    return {cache_arg: DynamicCache()}


def _plain_layers(cache: Any) -> list[Any] | None:
    """The cache's layers where every one is a plain full-attention ``DynamicLayer`` holding 4-D keys (what can be
    cut, stacked and reserved); None otherwise (transformers' own sliding-window layers, linear attention, quantised
    caches; :func:`_own_cache` gives a sliding-window model plain layers)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or layer.keys is None or layer.keys.dim() != 4
                         for layer in layers):
        return None
    return list(layers)


class HeadInput(torch.nn.Module):
    """Stands in for the LM head during a forward: keeps its input (the hidden states) and returns it (the loss in the
    prompts' forward here; the fused head and loss in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.seen = hidden
        return hidden


def _prefill_part(model: Any, prompts: list[list[int]], shared: list[int], feats: list[dict[str, list[int]]] | None,
                  how: _Step, extra: dict, cache_arg: str) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
    """:func:`_prefill`, or :func:`_loss_prefill` where the loss is computed in the prompts' forward."""
    if feats is not None:
        return _loss_prefill(model, prompts, feats, how, cache_arg)
    return _prefill(model, prompts, shared, how.pad_token_id, how.device, extra, cache_arg)


def _prefill_parts(prompts: list[list[int]], shared: list[int], feats: list[dict[str, list[int]]] | None,
                   how: _Step) -> list[tuple[int, int]]:
    """The rows each prefill forward runs, as ``(start, end)``: parts of ``how.prefill_batch`` (with shared prefixes a
    group must stay in one part, and their order keeps groups together), or with ``how.prefill_by_length`` the
    cheapest cut by padded length (:func:`length_parts`); one part where the cache is not reused (nothing to stack)."""
    rows = len(prompts)
    size = min(how.prefill_batch or rows, rows)
    if not how.reuse_cache:
        return [(0, rows)]
    if not how.prefill_by_length or any(shared):
        return [(s, min(s + size, rows)) for s in range(0, rows, size)]
    tails = [0] * rows if feats is None else [len(f["input_ids"]) - len(p) for p, f in zip(prompts, feats, strict=True)]
    return length_parts([len(p) for p in prompts], tails, size, part_cost(how.device))


def _stacked_prefill(model: Any, prompts: list[list[int]], runs: list[tuple[int, int]], shared: list[int],
                     feats: list[dict[str, list[int]]] | None, how: _Step, extra: dict,
                     cache_arg: str) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, int] | None:
    """Prefill in parts (``runs``: ``(start, end)`` rows each) and stack their caches, left padded, into one batch.

    Returns ``(last logits, cache, attention mask, last positions, tokens computed)``, or None where a part's cache
    holds a layer other than a plain full-attention one (sliding windows, linear attention): then nothing was kept
    and the caller prefills the batch whole."""
    parts = []
    for s, e in runs:
        step, mask, last, computed = _prefill_part(model, prompts[s:e], shared[s:e],
                                                   None if feats is None else feats[s:e], how, extra, cache_arg)
        cache = getattr(step, cache_arg)
        if _plain_layers(cache) is None:
            return None
        parts.append((step.logits[:, -1], cache, mask, last, computed))
        del step
    width = max(p[2].shape[1] for p in parts)
    first = parts[0][1]
    for i, layer in enumerate(first.layers):
        # Each part's keys and values at the right end of the stacked row; the pads before them are masked out.
        for name in ("keys", "values"):
            got = [getattr(p[1].layers[i], name) for p in parts]
            stacked = got[0].new_zeros(len(prompts), got[0].shape[1], width, got[0].shape[3])
            row = 0
            for t in got:
                stacked[row : row + t.shape[0], :, width - t.shape[2] :] = t
                row += t.shape[0]
            setattr(layer, name, stacked)
    mask = torch.cat([F.pad(p[2], (width - p[2].shape[1], 0)) for p in parts])
    return (torch.cat([p[0] for p in parts]), first, mask, torch.cat([p[3] for p in parts]),
            sum(p[4] for p in parts))


def _decode(model: Any, prompts: list[list[int]], shared: list[int], how: _Step,
            feats: list[dict[str, list[int]]] | None = None) -> tuple[list[list[int]], int]:
    """Greedy decoding of one batch with a KV cache; a row leaves the batch when it ends.

    The same tokens as ``model.generate`` (greedy, same positions and mask), with less work per step: the LM head
    runs only at the last position (the last ``width`` with drafts), and finished rows stop costing compute instead of
    decoding padding to the end.
    Returns the continuations and the number of prompt tokens computed.
    """
    rows, eos, max_new_tokens = len(prompts), how.eos, how.max_new_tokens
    results: list[list[int]] = [[] for _ in range(rows)]
    if max_new_tokens <= 0 or rows == 0:
        return results, 0
    extra, cache_arg = _forward_kwargs(model)
    stacked = None
    parts = _prefill_parts(prompts, shared, feats, how)
    if len(parts) > 1 and how.reuse_cache:
        stacked = _stacked_prefill(model, prompts, parts, shared, feats, how, extra, cache_arg)
    how.counts["prefill_parts"] = how.counts.get("prefill_parts", 0) + (len(parts) if stacked else 1)
    if stacked is not None:
        logits, cache, attention_mask, last, computed = stacked
    else:
        step, attention_mask, last, computed = _prefill_part(model, prompts, shared, feats, how, extra, cache_arg)
        logits, cache = step.logits[:, -1], getattr(step, cache_arg)
        del step
    # Room for the answer, and with prompt lookup as much again for drafts the model turned down (masked columns).
    room = max_new_tokens * (2 if how.lookup_tokens else 1)
    if how.reuse_cache:
        reserve(cache, room)
    lookup = PromptLookup(prompts, how.lookup_tokens) if how.lookup_tokens else None
    kind = attention_mask.device.type
    widths = DraftWidth.on(attention_mask.device, torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) in (
        torch.bfloat16, torch.float16))
    alive = torch.arange(rows, device=attention_mask.device)
    pending = logits.argmax(-1)  # each alive row's next token, not yet in the cache
    finished: set[int] = set()  # rows (by place in ``alive``) that ended on a confirmed draft token
    used = 0  # cache columns written after the prompts
    while True:
        check_threads()
        ended = []
        for k, (row, token) in enumerate(zip(alive.tolist(), pending.tolist(), strict=True)):
            if k in finished or token in eos:
                ended.append(k)
                continue
            results[row].append(token)
            if lookup is not None:
                lookup.extend(row, [token])
            if len(results[row]) >= max_new_tokens:
                ended.append(k)
        finished = set()
        if len(ended) == len(alive):
            break
        if ended:
            gone = set(ended)
            keep = torch.tensor([k for k in range(len(alive)) if k not in gone], device=attention_mask.device)
            select_rows(cache, keep)
            alive, pending, attention_mask, last = alive[keep], pending[keep], attention_mask[keep], last[keep]
        drafts: list[list[int]] = []
        width = 1
        if lookup is not None:
            left = [max_new_tokens - len(results[row]) for row in alive.tolist()]
            # Columns a plain decode would still need; a draft may use what the room has beyond them.
            spare = room - used - 1 - (max(left) - 1)
            drafts = [lookup.draft(row, min(n - 1, spare)) for row, n in zip(alive.tolist(), left, strict=True)]
            most = max(left)  # the rows furthest behind have the most tokens left
            width = widths.choose(drafts, [lookup.odds(row) for row in alive.tolist()], [n == most for n in left])
            drafts = [d[: width - 1] for d in drafts]
        ids, new_mask = pending[:, None], attention_mask.new_ones(len(alive), width)
        if width > 1:
            ids = torch.cat([ids, torch.tensor([d + [how.pad_token_id] * (width - 1 - len(d)) for d in drafts],
                                               device=ids.device, dtype=ids.dtype)], dim=1)
            for k, d in enumerate(drafts):
                new_mask[k, 1 + len(d) :] = 0
        attention_mask = torch.cat([attention_mask, new_mask], dim=1)
        positions = last[:, None] + 1 + torch.arange(width, device=last.device)
        step = model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                     **{cache_arg: cache}, **(extra if width == 1 or not extra else {**extra, "logits_to_keep": width}))
        used += width
        how.counts["decode_forwards"] = how.counts.get("decode_forwards", 0) + 1
        cache = getattr(step, cache_arg)
        if width == 1:
            pending, last = step.logits[:, -1].argmax(-1), last + 1
            continue
        # Greedy verification: a draft token stands where it is the model's own next token after the ones before it;
        # the prediction after the last confirmed one is the next pending token (the same tokens as one at a time).
        preds = step.logits[:, -width:].argmax(-1).tolist()
        confirmed = []
        for k, (row, d) in enumerate(zip(alive.tolist(), drafts, strict=True)):
            a = 0
            while a < len(d) and preds[k][a] == d[a]:
                a += 1
                if d[a - 1] in eos:
                    finished.add(k)
                    break
                results[row].append(d[a - 1])
                if len(results[row]) >= max_new_tokens:
                    finished.add(k)
                    break
            if lookup is not None:
                lookup.extend(row, d[:a])
                lookup.confirmed(row, len(d), a)
            attention_mask[k, attention_mask.shape[1] - width + 1 + a :] = 0  # the drafts turned down
            confirmed.append(a)
        how.counts["drafted"] = how.counts.get("drafted", 0) + sum(map(len, drafts))
        how.counts["confirmed"] = how.counts.get("confirmed", 0) + sum(confirmed)
        pending = torch.tensor([p[a] for p, a in zip(preds, confirmed, strict=True)],
                               device=pending.device, dtype=pending.dtype)
        last = last + 1 + torch.tensor(confirmed, device=last.device, dtype=last.dtype)
    return results, computed


def _forward_kwargs(model: Any) -> tuple[dict[str, int], str]:
    """``logits_to_keep=1`` where the forward takes it (the prefill's LM head runs at one position, not all), and the
    name of the KV cache argument and output (``cache`` in transformers 5.x, ``past_key_values`` before)."""
    import inspect

    params: Mapping[str, object]
    try:
        params = inspect.signature(type(inner_model(model)).forward).parameters
    except (TypeError, ValueError):
        params = {}
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return extra, "cache" if "cache" in params else "past_key_values"
