"""Row shapes -> one internal form. Detected from the rows; ``--format`` overrides.

Flat rows (today's ``input`` / ``target``, string ``prompt`` / ``completion``) keep their fields and are encoded
with a prompt template. Every conversational shape (OpenAI ``messages``, ShareGPT ``conversations``, Alpaca,
conversational prompt / completion) becomes a list of messages in the OpenAI form::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [...]  (assistant only, optional),  "train": bool (assistant only; False: context, not trained)}

stored on the row as ``fields["messages"]`` (and ``fields["tools"]``: a list, or ``None``). Every problem of every
row is collected with its file, line and turn and reported together; under ``--on_bad_rows skip`` bad rows are
dropped and counted instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from surefit.data.conversation_shapes import (
    RowProblems,
    json_list,
    message_fields,
    messages_from_alpaca,
    messages_from_openai,
    messages_from_sharegpt,
    parse_tools,
)
from surefit.data.readers import SKIP_HINT, CountedNote, Rejected, check_text_fields
from surefit.data.rows import Row
from surefit.errors import Problem

FORMATS = ("auto", "input_target", "prompt_completion", "alpaca", "messages", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names seen in the wild -> roles. "function_call" is an assistant turn that calls a tool.
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "function_call": "assistant tool call", "observation": "tool", "tool": "tool", "function": "tool",
}
MAX_WHERES = 8


@dataclass
class FormatChoice:
    """What was detected (or chosen) and how the row's fields map to the internal form.

    Attributes:
        name: one of :data:`FORMATS` (never ``"auto"``).
        conversational: rows become ``messages`` (else they stay flat: ``input`` / ``target`` fields).
        used: the row fields this format reads (the rest are reported as not used).
        fields: the fields read, as printed; mapping: what became of them, as printed.
        role_map: ShareGPT speaker -> role (ShareGPT only).
    """

    name: str
    conversational: bool
    used: tuple[str, ...]
    fields: str
    mapping: str
    role_map: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        return f"format: {self.name} ({self.fields}): {self.mapping}"


def parse_role_map(text: str | None) -> tuple[dict[str, str], list[Problem]]:
    """``"bot=assistant,human=user"`` -> ``{"bot": "assistant", "human": "user"}`` (checked)."""
    out: dict[str, str] = {}
    problems: list[Problem] = []
    if not text:
        return out, problems
    allowed = ROLES + ("assistant tool call",)
    for part in text.split(","):
        name, eq, role = part.partition("=")
        name, role = name.strip(), role.strip()
        if not eq or not name or role not in allowed:
            problems.append(Problem(f"cannot read {part.strip()!r}: expected SPEAKER=ROLE with ROLE one of "
                                    f"{', '.join(allowed)}", "--role_map", 'e.g. --role_map "bot=assistant,human=user"'))
            continue
        out[name] = role
    return out, problems


def field_counts(rows: Sequence[Row]) -> tuple[dict[str, int], Callable[..., bool]]:
    """How many rows have each field, and ``has(*names)``: whether more than half the rows have every one of them
    (a shape is the majority's, so a few odd rows do not decide it)."""
    keys: dict[str, int] = {}
    for r in rows:
        for k in r.fields:
            keys[k] = keys.get(k, 0) + 1
    n = max(len(rows), 1)
    return keys, lambda *names: all(keys.get(k, 0) * 2 > n for k in names)


def detect_format(rows: Sequence[Row], source: str, wanted: str = "auto", input_field: str = "input",
                  target_field: str = "target", role_map: dict[str, str] | None = None,
                  needs_input: bool = True) -> FormatChoice | Problem:
    """The rows' format: ``wanted`` unless ``"auto"``, else the first shape whose fields most rows have.

    ``needs_input=False``: a ``--template`` names the prompt's fields, so flat rows need only the target field.

    Returns a :class:`Problem` (naming the fields found and the known shapes) when no shape fits.
    """
    keys, has = field_counts(rows)

    name = wanted
    if wanted == "auto":
        if has("messages"):
            name = "messages"
        elif has("conversations"):
            name = "sharegpt"
        elif has(input_field, target_field) or (not needs_input and has(target_field) and not has("output")):
            name = "input_target"
        elif has("prompt", "completion"):
            name = "prompt_completion"
        elif has("instruction", "output"):
            name = "alpaca"
        else:
            found = ", ".join(repr(k) for k in sorted(keys)) or "(none)"
            return Problem(
                f"cannot tell the format of {source}: its fields are {found}", "--format",
                "rows need one of: 'messages' (OpenAI chat), 'conversations' (ShareGPT), 'instruction' + 'output' "
                "(Alpaca), 'prompt' + 'completion', or input/target text fields (--input_field / --target_field NAME)")
    if name == "input_target":
        return FormatChoice(name, False, (input_field, target_field), f"{input_field} / {target_field}",
                            f"{input_field} -> prompt, {target_field} -> trained answer")
    if name == "prompt_completion":
        sample = next((r.fields.get("prompt") for r in rows if "prompt" in r.fields), "")
        if isinstance(sample, list):
            return FormatChoice(name, True, ("prompt", "completion", "tools"), "prompt / completion, conversational",
                                "prompt messages -> context (never trained), completion messages -> trained")
        return FormatChoice(name, False, ("prompt", "completion"), "prompt / completion",
                            "prompt -> prompt as written (no template), completion -> trained answer")
    if name == "alpaca":
        return FormatChoice(name, True, ("instruction", "input", "output", "system", "history"),
                            "instruction / input / output", "system -> system, history -> earlier turns, instruction + input -> user, "
                            "output -> assistant")
    if name == "messages":
        return FormatChoice(name, True, ("messages", "tools"), "messages / role / content",
                            "role / content: system, user, assistant (with tool_calls), tool; tools -> template")
    roles = {**SHAREGPT_ROLES, **(role_map or {})}
    speakers: list[str] = []
    for r in rows:
        conv = json_list(r.fields.get("conversations"))
        if isinstance(conv, list):
            for m in conv:
                s = m.get("from", m.get("role")) if isinstance(m, dict) else None
                if isinstance(s, str) and s not in speakers:
                    speakers.append(s)
    shown = ", ".join(f"{s} -> {roles[s]}" for s in speakers if s in roles)
    unknown = [s for s in speakers if s not in roles]
    if unknown:
        shown += ", " * bool(shown) + ", ".join(f"{s} -> ? (unknown)" for s in unknown)
    return FormatChoice(name, True, ("conversations", "tools", "system"), "conversations / from / value", shown, roles)


def check_messages(messages: list[dict], bad: RowProblems, complete: bool = True) -> None:
    """Known roles, no empty turn, a possible order: system first, no two assistant turns in a row, ends on an
    assistant turn."""
    first = next((t for t, m in enumerate(messages, 1) if m["role"] != "system"), None)
    if first is not None and messages[first - 1]["role"] in ("assistant", "tool"):
        bad.add("order", f"turn {first}: starts with a{'n' if messages[first - 1]['role'] == 'assistant' else ''} "
                         f"{messages[first - 1]['role']} turn; the first turn after the system turn is a user turn")
    for turn, m in enumerate(messages, 1):
        role = m["role"]
        if role not in ROLES:
            bad.add("role", f"turn {turn}: unknown role {role!r}")
            continue
        if not m["content"].strip() and not m.get("tool_calls"):
            bad.add("empty", f"turn {turn} ({role}) is empty")
        if role == "system" and turn != 1:
            bad.add("order", f"turn {turn}: a system turn after the first turn")
        if role == "assistant" and turn > 1 and messages[turn - 2]["role"] == "assistant":
            bad.add("order", f"turns {turn - 1}-{turn}: two assistant turns in a row")
    if complete and messages and messages[-1]["role"] in ROLES and messages[-1]["role"] != "assistant":
        bad.add("order", f"ends on a {messages[-1]['role']} turn (turn {len(messages)}): nothing to train after it")


_FIXES = {
    "role": "use the roles system, user, assistant, tool (map other ShareGPT speaker names with --role_map "
            "SPEAKER=ROLE), or fix these rows",
    "empty": "fill in or remove the empty turns",
    "order": "a conversation starts with an optional system turn, then alternates user (or tool) and assistant "
             "turns and ends on an assistant turn; fix or remove these rows",
    "tools": "make 'tools' a JSON list of tool objects (json.dumps it), or remove it",
    "shape": "see docs/chat.md for the shape of each format",
    "missing": "add the field to these rows or remove them",
}
_KIND_TEXT = {"role": "an unknown role", "empty": "an empty turn", "order": "an impossible turn order",
              "tools": "a bad 'tools' field", "shape": "a malformed conversation", "missing": "a missing field"}


def to_conversations(rows: list[Row], choice: FormatChoice, source: str, problems: list[Problem],
                     rejects: list[Rejected] | None = None, complete: bool = True) -> list[Row]:
    """Rows of a conversational format -> rows with ``messages`` and ``tools`` fields, every row checked.

    Bad rows are problems (one per kind, each row listed with its turn), or, under ``--on_bad_rows skip``
    (``rejects`` a list), appended to ``rejects`` with every reason. ``complete=False`` (``predict``): a
    conversation may end on a user or tool turn (the model answers it).
    """
    out: list[Row] = []
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        bad = RowProblems()
        f = row.fields
        tools = None
        if choice.name == "messages":
            messages = messages_from_openai(f.get("messages"), bad, "messages")
            tools = parse_tools(f.get("tools"), bad)
        elif choice.name == "sharegpt":
            messages = messages_from_sharegpt(f.get("conversations"), choice.role_map, bad)
            system = f.get("system")
            if isinstance(system, str) and system.strip() and not (messages and messages[0]["role"] == "system"):
                messages.insert(0, {"role": "system", "content": system})
            tools = parse_tools(f.get("tools"), bad)
        elif choice.name == "alpaca":
            for name in ("instruction", "output"):
                if not isinstance(f.get(name), str) or not f[name].strip():
                    bad.add("missing", f"'{name}' is missing or empty")
            messages = messages_from_alpaca(f, bad) if not bad.items else []
        else:  # conversational prompt / completion: the prompt's assistant turns are context, not trained
            messages = (messages_from_openai(f.get("prompt"), bad, "prompt", train=False)
                        + messages_from_openai(f.get("completion"), bad, "completion"))
            tools = parse_tools(f.get("tools"), bad)
        if not any(k in ("shape", "missing") for k, _ in bad.items):
            check_messages(messages, bad, complete)
        if not bad.items:
            out.append(row.with_fields(messages=messages, tools=tools))
            continue
        local = row.where[len(source) + 1:] if row.where.startswith(source + " ") else row.where
        if rejects is not None:
            rejects.append(Rejected(row.where, "; ".join(t for _, t in bad.items),
                                    json.dumps(row.fields, ensure_ascii=False)[:2000]))
            continue
        for kind, text in bad.items:
            by_kind.setdefault(kind, []).append((local, text))
    for kind, items in by_kind.items():
        rows_hit = len({w for w, _ in items})
        shown = "; ".join(f"{w} {t}" for w, t in items[:MAX_WHERES])
        shown += f"; and {len(items) - MAX_WHERES} more" if len(items) > MAX_WHERES else ""
        problems.append(Problem(f"{rows_hit} row{'s' if rows_hit != 1 else ''} {'have' if rows_hit != 1 else 'has'} "
                                f"{_KIND_TEXT[kind]}: {shown}", where=source, fix=f"{_FIXES[kind]}; {SKIP_HINT}"))
    return out


def flat_rows(rows: list[Row], choice: FormatChoice) -> list[Row]:
    """String prompt / completion rows -> ``input`` / ``target`` fields (the encoder's flat form)."""
    if choice.name != "prompt_completion":
        return rows
    return [r.with_fields(input=r.fields.get("prompt"), target=r.fields.get("completion")) for r in rows]


def field_table(rows: Sequence[Row], choice: FormatChoice, extra_used: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Every field of the rows and what became of it: ``[{"column", "status", "why"}]`` (as classify prints)."""
    counts: dict[str, int] = {}
    for r in rows:
        for k in r.fields:
            counts[k] = counts.get(k, 0) + 1
    table = []
    for name, n in counts.items():
        where = f" ({n} of {len(rows)} rows)" if n != len(rows) else ""
        if name in extra_used:
            table.append({"column": name, "status": "kept", "why": f"named in --template{where}"})
        elif name in choice.used:
            table.append({"column": name, "status": "kept", "why": f"read by the {choice.name} format{where}"})
        elif name == "answers":
            table.append({"column": name, "status": "kept", "why": "gold answers for scoring"})
        elif _inside(rows, name, choice.used[0]):
            table.append({"column": name, "status": "kept", "why": f"its text is part of '{choice.used[0]}' already"})
        else:
            table.append({"column": name, "status": "dropped",
                          "why": f"not part of the {choice.name} format{where}; name it in --template to use it"})
    return table + message_fields(rows, choice.name, choice.conversational)


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_fields(template: str) -> list[str]:
    """The fields a ``--template`` names, in order, each once."""
    return list(dict.fromkeys(_PLACEHOLDER.findall(template)))


def fill_template(template: str, fields: dict[str, Any]) -> str:
    """The template with each ``{field}`` replaced by the row's value.

    A paragraph (text between blank lines) whose fields are all empty or absent is left out whole, so that an
    empty optional field (Alpaca's ``input``) leaves no dangling "### Input:" header or blank lines behind.
    """
    def value(name: str) -> str:
        v = fields.get(name)
        return "" if v is None else str(v)

    parts = re.split(r"(\n\s*\n)", template)
    # (separator before, paragraph): a paragraph left out takes its separator with it.
    paragraphs = [("" if i == 0 else parts[i - 1], parts[i]) for i in range(0, len(parts), 2)]
    out: list[str] = []
    for sep, para in paragraphs:
        names = _PLACEHOLDER.findall(para)
        if names and not any(value(n).strip() for n in names):
            continue
        out.append((sep if out else "") + _PLACEHOLDER.sub(lambda m: value(m.group(1)), para))
    return "".join(out)


def apply_template(rows: list[Row], template: str, choice: FormatChoice, input_field: str, source: str,
                   problems: list[Problem], counted: list[CountedNote] | None = None) -> tuple[list[Row], list[str]]:
    """Fill ``--template`` from each row's fields: a flat row's input becomes the filled text; an Alpaca row's user
    turn does. A field no row has is a problem (before anything trains); one some rows lack is left out of those
    rows and counted in the notes.

    ``{input}`` of a flat row is the ``--input_field`` column (as it always was). ``counted``: as
    :func:`check_text_fields`.
    """
    names = template_fields(template)
    alias = {"input": input_field} if not choice.conversational else {}
    present = {k for r in rows for k in r.fields}
    missing = [n for n in names if alias.get(n, n) not in present]
    if missing:
        listed = ", ".join(repr(k) for k in sorted(present)) or "(none)"
        problems.append(Problem(f"--template names {', '.join('{' + n + '}' for n in missing)}, a field no row of "
                                f"{source} has (its fields: {listed})", "--template",
                                "name fields the rows have, e.g. {instruction} and {input}"))
        return rows, []
    notes: list[str] = []
    for at, n in enumerate(names):
        lacking = sum(1 for r in rows if not str(r.fields.get(alias.get(n, n)) or "").strip())
        if lacking:

            def lacking_note(count: int, of: int, n: str = n) -> str:
                return f"--template: {count} of {of} rows have no or an empty '{n}'; its paragraph is left out of " \
                    "their prompt"

            notes.append(lacking_note(lacking, len(rows)))
            if counted is not None:
                counted.append(CountedNote((1, at), lacking, lacking_note))
    out = []
    for r in rows:
        values = {n: r.fields.get(alias.get(n, n)) for n in names}
        text = fill_template(template, values)
        if choice.conversational:
            messages = [dict(m) for m in r.fields["messages"]]
            last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last_user]["content"] = text
            out.append(r.with_fields(messages=messages))
        else:
            out.append(r.with_fields(**{input_field: text}))
    return out, notes


def _inside(rows: Sequence[Row], name: str, container: str, sample: int = 50) -> bool:
    """Whether the field's text is part of another field's in every sampled row (SQuAD's context and question are
    part of its input)."""
    seen = [r for r in rows[:sample] if name in r.fields and name != container]
    # Short values (ids, numbers) are found inside any text by chance: only texts of 8 characters or more count.
    return bool(seen) and all(isinstance(r.fields[name], str) and len(r.fields[name].strip()) >= 8
                              and isinstance(r.fields.get(container), str) and r.fields[name] in r.fields[container]
                              for r in seen)


def last_assistant(messages: list[dict]) -> str:
    """The content of the last assistant turn (the gold answer of a conversation)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


Say = Callable[[str], None]


# --- one file's rows read in their format ---------------------------------------------------------------------------

FORMAT_HINT = ("; or give the rows a shape surefit reads without field flags: 'messages', 'conversations', "
               "'instruction' + 'output', 'prompt' + 'completion' (see --format)")


@dataclass(frozen=True)
class ReadSettings:
    """The flags that say how rows are read: ``--format``, the text fields, ``--template``, ``--role_map``."""

    format: str = "auto"
    input_field: str = "input"
    target_field: str = "target"
    template: str | None = None
    role_map: str | None = None

    @property
    def prerendered(self) -> bool:
        """A template naming fields other than {input} fills each row's prompt while reading; one with only {input}
        is split around it when encoding."""
        return bool(self.template and template_fields(self.template) != ["input"])


def read_formatted(rows: list[Row], how: ReadSettings, source: str, problems: list[Problem],
                   rejects: list[Rejected] | None, wanted: str | None = None
                   ) -> tuple[list[Row], FormatChoice | None, list[str]]:
    """Rows of one file in the internal form of their format (detected, or ``wanted``), every row checked.

    Rows of no known shape are read as input/target rows, so that the problems name the missing field, what the rows
    have instead, and the shapes read without flags. Returns ``(rows, format, notes)``.
    """
    role_map, role_problems = parse_role_map(how.role_map)
    if wanted is None:  # once per run: the training file's read
        problems += role_problems
    choice = detect_format(rows, source, wanted or how.format, how.input_field, how.target_field, role_map,
                           needs_input=not how.prerendered)
    if isinstance(choice, Problem):
        # No known shape: the flat fields' own problems say which field is missing and what the rows have instead.
        choice = detect_format(rows, source, "input_target", how.input_field, how.target_field)
        assert not isinstance(choice, Problem)  # a named format is never refused
        found = len(problems)
        rows, _, notes = read_formatted(rows, how, source, problems, rejects, "input_target")
        problems[found:] = [replace(p, fix=p.fix + FORMAT_HINT) if p.where in ("--input_field", "--target_field")
                            else p for p in problems[found:]]
        return rows, choice, notes
    rows, notes = format_rows(rows, choice, how, source, problems, rejects)
    return rows, choice, notes


def format_rows(rows: list[Row], choice: FormatChoice, how: ReadSettings, source: str, problems: list[Problem],
                rejects: list[Rejected] | None, counted: list[CountedNote] | None = None) -> tuple[list[Row], list[str]]:
    """Rows of one file in the internal form of ``choice`` (already detected), every row checked: the second half of
    :func:`read_formatted`, which a file streamed in chunks runs chunk by chunk (``counted``: each note with its count,
    for the chunks' to be added up). Returns ``(rows, notes)``."""
    if choice.conversational:
        rows = to_conversations(rows, choice, source, problems, rejects)
        if how.template and choice.name == "alpaca":
            return apply_template(rows, how.template, choice, how.input_field, source, problems, counted)
        if how.template:
            problems.append(Problem(f"--template writes the prompt of input/target and Alpaca rows; the turns of "
                                    f"{choice.name} rows are written by the chat template", "--template",
                                    "drop --template (or --chat_format NAME|FILE.jinja to change the chat template)"))
        return rows, []
    fields = [(how.input_field, "--input_field"), (how.target_field, "--target_field")]
    if choice.name == "prompt_completion":
        fields = [("prompt", "--format"), ("completion", "--format")]
    template = how.template if how.prerendered else None
    if template:  # the template's fields are the prompt: the input field may be absent or empty
        fields = fields[1:]
        names = template_fields(template)
        choice.fields = " / ".join([*names, fields[0][0]])
        choice.mapping = f"--template fills the prompt from {', '.join(names)}; {fields[0][0]} -> trained answer"
    kept, notes = check_text_fields(rows, fields, problems, source, rejects=rejects, counted=counted)
    if choice.name == "prompt_completion":
        kept = [r.with_fields(**{how.input_field: r.fields["prompt"], how.target_field: r.fields["completion"]})
                for r in kept]
    if template:
        kept, more = apply_template(kept, template, choice, how.input_field, source, problems, counted)
        notes += more
    return kept, notes
