"""Chat templates rendered in a sandbox, and what a few probe renders tell about a template.

A chat template is code from a model repository. It renders in Jinja's immutable sandbox (as ``transformers``
renders it, with the same globals and filters), under a time limit and an output-size limit: a template whose loops
never return, or that builds a string large enough to take the process down in the tokenizer's allocator, is an
error naming the template instead of a hung or killed run.

Messages reach the template as a model's own tooling passes them: keys a message does not have are absent (never
``None``), and reasoning is passed in the field the template reads (``reasoning_content``, ``thinking`` or
``reasoning``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import signal
import threading
import types
from collections.abc import Iterator
from typing import Any

# Per render. A real conversation of a thousand turns renders in milliseconds; these only stop runaways.
RENDER_SECONDS = 10.0
RENDER_CHARS = 4_000_000  # plus 8 characters per character of the messages themselves
_LIMIT: contextvars.ContextVar[int] = contextvars.ContextVar("render_limit", default=RENDER_CHARS)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateProblem(Exception):
    """A chat template that cannot render or label a row (caught and reported with the row)."""


class TemplateLimit(TemplateProblem):
    """A chat template that ran past the time or output-size limit: an error for the whole run, not one row."""


def _guarded_binop(self: Any, context: Any, operator: str, left: Any, right: Any) -> Any:
    """``*``, ``+`` and ``**`` in a template, refused before they build a result past the size limit."""
    limit = _LIMIT.get()
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limit:
                raise TemplateLimit(f"it builds a value of {len(seq) * n:,} items ({operator!r}), past the "
                                    f"{limit:,}-character limit of a render")
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        if len(left) + len(right) > limit:
            raise TemplateLimit(f"it builds a value of {len(left) + len(right):,} characters, past the {limit:,}-"
                                "character limit of a render")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
        raise TemplateLimit(f"it computes {left} ** {right}, a number too large to render")
    return self.binop_table[operator](left, right)


@functools.lru_cache(maxsize=32)
def compiled(source: str) -> Any:
    """The template compiled in transformers' sandboxed environment, with size-checked ``*``, ``+`` and ``**``."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(source).environment.overlay()
    env.intercepted_binops = frozenset({"*", "+", "**"})
    env.call_binop = types.MethodType(_guarded_binop, env)
    return env.from_string(source)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`TemplateLimit` in this (main) thread after ``seconds``; elsewhere signals cannot interrupt it and
    only the size limits hold."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise TemplateLimit(f"it ran past the {seconds:g} s limit of a render (a loop that does not end?)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def plain_message(message: dict, reasoning_fields: tuple[str, ...]) -> dict:
    """A message as the model's tooling passes it: no ``None`` values, no surefit keys, reasoning in the fields
    the template reads."""
    out = {k: v for k, v in message.items() if v is not None and k not in ("train", "reasoning")}
    if message.get("reasoning"):
        for f in reasoning_fields:
            out[f] = message["reasoning"]
    return out


def render(source: str, name: str, messages: list[dict], tools: list | None, add_generation_prompt: bool,
           variables: dict[str, Any]) -> str:
    """The template's text for ``messages`` (already in the form the template reads), in the sandbox.

    Raises:
        TemplateLimit: past the time or size limit (names the template).
        TemplateProblem: the template raised an error (e.g. Gemma's "System role not supported").
    """
    size = sum(len(str(m.get("content", ""))) + len(str(m.get("reasoning_content", ""))) for m in messages)
    limit = RENDER_CHARS + 8 * size
    token = _LIMIT.set(limit)
    parts: list[str] = []
    n = 0
    try:
        template = compiled(source)
        with _deadline(RENDER_SECONDS):
            for chunk in template.generate(messages=messages, tools=tools, documents=None,
                                           add_generation_prompt=add_generation_prompt, **variables):
                n += len(chunk)
                if n > limit:
                    raise TemplateLimit(f"its output passed the {limit:,}-character limit of a render")
                parts.append(chunk)
    except TemplateLimit as e:
        raise TemplateLimit(f"chat template ({name}) stopped: {e}; a template that does this is not usable, "
                            "fix or replace it (--chat_format FILE.jinja)") from None
    except (MemoryError, RecursionError) as e:
        raise TemplateLimit(f"chat template ({name}) stopped: it ran out of {'memory' if isinstance(e, MemoryError) else 'stack'}"
                            " while rendering; fix or replace it (--chat_format FILE.jinja)") from None
    except Exception as e:  # noqa: BLE001 - an error raised by the template itself (e.g. "roles must alternate")
        raise TemplateProblem(f"chat template ({name}) failed to render: {e}") from e
    finally:
        _LIMIT.reset(token)
    return "".join(parts)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:  # binary search: comparing slices runs in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
