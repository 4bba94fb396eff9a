"""Batched greedy generation with left padding that stops at EOS: an own decode loop over a KV cache, in which a
row that has ended leaves the batch."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from surefit.data.collate import PadCollator
from surefit.models import inner_model


@torch.no_grad()
def greedy_generate(
    model: Any,
    prompts: list[list[int]],
    *,
    pad_token_id: int,
    eos_token_ids: list[int],
    max_new_tokens: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: Any = None,
    progress: Any = None,
) -> list[list[int]]:
    """Greedy continuations of tokenized prompts, in the prompts' order.

    Prompts are sorted by length so each batch has little padding, padded on the LEFT (a decoder continues from the
    last position, so right padding would put pad tokens between the prompt and the answer), and each continuation is
    cut at its first EOS.

    Args:
        model: a causal LM (or peft model) with ``generate``.
        prompts: token ids per prompt.
        pad_token_id: pad id; eos_token_ids: ids that end an answer.
        max_new_tokens: longest continuation.
        batch_size: prompts per ``generate`` call.
        autocast: a context-manager factory (e.g. ``accelerator.autocast``) or ``None``.
        progress: called as ``progress(done, total)`` after each batch (prompts done of all), or ``None``.

    Returns:
        The generated token ids per prompt, without the prompt and without the EOS.
    """
    was_training = model.training
    model.eval()
    collate = PadCollator(pad_token_id=pad_token_id, padding_side="left")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    eos = set(eos_token_ids)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = collate([{"input_ids": prompts[i]} for i in idx])
            ctx = autocast() if autocast is not None else contextlib.nullcontext()
            with ctx:
                new = _decode(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), eos,
                              max_new_tokens)
            for i, seq in zip(idx, new, strict=True):
                out[i] = seq
            if progress is not None:
                progress(min(start + batch_size, len(order)), len(order))
    finally:
        model.train(was_training)
    return out


def _decode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, eos: set[int],
            max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of one left-padded batch with a KV cache; a row leaves the batch when it ends.

    The same tokens as ``model.generate`` (greedy, same positions and mask), with less work per step: the LM head
    runs only at the last position, and finished rows stop costing compute instead of decoding padding to the end.
    """
    rows = input_ids.shape[0]
    results: list[list[int]] = [[] for _ in range(rows)]
    if max_new_tokens <= 0 or rows == 0:
        return results
    # Positions count real tokens only, as generate() derives them from the mask: left padding must not shift them.
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    extra, cache_arg = _forward_kwargs(model)
    step = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, **extra)
    cache = getattr(step, cache_arg)
    alive = torch.arange(rows, device=input_ids.device)
    last = positions[:, -1]
    for n in range(max_new_tokens):
        tokens = step.logits[:, -1].argmax(-1)
        ended = []
        for k, (row, token) in enumerate(zip(alive.tolist(), tokens.tolist(), strict=True)):
            if token in eos:
                ended.append(k)
            else:
                results[row].append(token)
        if n == max_new_tokens - 1 or len(ended) == len(alive):
            break
        if ended:
            keep = torch.tensor([k for k in range(len(alive)) if k not in set(ended)], device=input_ids.device)
            cache.batch_select_indices(keep)
            alive, tokens, attention_mask, last = alive[keep], tokens[keep], attention_mask[keep], last[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(alive), 1)], dim=1)
        last = last + 1
        step = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=last[:, None],
                     use_cache=True, **{cache_arg: cache}, **extra)
        cache = getattr(step, cache_arg)
    return results


def _forward_kwargs(model: Any) -> tuple[dict[str, int], str]:
    """``logits_to_keep=1`` where the forward takes it (the prefill's LM head runs at one position, not all), and the
    name of the KV cache argument and output (``cache`` in transformers 5.x, ``past_key_values`` before)."""
    import inspect

    try:
        params = inspect.signature(type(inner_model(model)).forward).parameters
    except (TypeError, ValueError):
        params = {}
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return extra, "cache" if "cache" in params else "past_key_values"
