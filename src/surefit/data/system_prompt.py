"""The system prompt a chat template adds by itself, found by rendering, and what ``--system_prompt`` puts instead.

Some templates write a default system turn into every conversation that has none (SmolLM2's: "You are a helpful AI
assistant named SmolLM, trained by Hugging Face"; Qwen2.5's: "You are Qwen, created by Alibaba Cloud..."). It is
found without knowing any template: render one user turn with and without a system turn holding a marker; when the
render without it equals the render with it, the marker replaced by some text, that text is the default.
"""

from __future__ import annotations

from typing import Any

_MARK = "zq7SYSTEMPROBEq7z"
_USER = "Hello zqx."


def injected_system_prompt(tokenizer: Any, source: str | None) -> str | None:
    """The text the chat template ``source`` puts in a system turn when the conversation has none, or ``None``.

    ``None`` also when the template ignores system turns, fails to render one, or adds text whatever the system turn
    says (a date header): only a default that a system turn of the user's would replace counts.
    """
    if not source or not hasattr(tokenizer, "apply_chat_template"):
        return None
    user = [{"role": "user", "content": _USER}]
    try:
        plain = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, chat_template=source)
        marked = tokenizer.apply_chat_template([{"role": "system", "content": _MARK}, *user], tokenize=False,
                                               add_generation_prompt=True, chat_template=source)
    except Exception:  # noqa: BLE001 - a template that rejects system turns adds none
        return None
    if not isinstance(plain, str) or not isinstance(marked, str) or marked.count(_MARK) != 1:
        return None
    before, after = marked.split(_MARK)
    if len(plain) < len(before) + len(after) or not plain.startswith(before) or not plain.endswith(after):
        return None
    text = plain[len(before): len(plain) - len(after)]
    return text if text.strip() else None


def system_turn(setting: str, injected: str | None) -> str | None:
    """The system text to give rows without a system turn under ``--system_prompt setting``; ``None``: none added.

    ``auto`` keeps the template's own behaviour; ``none`` gives an empty system turn where the template would add its
    default (so nothing is injected); any other text is the system turn itself.
    """
    if setting == "auto":
        return None
    if setting.lower() == "none":
        return "" if injected is not None else None
    return setting


def with_system(messages: list[dict], text: str | None) -> list[dict]:
    """``messages`` with a system turn ``text`` in front when they have none (``text`` ``None``: unchanged)."""
    if text is None or (messages and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": text}, *messages]


def describe(injected: str | None, setting: str, rows: int, total: int) -> str | None:
    """The line a run prints about system prompts, or ``None`` when the template adds none and none was asked for."""
    shown = f"{injected[:100]!r}{'...' if injected and len(injected) > 100 else ''}" if injected else ""
    if setting == "auto":
        if injected is None:
            return None
        return (f"system prompt: the chat template adds its default system turn {shown} to {rows} of {total} rows "
                "(those without a system turn); --system_prompt none leaves it out, --system_prompt TEXT replaces it")
    if setting.lower() == "none":
        if injected is None:
            return "system prompt: none (--system_prompt none; the chat template adds no default)"
        return (f"system prompt: none: an empty system turn in {rows} of {total} rows, in place of the template's "
                f"default {shown} (--system_prompt none)")
    return f"system prompt: {setting[:100]!r} in {rows} of {total} rows without a system turn (--system_prompt)"
