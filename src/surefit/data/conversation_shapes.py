"""Each conversational row shape turned into OpenAI-form messages: OpenAI ``messages`` (and conversational prompt /
completion), ShareGPT ``conversations`` with tool calls, Alpaca with ``history``. ``formats.py`` detects the shape,
calls one of these and checks the result; read the one your data is in. Problems are collected per row, with the turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from surefit.config.yaml_files import load_json

# Tool-call arguments are a few levels of JSON; deeper text is refused as the data rows are.
_MAX_ARGS_DEPTH = 32


def _text(content: Any) -> str | None:
    """A message's content as text: a string, or a list of text parts (``{"type": "text", "text": ...}``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and isinstance(p.get("text"), str) and p.get("type", "text") == "text":
                parts.append(p["text"])
            else:
                return None
        return "".join(parts)
    return None


class RowProblems:
    """The problems of one row, each with its turn (1-based) where there is one."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []  # (kind, text)

    def add(self, kind: str, text: str) -> None:
        self.items.append((kind, text))


def parse_tools(value: Any, bad: RowProblems) -> list | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = load_json(value)
        except ValueError as e:
            reason = f"{e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else str(e)
            bad.add("tools", f"'tools' is not valid JSON ({reason})")
            return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        bad.add("tools", f"'tools' is not a list of tool objects (got {type(value).__name__})")
        return None
    return value


def check_tool_calls(calls: Any, turn: int, bad: RowProblems) -> None:
    """Each tool call's ``arguments`` given as text must be JSON: a template renders broken text as it is, so the
    model would learn to call tools with it."""
    for i, call in enumerate(calls if isinstance(calls, list) else [calls], 1):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        args = function.get("arguments")
        if not isinstance(args, str):
            continue
        try:
            load_json(args, _MAX_ARGS_DEPTH)
        except ValueError as e:
            name = function.get("name") if isinstance(function.get("name"), str) else f"number {i}"
            reason = str(e)
            bad.add("shape", f"turn {turn}: the 'arguments' of tool call {name!r} are not valid JSON ({reason}): "
                    f"{args[:80]!r}; write them with json.dumps")


def _tool_call(value: str) -> list | None:
    """ShareGPT ``function_call`` text -> OpenAI ``tool_calls`` (``None`` when it is not a JSON call object)."""
    try:
        call = load_json(value, _MAX_ARGS_DEPTH)
    except ValueError:
        return None
    calls = call if isinstance(call, list) else [call]
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", c.get("parameters", {}))
        out.append({"type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


def json_list(items: Any) -> Any:
    """A list stored as JSON text (CSV and some exports write conversations that way) -> the list."""
    if isinstance(items, str) and items.lstrip().startswith("["):
        try:
            return load_json(items, 64)
        except ValueError:
            return items
    return items


def messages_from_openai(items: Any, bad: RowProblems, field_name: str, train: bool = True) -> list[dict]:
    items = json_list(items)
    if not isinstance(items, list) or not items:
        bad.add("shape", f"'{field_name}' is not a non-empty list of messages")
        return []
    out = []
    for turn, m in enumerate(items, 1):
        if not isinstance(m, dict):
            bad.add("shape", f"turn {turn}: a {type(m).__name__}, not a message object")
            continue
        role = m.get("role")
        content = _text(m.get("content")) if m.get("content") is not None else ""
        if content is None:
            bad.add("shape", f"turn {turn}: content is neither text nor a list of text parts")
            content = ""
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]
            check_tool_calls(m["tool_calls"], turn, bad)
        for k in ("name", "tool_call_id"):
            if k in m:
                msg[k] = m[k]
        if role == "assistant":
            msg["train"] = train
            _take_reasoning(msg, m, turn, bad)
        out.append(msg)
    return out


def _take_reasoning(msg: dict, source: dict, turn: int, bad: RowProblems) -> None:
    """An assistant turn's reasoning -> ``msg["reasoning"]``: from ``reasoning_content``, ``reasoning`` or
    ``thinking`` (the names models' tooling uses), or an inline ``<think>...</think>`` at the start of the content."""
    found = [(k, source[k]) for k in REASONING_KEYS if source.get(k) not in (None, "")]
    if found:
        key, value = found[0]
        if not isinstance(value, str):
            bad.add("shape", f"turn {turn}: '{key}' is not text")
            return
        msg["reasoning"] = value
        return
    content = msg["content"]
    stripped = content.lstrip()
    if stripped.startswith("<think>") and "</think>" in stripped:
        inner, _, answer = stripped[len("<think>"):].partition("</think>")
        if inner.strip():
            msg["reasoning"] = inner.strip("\n")
        msg["content"] = answer.lstrip("\n")


REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def messages_from_sharegpt(items: Any, roles: dict[str, str], bad: RowProblems) -> list[dict]:
    items = json_list(items)
    if not isinstance(items, list) or not items:
        bad.add("shape", "'conversations' is not a non-empty list of turns")
        return []
    out = []
    for turn, m in enumerate(items, 1):
        if not isinstance(m, dict):
            bad.add("shape", f"turn {turn}: a {type(m).__name__}, not a turn object")
            continue
        speaker = m.get("from", m.get("role"))
        value = m.get("value", m.get("content"))
        role = roles.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            out.append({"role": speaker, "content": value if isinstance(value, str) else ""})
            continue
        text = _text(value) if value is not None else ""
        if text is None:
            bad.add("shape", f"turn {turn}: 'value' is not text")
            text = ""
        if role == "assistant":
            msg = {"role": "assistant", "content": text, "train": True}
            _take_reasoning(msg, m, turn, bad)
            out.append(msg)
        elif role == "assistant tool call":
            msg = {"role": "assistant", "content": text, "train": True}
            calls = _tool_call(text)
            if calls:
                msg["tool_calls"] = calls
                check_tool_calls(calls, turn, bad)
            else:
                # Trained as plain text, the model would learn a call no tool parser reads.
                bad.add("shape", f"turn {turn}: a function_call turn that is not a JSON call object "
                        f"({{\"name\": ..., \"arguments\": ...}}): {text[:80]!r}")
            out.append(msg)
        else:
            out.append({"role": role, "content": text} | ({"train": True} if role == "assistant" else {}))
    return out


def messages_from_alpaca(f: dict, bad: RowProblems) -> list[dict]:
    out: list[dict] = []
    system = f.get("system")
    if isinstance(system, str) and system.strip():
        out.append({"role": "system", "content": system})
    history = f.get("history") or []
    if not isinstance(history, list):
        bad.add("shape", "'history' is not a list of [instruction, response] pairs")
        history = []
    for i, pair in enumerate(history, 1):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            bad.add("shape", f"history item {i} is not an [instruction, response] pair of texts")
            continue
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1], "train": True}]
    instruction, extra = f.get("instruction"), f.get("input")
    if not isinstance(instruction, str):
        instruction = ""
    # An empty optional input is left out cleanly: no dangling blank lines in the prompt.
    user = "\n\n".join(t for t in (instruction, extra if isinstance(extra, str) else "") if t and t.strip())
    out.append({"role": "user", "content": user})
    output = f.get("output")
    out.append({"role": "assistant", "content": output if isinstance(output, str) else "", "train": True})
    return out


# Keys of a message and what becomes of them (the rest of a message's keys are reported as dropped).
_MESSAGE_KEYS = {
    "role": "the turn's role", "content": "the turn's text", "from": "the turn's speaker", "value": "the turn's text",
    "tool_calls": "the assistant's tool calls, passed to the template", "name": "passed to the template",
    "tool_call_id": "passed to the template", "train": "whether the turn is trained",
}


def message_fields(rows: Sequence[Any], fmt: str, conversational: bool, sample: int = 1000) -> list[dict[str, str]]:
    """The keys inside the rows' messages: reasoning (kept, trained with the answer) and keys nothing reads."""
    container = {"messages": ("messages",), "sharegpt": ("conversations",),
                 "prompt_completion": ("prompt", "completion")}.get(fmt)
    if not container or not conversational:
        return []
    counts: dict[str, int] = {}
    inline = 0
    for r in rows[:sample]:
        for c in container:
            items = json_list(r.fields.get(c))
            for m in items if isinstance(items, list) else []:
                if not isinstance(m, dict):
                    continue
                for k, v in m.items():
                    if v is not None:
                        counts[k] = counts.get(k, 0) + 1
                text = m.get("content", m.get("value"))
                inline += isinstance(text, str) and text.lstrip().startswith("<think>") and "</think>" in text
    out = []
    for k, n in counts.items():
        col = f"{container[0]}[].{k}"
        if k in REASONING_KEYS:
            out.append({"column": col, "status": "kept", "why": f"reasoning of {n} assistant turns: passed to the "
                        "template in the field it reads, trained with the answer"})
        elif k not in _MESSAGE_KEYS:
            out.append({"column": col, "status": "dropped", "why": f"a message key no format reads ({n} turns)"})
    if inline:
        out.append({"column": f"{container[0]}[].content <think>", "status": "kept",
                    "why": f"inline reasoning of {inline} turns: taken out of the content as the turn's reasoning"})
    return out
