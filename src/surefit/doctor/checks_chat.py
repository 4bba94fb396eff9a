"""Checks of chat training built by other tools (TRL's ``assistant_only_loss`` / ``completion_only_loss``): masks that
train everything or nothing, template scaffolding (a think block, a channel header) masked out of the labels, and a
chat template that differs from the model's own.

Codes: ``assistant-mask-degenerate``, ``scaffold-masked``, ``chat-template-differs``. What a template writes between
the generation prompt and the answer is found by rendering probe messages (:mod:`surefit.data.encode`), never by
a list of known strings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from surefit.doctor.checks_data import IGNORE_INDEX, rows_text, setup_tokenizer, train_values
from surefit.doctor.core import Finding, Setup, register

_MASKS = ("assistant_masks", "completion_mask")


@register("assistant-mask-degenerate")
def check_mask_degenerate(setup: Setup) -> list[Finding]:
    """A TRL assistant / completion mask of all ones (the prompt is trained too: the template has no
    ``{% generation %}`` block the mask can see, or the data has no prompt) or all zeros (nothing is trained)."""
    out = []
    for key in _MASKS:
        values, scope = train_values(setup, key)
        ones = [i for i, m in values if isinstance(m, list) and m and all(v == 1 for v in m)]
        zeros = [i for i, m in values if isinstance(m, list) and m and not any(m)]
        if ones:
            out.append(Finding(
                "assistant-mask-degenerate", "error",
                f"'{key}' is 1 at every token of {rows_text(ones)} of {scope} (first: row {ones[0]}, token 0): the "
                "prompt, system and user text are trained as if the model wrote them",
                "with assistant_only_loss, use a chat template whose assistant turns sit in {% generation %} blocks; "
                "with completion_only_loss, give rows a prompt and a completion (or let surefit train the rows: it "
                "finds the assistant turns by position with the model's own template)", f"train_dataset '{key}'"))
        if zeros:
            out.append(Finding(
                "assistant-mask-degenerate", "error",
                f"'{key}' is 0 at every token of {rows_text(zeros)} of {scope} (first: row {zeros[0]}): these rows "
                "train nothing (the template's {% generation %} block is empty, or the completion was cut away)",
                "check the template's {% generation %} block and --max_length; rows with nothing to train should be "
                "removed, not silently kept", f"train_dataset '{key}'"))
    return out


def _scaffold_ids(tok: Any) -> tuple[list[int], str] | None:
    """The tokens a chat template writes between the generation prompt and an answer (Qwen3's empty think block,
    gpt-oss's final-channel header), found by rendering a probe conversation; ``None`` when it writes nothing."""
    from surefit.data.chat_render import TemplateProblem
    from surefit.data.encode import chat_format, render_chat

    source = getattr(tok, "chat_template", None)
    if not isinstance(source, str) or not hasattr(tok, "convert_ids_to_tokens"):
        return None
    fmt = chat_format(source, "the tokenizer's")
    user = [{"role": "user", "content": "\u2063q\u2063"}]
    answer = "\u2063a\u2063"
    try:
        prompt = render_chat(tok, fmt, user, None, True)
        full = render_chat(tok, fmt, [*user, {"role": "assistant", "content": answer}], None, False)
    except TemplateProblem:
        return None
    if not full.startswith(prompt) or answer not in full[len(prompt):]:
        return None
    scaffold = full[len(prompt):].split(answer)[0]
    if not scaffold.strip():
        return None
    ids = list(tok(scaffold.strip(), add_special_tokens=False)["input_ids"])
    return (ids, scaffold) if ids else None


@register("scaffold-masked")
def check_scaffold_masked(setup: Setup) -> list[Finding]:
    """The template's scaffolding before an answer (a think block, a channel header) is masked while the answer
    after it is trained: at inference the model must write it, so it never learns to."""
    tok = setup_tokenizer(setup)
    found = _scaffold_ids(tok) if tok is not None else None
    if found is None:
        return []
    sc, text = found
    n = len(sc)
    labels = dict(train_values(setup, "labels")[0])
    masks = {k: dict(train_values(setup, k)[0]) for k in _MASKS}
    hits: list[tuple[int, int]] = []
    for i, ids in train_values(setup, "input_ids")[0]:
        if not isinstance(ids, list):
            continue
        lab = labels.get(i)
        mask = next((m[i] for m in masks.values() if isinstance(m.get(i), list)), None)
        trained = ([v != IGNORE_INDEX for v in lab] if isinstance(lab, list) and len(lab) == len(ids) else
                   [bool(v) for v in mask] if isinstance(mask, list) and len(mask) == len(ids) else None)
        if trained is None:
            continue
        for j in range(len(ids) - n):  # the answer starts within a few tokens (whitespace after the block)
            if ids[j:j + n] == sc and not any(trained[j:j + n]) and any(trained[j + n:j + n + 8]):
                hits.append((i, j))
                break
    if not hits:
        return []
    rows = [i for i, _ in hits]
    i, j = hits[0]
    first = tok.convert_ids_to_tokens(sc[0])
    return [Finding(
        "scaffold-masked", "error",
        f"the chat template writes {text!r} between the generation prompt and the answer, and in {rows_text(rows)} "
        f"it is masked while the answer after it is trained (first: row {i}, token {j}, {first!r}): at inference the "
        "model must write it itself, so it never learns the format its template expects",
        "train the scaffolding with the answer: a {% generation %} block that starts at the assistant header's end, "
        "or surefit's sft encoding (it trains what the template writes after the generation prompt)",
        f"train_dataset row {i}, token {j}")]


def _model_template(model: Any) -> tuple[str, str] | None:
    """The chat template the model's own folder ships, and where it was read (a local folder only)."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not path or not Path(str(path)).is_dir():
        return None
    folder = Path(str(path))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    cfg = folder / "tokenizer_config.json"
    try:
        own = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template") if cfg.is_file() else None
    except ValueError:
        return None
    return (own, str(cfg)) if isinstance(own, str) else None


@register("chat-template-differs")
def check_template_differs(setup: Setup) -> list[Finding]:
    """The tokenizer renders with a chat template other than the one the model ships (a swapped-in training
    template): what the model is trained on is not what its own template will prompt at inference."""
    from surefit.data.chat_render import common_prefix

    tok = setup_tokenizer(setup)
    used = getattr(tok, "chat_template", None) if tok is not None else None
    own = _model_template(setup.base_model if setup.model is not None else None) if used else None
    if not isinstance(used, str) or own is None or own[0] == used:
        return []
    at = common_prefix(own[0], used)
    return [Finding(
        "chat-template-differs", "warning",
        f"the tokenizer's chat template differs from the model's own ({own[1]}) at character {at}: the model's has "
        f"{own[0][at:at + 40]!r}, the tokenizer's {used[at:at + 40]!r}; training on one and prompting with the other "
        "at inference trains a format the model will not see",
        "train with the model's own template (surefit trains it unpatched, by position), or ship the training "
        "template with the model so that inference uses it too", "tokenizer.chat_template")]
