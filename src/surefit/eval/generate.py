"""Batched greedy generation with left padding that stops at EOS."""

from __future__ import annotations

from typing import Any

import torch

from surefit.data.collate import PadCollator


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
    from transformers import GenerationConfig

    was_training = model.training
    model.eval()
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id,
    )
    collate = PadCollator(pad_token_id=pad_token_id, padding_side="left")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    eos = set(eos_token_ids)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = collate([{"input_ids": prompts[i]} for i in idx])
        batch = {k: v.to(device) for k, v in batch.items()}
        ctx = autocast() if autocast is not None else torch.no_grad()
        with ctx:
            generated = model.generate(**batch, generation_config=config)
        new = generated[:, batch["input_ids"].shape[1] :].tolist()
        for i, seq in zip(idx, new, strict=True):
            cut = next((k for k, t in enumerate(seq) if t in eos), len(seq))
            out[i] = seq[:cut]
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    model.train(was_training)
    return out
