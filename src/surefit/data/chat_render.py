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
from dataclasses import dataclass
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


# ------------------------------------------------------------------------------------------ templates and probes

# Built-in chat templates for base models that ship none. Each writes a terminator token after every turn, renders a
# system turn, a tool turn and the tool schemas (as a system note), and ends a generation prompt with the assistant
# header, so the render of a prefix is a prefix of the full render.
BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}"
        "{{ messages[0]['content'] + '\\n\\n' }}{% endif %}{{ 'You can call these tools:\\n' + (tools | tojson) + "
        "'<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
        "{{ 'You can call these tools:\\n' + (tools | tojson) + '<|eot_id|>' }}{% endif %}"
        "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
        "{{ '<|start_header_id|>' + ('ipython' if m['role'] == 'tool' else m['role']) + '<|end_header_id|>\\n\\n' + "
        "m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% set ns = namespace(system='') %}"
        "{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] + '\\n\\n' %}{% endif %}"
        "{% if tools %}{% set ns.system = ns.system + 'You can call these tools:\\n' + (tools | tojson) + '\\n\\n' %}"
        "{% endif %}{% set ns.first = true %}"
        "{% for m in messages %}{% if m['role'] != 'system' %}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
        "{% if ns.first and m['role'] == 'user' %}{{ ns.system }}{% set ns.first = false %}{% endif %}"
        "{{ m['content'] + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
}
TOOLS_NOTE = "You can call these tools:\n"


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and what it takes.

    Attributes:
        source: the Jinja text.
        name: how it is named to the user: ``"the model's own"``, ``"chatml"``, a file path.
        takes_tools: the template renders ``tools`` itself; otherwise they go into the system turn as JSON.
        takes_tool_calls: the template renders an assistant turn's ``tool_calls``; otherwise the call is written
            into the turn's content as JSON (so the model still learns to make it).
        reasoning_fields: the message fields the template reads reasoning from (``reasoning_content``,
            ``thinking``, ``reasoning``); empty: it reads none.
        reads_inline_think: the template takes an inline ``<think>...</think>`` out of the content itself.
        thinking_switch: the template has a thinking switch (``enable_thinking``).
    """

    source: str
    name: str
    takes_tools: bool
    takes_tool_calls: bool
    reasoning_fields: tuple[str, ...] = ()
    reads_inline_think: bool = False
    thinking_switch: bool = False


def chat_format(source: str, name: str) -> ChatFormat:
    import re

    fields = tuple(f for f in REASONING_FIELDS if re.search(rf"\b{f}\b", source))
    return ChatFormat(source, name, "tools" in source, "tool_calls" in source, fields, "</think>" in source,
                      "enable_thinking" in source)




# How reasoning is written into the content for a template that reads no reasoning field: the think block
# reasoning models write (DeepSeek-R1's, Qwen3's), opened and closed.
INLINE_THINK = ("<think>\n", "\n</think>\n\n")


def inline_reasoning(reasoning: str, content: str) -> str:
    return f"{INLINE_THINK[0]}{reasoning}{INLINE_THINK[1]}{content}"


# Probe texts: rendered once per template to learn what it writes around a turn (no real text contains them).
PROBE_USER = "\u2063PROBE_USER\u2063"
_PROBE_REASONING = "\u2063PROBE_REASONING\u2063"
_PROBE_ANSWER = "\u2063PROBE_ANSWER\u2063"


@dataclass(frozen=True)
class TemplateTraits:
    """What probe renders tell about a template (computed once per template and tokenizer).

    Attributes:
        closing: what a render without a generation prompt ends with that a conversation continuing does not
            have (Phi-3's ``eos_token``); ``""`` for most templates.
        rejects_system: rendering a system turn raises an error, a conversation without one renders.
        reasoning_marks: ``(before, between)``: what the template writes before a probe turn's reasoning and between
            it and the answer, after the generation prompt; ``None`` when the template does not write reasoning.
        next_turn: the special token a template without an end-of-turn token writes next after an answer (the next
            role's header), which then ends the turn.
        prefill: what the generation prompt writes after the point where a render of an assistant turn parts from
            it (DeepSeek-R1's ``<think>\n``): prompt at inference, so training writes it before the turn's reasoning,
            unsupervised; ``""`` where the generation prompt is the start of that render.
    """

    closing: str
    rejects_system: bool
    reasoning_marks: tuple[str, str] | None
    next_turn: str = ""  # the special token that starts the turn after an assistant turn (GLM's "<|user|>")
    prefill: str = ""


_TRAITS: dict[tuple, TemplateTraits] = {}


def template_variables(tokenizer: Any) -> dict[str, Any]:
    """What a template reads besides the messages: the special tokens (``bos_token``, ``eos_token``, ...)."""
    return dict(getattr(tokenizer, "special_tokens_map", {}) or {})


def template_traits(tokenizer: Any, fmt: ChatFormat) -> TemplateTraits:
    """Probe renders of ``fmt``: its closing suffix, whether it rejects a system turn, how it marks reasoning."""
    key = (fmt.source, tuple(sorted(template_variables(tokenizer).items())))
    if key in _TRAITS:
        return _TRAITS[key]
    variables = template_variables(tokenizer)
    user = [{"role": "user", "content": PROBE_USER}]

    def r(msgs: list[dict], gen: bool) -> str:
        return render(fmt.source, fmt.name, msgs, None, gen, variables)

    def after(a: str, b: str) -> str:
        """What ``b`` has after the tokens it shares with ``a`` (compared in tokens: a shared "<|" is no boundary)."""
        ta, tb = _ids(tokenizer, a), _ids(tokenizer, b)
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        return tokenizer.decode(tb[n:], skip_special_tokens=False)

    plain, prompt = r(user, False), r(user, True)
    closing = after(prompt, plain)
    try:
        r([{"role": "system", "content": PROBE_USER}, *user], False)
        rejects_system = False
    except TemplateLimit:
        raise
    except TemplateProblem:
        rejects_system = True
    marks = None
    turn = plain_message({"role": "assistant", "content": _PROBE_ANSWER, "reasoning": _PROBE_REASONING},
                         fmt.reasoning_fields)
    if not fmt.reasoning_fields:  # written inline, as render_chat writes reasoning for such a template
        turn["content"] = inline_reasoning(_PROBE_REASONING, _PROBE_ANSWER)
    try:
        span = r([*user, turn], False)[len(prompt):]
    except TemplateProblem:
        span = ""
    if _PROBE_REASONING in span and _PROBE_ANSWER in span.split(_PROBE_REASONING, 1)[1]:
        between = span.split(_PROBE_REASONING, 1)[1].split(_PROBE_ANSWER, 1)[0]
        marks = (span.split(_PROBE_REASONING, 1)[0], between)
    # A prefill: the generation prompt goes on past where the render of an answered turn parts from it. The model
    # writes what follows it, so a think block it opens is closed as the template marks reasoning (as surefit
    # writes it inline where the template marks none, e.g. one that drops reasoning from every render).
    prefill = ""
    try:
        shown = r([*user, {"role": "assistant", "content": _PROBE_ANSWER}], False)
        if not shown.startswith(prompt):
            prefill = prompt[common_prefix(prompt, shown):]
    except TemplateProblem:
        pass
    if prefill and marks is None and INLINE_THINK[0].startswith(prefill):
        marks = INLINE_THINK
    next_turn = ""
    try:
        answered = [*user, {"role": "assistant", "content": _PROBE_ANSWER}]
        follow = _ids(tokenizer, after(r(answered, False), r([*answered, *user], False)).lstrip())[:1]
        if follow and follow[0] in template_special_ids(tokenizer):
            next_turn = tokenizer.decode(follow, skip_special_tokens=False)
    except TemplateProblem:
        pass
    _TRAITS[key] = traits = TemplateTraits(closing, rejects_system, marks, next_turn, prefill)
    return traits


def prefilled_turn(before: str, plain: str, reasoning: str, traits: TemplateTraits) -> str | None:
    """The training render of an assistant turn for a template whose generation prompt ``before`` ends with its
    prefill (DeepSeek-R1's ``<think>\n``), which its own render ``plain`` of the turn (without reasoning) never
    writes: the generation prompt, then what the model writes after it (the rest of the think block with the
    turn's reasoning, or empty, closed as the template marks reasoning), then the template's turn from the answer
    on. ``None`` where the two do not part at the prefill, or the prefill opens no think block."""
    p = traits.prefill
    if not p or traits.reasoning_marks is None or not before.endswith(p):
        return None
    head, (opener, between) = before[: len(before) - len(p)], traits.reasoning_marks
    if not plain.startswith(head) or not opener.startswith(p):
        return None
    return before + (opener + reasoning + between)[len(p):] + plain[len(head):]


def split_reasoning(text: str, traits: TemplateTraits | None, native: bool = True) -> dict[str, str] | None:
    """A generated turn (special tokens kept) -> ``{"reasoning", "answer"}`` where the template marks reasoning
    (the text it writes between a turn's reasoning and its answer, learned from a probe render); ``None`` otherwise.
    ``native=False`` (a template that reads no reasoning; surefit wrote it inline): ``None`` unless the text has it.
    """
    if traits is None or traits.reasoning_marks is None:
        return None
    before, between = traits.reasoning_marks
    cut = between.strip()
    if not cut or cut not in text:
        return {"reasoning": "", "answer": text.strip()} if native else None
    reasoning, answer = text.split(cut, 1)
    opener = before.strip()
    if opener and reasoning.lstrip().startswith(opener):
        reasoning = reasoning.lstrip()[len(opener):]
    # what the template writes between reasoning and answer may be several marks (gpt-oss's channel switch)
    rest = between[between.index(cut) + len(cut):].strip()
    if rest and answer.lstrip().startswith(rest):
        answer = answer.lstrip()[len(rest):]
    return {"reasoning": reasoning.strip(), "answer": answer.strip()}




def row_variables(tokenizer: Any, fmt: ChatFormat, messages: list[dict], thinking: str) -> dict[str, Any]:
    """Template variables for one conversation: the special tokens, and the thinking switch off for a row without
    reasoning under ``--thinking switch_off`` (as inference prompts with ``enable_thinking=False``)."""
    variables = template_variables(tokenizer)
    if thinking == "switch_off" and fmt.thinking_switch and not any(m.get("reasoning") for m in messages):
        variables["enable_thinking"] = False
    return variables


def render_chat(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None,
                add_generation_prompt: bool, variables: dict[str, Any] | None = None,
                system_turn: str = "fold") -> str:
    """The template's text for ``messages`` (internal form, see :mod:`surefit.data.formats`), rendered in the
    sandbox (:mod:`surefit.data.chat_render`) as the model's own tooling passes them."""
    import json

    msgs = []
    for m in messages:
        msg = dict(m)
        if msg.get("tool_calls") and not fmt.takes_tool_calls:
            calls = [c.get("function", c) for c in msg.pop("tool_calls")]
            if not msg["content"].strip():
                msg["content"] = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
        elif msg.get("tool_calls") and fmt.takes_tool_calls:
            # The content holds the call's JSON too (ShareGPT function_call): the template writes the call itself.
            if m["content"].strip().startswith(("{", "[")):
                msg["content"] = ""
        if msg.get("reasoning") and not fmt.reasoning_fields:
            # A template with no reasoning field: the reasoning goes inline, where such templates (and models) read it
            msg["content"] = inline_reasoning(msg["reasoning"], msg["content"])
        msgs.append(plain_message(msg, fmt.reasoning_fields))
    kwargs: dict[str, Any] = {}
    if tools and fmt.takes_tools:
        kwargs["tools"] = tools
    elif tools:
        note = TOOLS_NOTE + json.dumps(tools, ensure_ascii=False)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
    if variables is None:
        variables = template_variables(tokenizer)
    if (msgs and msgs[0]["role"] == "system" and system_turn == "fold" and len(msgs) > 1
            and msgs[1]["role"] == "user" and template_traits(tokenizer, fmt).rejects_system):
        msgs = [{**msgs[1], "content": msgs[0]["content"] + "\n\n" + msgs[1]["content"]}, *msgs[2:]]
    try:
        return render(fmt.source, fmt.name, msgs, kwargs.get("tools"), add_generation_prompt, variables)
    except TemplateLimit:
        raise
    except TemplateProblem:
        # Some templates concatenate a call's arguments as text (OpenAI's own form: a JSON string), others take
        # an object: the arguments are passed as a JSON string when the object fails.
        if not any(not isinstance(c.get("function", c).get("arguments", ""), str)
                   for m in msgs for c in m.get("tool_calls") or []):
            raise
        msgs = [{**m, "tool_calls": [_string_arguments(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in msgs]
        return render(fmt.source, fmt.name, msgs, kwargs.get("tools"), add_generation_prompt, variables)


def _string_arguments(call: dict) -> dict:
    import json

    fn = call.get("function", call)
    if isinstance(fn.get("arguments"), str):
        return call
    fn = {**fn, "arguments": json.dumps(fn.get("arguments", {}), ensure_ascii=False)}
    return {**call, "function": fn} if "function" in call else fn




def special_texts(tokenizer: Any) -> list[str]:
    """The special tokens as text, longest first (to take them out of a decoded generation)."""
    return sorted({tokenizer.convert_ids_to_tokens(i) for i in template_special_ids(tokenizer)}, key=len, reverse=True)


def template_special_ids(tokenizer: Any) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {i for i, t in added.items() if getattr(t, "special", False)}
    return ids




def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def reasoning_answer(tokenizer: Any, fmt: ChatFormat, raw: str) -> dict[str, str] | None:
    """A generated turn (special tokens kept) -> ``{"reasoning", "answer"}`` without special tokens, where the
    template marks reasoning (or the text holds surefit's inline ``<think>`` for a template that reads none)."""
    native = bool(fmt.reasoning_fields or fmt.reads_inline_think)
    parts = split_reasoning(raw, template_traits(tokenizer, fmt), native)
    if parts is None:
        return None
    for tok in special_texts(tokenizer):
        parts = {k: v.replace(tok, "") for k, v in parts.items()}
    return {k: v.strip() for k, v in parts.items()}


def answer_of(tokenizer: Any, fmt: ChatFormat) -> Any:
    """``raw -> answer`` for the metrics where the template marks reasoning; ``None`` where it does not."""
    if template_traits(tokenizer, fmt).reasoning_marks is None:
        return None
    specials = special_texts(tokenizer)

    def answer(raw: str) -> str:
        parts = reasoning_answer(tokenizer, fmt, raw)
        if parts is not None:
            return parts["answer"]
        for tok in specials:
            raw = raw.replace(tok, "")
        return raw.strip()

    return answer


def differ(a: str, b: str) -> str:
    """Where two texts part, in words."""
    i = common_prefix(a, b)
    back = i
    while back > max(0, i - 40) and a[back - 1] not in "\n >":  # show whole tokens: "<think>", not "think>"
        back -= 1
    i = back if back > max(0, i - 40) else i
    return (f"at character {i}: the generation prompt has {a[i:i + 40]!r}, the training render has "
            f"{b[i:i + 40]!r} (after {a[max(0, i - 30):i]!r})")


def answer_start(span: str, message: dict) -> int:
    content = message["content"].strip()
    i = span.rfind(content) if content else -1
    return max(i, 0)


def answer_end(span: str, message: dict, fmt: ChatFormat, k: int) -> int:
    """Where the assistant's answer (or its tool call) ends in its trained span; the template must write the content
    and the reasoning of the turn (dropping them would train something else than the row)."""
    reasoning = (message.get("reasoning") or "").strip()
    if reasoning and reasoning not in span:
        raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the template drops this turn's reasoning "
                              f"(the trained span is {span[:80]!r}), so it would not be trained")
    content = message["content"].strip()
    if message.get("tool_calls"):
        names = [c.get("function", c).get("name", "") for c in message["tool_calls"]]
        found = [span.rfind(n) for n in names]
        if min(found) < 0:
            raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the tool call {', '.join(names)} is "
                                  f"not in the trained span {span[:80]!r}")
        if not content or content.startswith(("{", "[")):
            i = max(found)
            return i + len(names[found.index(i)])
    if content and content in span:
        return span.rfind(content) + len(content)
    raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the trained span {span[:80]!r} does not hold "
                          "the assistant's content (the template changes or drops it)")


def thinking_line(thinking: str, thinking_rows: int, scaffold: dict[str, int]) -> str | None:
    """The thinking choice, where it applied: what the template writes before an answer without reasoning."""
    if thinking == "switch_off" and thinking_rows:
        return (f"thinking: {thinking_rows} rows without reasoning rendered with the template's thinking "
                "switch off (--thinking switch_off): the empty think block is in the prompt, not trained; "
                "predict and eval prompt with thinking off")
    if not scaffold:
        return None
    shown = ", ".join(f"{t!r} ({n} turns)" for t, n in sorted(scaffold.items(), key=lambda x: -x[1])[:3])
    if thinking == "switch_off":  # asked, but no row could switch (no switch in the template, or rows with reasoning)
        return (f"thinking: the template writes {shown} before an answer without reasoning; trained with the answer: "
                "--thinking switch_off moves it into the prompt only for rows without reasoning, where the template "
                "has a thinking switch (enable_thinking)")
    return (f"thinking: the template writes {shown} before an answer without reasoning; trained with the answer "
            "(--thinking train_empty, the default: the model learns to write it at inference; --thinking "
            "switch_off puts it in the prompt where the template has a thinking switch)")
