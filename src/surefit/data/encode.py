"""Rows -> token ids and labels. Labels are built here, once; the collator only pads.

An encoded example is ``prompt_ids + target_ids + [eos]`` with labels ``[-100] * len(prompt) + target_ids + [eos]``.
The EOS label is what teaches the model to stop; it is kept even when the tokenizer's pad token is EOS, because
padding is masked later by position (the collator pads labels with -100), never by comparing token ids.

The prompt is tokenized in three pieces (template prefix, the row's input, template suffix) so that truncation can
cut the input alone: the instruction and the response marker stay whole, and the target is never cut. A row whose
target does not fit even with an empty input is excluded and reported with its row number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from surefit.data.rows import Row

DEFAULT_TEMPLATE = (
    "Below is an input. Write the response it asks for, and nothing else.\n\n### Input:\n{input}\n\n### Response:\n"
)
# A marker no real text contains: the template (or chat template) is rendered once with it, then split around it.
_SENTINEL = "\u2063SUREFIT_INPUT\u2063"


@dataclass(frozen=True)
class PromptFormat:
    """A prompt template, pre-tokenized around the place where the row's input goes.

    Attributes:
        prefix_ids: tokens before the input (instruction, chat header, BOS if the tokenizer adds one).
        suffix_ids: tokens after the input (e.g. ``### Response:`` or the assistant header).
        prefix: the prefix as text; suffix: the suffix as text (for showing prompts to people).
        name: ``"default"``, ``"custom"`` or ``"chat"``.
    """

    prefix_ids: list[int]
    suffix_ids: list[int]
    prefix: str
    suffix: str
    name: str

    def render(self, input_text: str) -> str:
        return f"{self.prefix}{input_text}{self.suffix}"


def build_prompt_format(tokenizer: Any, template: str | None = None, chat_template: bool = False) -> PromptFormat:
    """Tokenize the template's fixed parts once.

    Args:
        tokenizer: a Hugging Face tokenizer.
        template: text with ``{input}`` once; ``None`` uses :data:`DEFAULT_TEMPLATE`.
        chat_template: use the tokenizer's chat template (a single user turn, then the assistant header).
    """
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            from surefit.errors import ConfigError, Problem

            raise ConfigError(
                Problem(
                    "--chat_template was given but this tokenizer has no chat template",
                    "--chat_template",
                    "drop --chat_template (the default template is used) or pass --template",
                )
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        name = "chat"
        specials: list[int] = []  # chat templates write their own BOS into the text
    else:
        text = (template or DEFAULT_TEMPLATE).replace("{input}", _SENTINEL)
        name = "custom" if template else "default"
        specials = _leading_special_ids(tokenizer)
    prefix, _, suffix = text.partition(_SENTINEL)
    return PromptFormat(
        prefix_ids=specials + _ids(tokenizer, prefix),
        suffix_ids=_ids(tokenizer, suffix),
        prefix=prefix,
        suffix=suffix,
        name=name,
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """The special tokens (e.g. BOS) the tokenizer puts in front of a text on its own."""
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    if plain and with_special[-len(plain) :] == plain:
        lead = with_special[: len(with_special) - len(plain)]
        return [t for t in lead if t in set(tokenizer.all_special_ids)]
    return []


@dataclass
class Example:
    """One encoded row.

    Attributes:
        input_ids: prompt + target + EOS.
        labels: -100 over the prompt, then the target ids and EOS.
        prompt_len: number of prompt tokens (generation feeds ``input_ids[:prompt_len]``).
        row: the source row (for predictions files and messages).
    """

    input_ids: list[int]
    labels: list[int]
    prompt_len: int
    row: Row

    @property
    def prompt_ids(self) -> list[int]:
        return self.input_ids[: self.prompt_len]

    @property
    def num_supervised(self) -> int:
        """Tokens that carry loss (target + EOS; every trained assistant span of a conversation)."""
        return sum(1 for t in self.labels if t != -100)

    def features(self) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids, "labels": self.labels}


@dataclass
class EncodeReport:
    """What encoding did to a split: counted so nothing is silent."""

    split: str
    rows: int = 0
    encoded: int = 0
    truncated: int = 0
    tokens_cut: int = 0
    answer_cut: int = 0  # truncated rows whose target text appeared in the input but no longer does
    excluded: list[tuple[str, str]] = field(default_factory=list)  # (where, reason)
    tokens: int = 0
    supervised_tokens: int = 0
    longest_target: int = 0  # tokens, including EOS

    def summary(self) -> str:
        parts = [f"{self.split}: {self.encoded}/{self.rows} rows encoded"]
        if self.truncated:
            parts.append(f"{self.truncated} prompts truncated ({self.tokens_cut} input tokens cut)")
        if self.answer_cut:
            parts.append(f"{self.answer_cut} of them lost the part of the input that contained the answer")
        if self.excluded:
            parts.append(f"{len(self.excluded)} rows excluded (target does not fit)")
        if self.tokens:
            parts.append(
                f"{self.tokens} tokens, {self.supervised_tokens} supervised "
                f"({100.0 * self.supervised_tokens / self.tokens:.1f}%)"
            )
        return "; ".join(parts)


def encode_rows(
    rows: list[Row],
    tokenizer: Any,
    fmt: PromptFormat,
    *,
    max_seq_length: int,
    input_field: str = "input",
    target_field: str = "target",
    truncation_side: Literal["left", "right"] = "left",
    split: str = "train",
) -> tuple[list[Example], EncodeReport]:
    """Encode rows into examples with labels; truncate prompts (never targets) to ``max_seq_length``.

    Returns:
        The examples, in row order, and a report counting truncations and exclusions (with row locations).
    """
    report = EncodeReport(split=split, rows=len(rows))
    if not rows:
        return [], report
    eos = tokenizer.eos_token_id
    inputs = [str(r.fields[input_field]) for r in rows]
    targets = [str(r.fields[target_field]) for r in rows]
    # One batched call per column: the fast tokenizers parallelise it; per-row calls are much slower.
    input_ids = tokenizer(inputs, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(targets, add_special_tokens=False)["input_ids"]
    fixed = len(fmt.prefix_ids) + len(fmt.suffix_ids)
    examples: list[Example] = []
    for row, text, target, inp, tgt in zip(rows, inputs, targets, input_ids, target_ids, strict=True):
        tgt = list(tgt) + [eos]
        budget = max_seq_length - fixed - len(tgt)
        if budget < 0:
            report.excluded.append(
                (
                    row.where,
                    f"the target alone needs {len(tgt)} tokens (with EOS) and the template {fixed}; "
                    f"--max_seq_length is {max_seq_length}",
                )
            )
            continue
        inp = list(inp)
        if len(inp) > budget:
            report.truncated += 1
            report.tokens_cut += len(inp) - budget
            inp = _cut(inp, budget, truncation_side)
            if target.strip() and target in text and target not in tokenizer.decode(inp):
                report.answer_cut += 1
        prompt = fmt.prefix_ids + inp + fmt.suffix_ids
        examples.append(Example(input_ids=prompt + tgt, labels=[-100] * len(prompt) + tgt, prompt_len=len(prompt), row=row))
        report.tokens += len(prompt) + len(tgt)
        report.supervised_tokens += len(tgt)
        report.longest_target = max(report.longest_target, len(tgt))
    report.encoded = len(examples)
    return examples, report


def _cut(ids: list[int], budget: int, side: Literal["left", "right"]) -> list[int]:
    """Keep ``budget`` ids, cutting from ``side`` ('left' keeps the end, e.g. a question at the end of the input)."""
    if budget <= 0:
        return []
    return ids[len(ids) - budget :] if side == "left" else ids[:budget]


def encode_prompts(
    texts: list[str],
    tokenizer: Any,
    fmt: PromptFormat,
    *,
    max_prompt_length: int,
    truncation_side: Literal["left", "right"] = "left",
) -> tuple[list[list[int]], list[int]]:
    """Prompts for generation (no target): the template around each input, the input cut as :func:`encode_rows`
    cuts it so that the prompt has at most ``max_prompt_length`` tokens (the template is never cut).

    Returns:
        ``(prompt_ids, tokens_cut)``: per text, the prompt ids and how many input tokens were cut (0: none).
    """
    if not texts:
        return [], []
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    budget = max(max_prompt_length - len(fmt.prefix_ids) - len(fmt.suffix_ids), 0)
    prompts, cut = [], []
    for inp in ids:
        inp = list(inp)
        kept = _cut(inp, budget, truncation_side) if len(inp) > budget else inp
        cut.append(len(inp) - len(kept))
        prompts.append(fmt.prefix_ids + kept + fmt.suffix_ids)
    return prompts, cut


# ------------------------------------------------------------------------------------------------------------ conversations

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
    """

    source: str
    name: str
    takes_tools: bool
    takes_tool_calls: bool


def chat_format(source: str, name: str) -> ChatFormat:
    return ChatFormat(source, name, "tools" in source, "tool_calls" in source)


def resolve_chat_template(tokenizer: Any, chat_template: bool | None, template_name: str | None) -> tuple[ChatFormat | None, str]:
    """Which chat template renders conversations, and why, in words.

    ``template_name`` (a built-in name or a ``.jinja`` file) wins; then the model's own template unless
    ``chat_template`` is ``False``; ``None``: no chat template (flat rows use the plain prompt template).
    The chosen template is set on the tokenizer so that it is saved with it and inference formats prompts the same.
    """
    from surefit.errors import ConfigError, Problem

    if template_name:
        if template_name in BUILTIN_CHAT_TEMPLATES:
            fmt = chat_format(BUILTIN_CHAT_TEMPLATES[template_name], template_name)
            why = f"chat template: built-in {template_name!r} (--chat_format)"
        else:
            from pathlib import Path

            path = Path(template_name)
            if not path.is_file():
                raise ConfigError(Problem(f"{template_name!r} is neither a built-in chat template nor a file",
                                          "--chat_format", f"use one of {', '.join(BUILTIN_CHAT_TEMPLATES)} or a "
                                          "path to a Jinja file"))
            fmt = chat_format(path.read_text(encoding="utf-8"), str(path))
            why = f"chat template: {path} (--chat_format)"
        tokenizer.chat_template = fmt.source
        return fmt, why
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one renders conversations
        own = own.get("default")
    if chat_template is False:
        return None, "prompt template: plain (--chat_template false)"
    if own:
        why = "chat template: the model's own" + (" (the default for a model that ships one; --chat_template false "
                                                  "uses the plain template)" if chat_template is None else "")
        return chat_format(own, "the model's own"), why
    return None, "prompt template: plain (the model ships no chat template; --chat_format chatml|llama3|gemma|FILE" \
                 ".jinja sets one)"


class TemplateProblem(Exception):
    """A chat template that cannot label a row by position (caught and reported with the row)."""


def render_chat(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None,
                add_generation_prompt: bool) -> str:
    """The template's text for ``messages`` (internal form, see :mod:`surefit.data.formats`)."""
    import json

    msgs = []
    for m in messages:
        msg = {k: v for k, v in m.items() if k != "train"}
        if msg.get("tool_calls") and not fmt.takes_tool_calls:
            calls = [c.get("function", c) for c in msg.pop("tool_calls")]
            if not msg["content"].strip():
                msg["content"] = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
        elif msg.get("tool_calls") and fmt.takes_tool_calls:
            # The content holds the call's JSON too (ShareGPT function_call): the template writes the call itself.
            if m["content"].strip().startswith(("{", "[")):
                msg["content"] = ""
        msgs.append(msg)
    kwargs: dict[str, Any] = {}
    if tools and fmt.takes_tools:
        kwargs["tools"] = tools
    elif tools:
        note = TOOLS_NOTE + json.dumps(tools, ensure_ascii=False)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=fmt.source, **kwargs)
    except Exception as e:  # a Jinja error raised by the template itself (e.g. "roles must alternate")
        raise TemplateProblem(f"chat template ({fmt.name}) failed to render: {e}") from e


@dataclass
class ChatEncodeSettings:
    """How conversations are encoded: what is trained and what long conversations lose."""

    max_seq_length: int
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    truncation: Literal["drop_oldest", "exclude"] = "drop_oldest"


def _trained_turns(messages: list[dict], train_on: str) -> list[int]:
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True)]
    return turns[-1:] if train_on == "last_assistant" else turns


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {i for i, t in added.items() if getattr(t, "special", False)}
    return ids


def label_conversation(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None,
                       train_on: str) -> tuple[list[int], list[int], int, set[int], str]:
    """Token ids and labels of one conversation, labels by position.

    Each trained assistant turn's span is the text between the render of the turns before it (with the generation
    prompt) and the render of the turns up to it: the assistant's content plus what the template writes after it.
    Its tokens up to the terminator are trained; whitespace after the terminator is not.
    Each piece of text between span boundaries is tokenized on its own, so the spans are exact token spans.

    Returns:
        ``(input_ids, labels, prompt_len, terminator_ids, text)``: ``prompt_len`` is where the last trained turn
        begins (generation feeds the ids before it); ``terminator_ids`` are the special ids the template writes
        after an assistant turn (generation stops on them).

    Raises:
        TemplateProblem: the template's render of a prefix is not a prefix of the full render, a span does not
            decode to its own text, or the span is not the assistant's content plus a terminator.
    """
    full = render_chat(tokenizer, fmt, messages, tools, add_generation_prompt=False)
    spans: list[tuple[int, int, int]] = []
    for k in _trained_turns(messages, train_on):
        before = render_chat(tokenizer, fmt, messages[:k], tools, add_generation_prompt=True)
        upto = render_chat(tokenizer, fmt, messages[: k + 1], tools, add_generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise TemplateProblem(
                f"chat template ({fmt.name}): the render of the conversation up to turn {k + 1} is not a prefix of "
                "the full render, so the assistant turn cannot be labelled by position")
        spans.append((len(before), len(upto), k))
    if not spans:
        raise TemplateProblem("no assistant turn to train")
    specials = _special_ids(tokenizer)
    ids: list[int] = []
    labels: list[int] = []
    terminators: set[int] = set()
    pos = 0
    prompt_len = 0
    for start, end, k in spans:
        if start > pos:
            piece = _ids(tokenizer, full[pos:start])
            ids += piece
            labels += [-100] * len(piece)
        prompt_len = len(ids)
        text = full[start:end]
        piece = _ids(tokenizer, text)
        if tokenizer.decode(piece, skip_special_tokens=False) != text:
            raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the assistant span's tokens do not "
                                  f"decode to its text {text[:60]!r}")
        _check_span(text, messages[k], piece, specials, fmt, k, tokenizer)
        terminators |= {t for t in piece if t in specials}
        # Whitespace the template writes after the terminator (ChatML's "\n") stays in the input but is not trained:
        # generation stops at the terminator. After the last turn it is left out, so the sequence ends on it.
        last = max(i for i, t in enumerate(piece) if t in specials) + 1
        tail = piece[last:]
        at_end = end == spans[-1][1] and not full[end:].strip()
        ids += piece[:last] if at_end else piece
        labels += piece[:last] + ([] if at_end else [-100] * len(tail))
        pos = len(full) if at_end else end
    if pos < len(full):
        piece = _ids(tokenizer, full[pos:])
        ids += piece
        labels += [-100] * len(piece)
    return ids, labels, prompt_len, terminators, full


def _check_span(text: str, message: dict, piece: list[int], specials: set[int], fmt: ChatFormat, k: int,
                tokenizer: Any) -> None:
    """A trained span is the assistant's content (or its tool call), then only what the template writes after every
    assistant turn: whitespace and at least one special token (the terminator the model must learn to stop on)."""
    content = message["content"].strip()
    body = text.lstrip()
    if content and body.startswith(content):
        after = body[len(content):]
    elif message.get("tool_calls"):
        names = [c.get("function", c).get("name", "") for c in message["tool_calls"]]
        if not all(n in text for n in names):
            raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the tool call "
                                  f"{', '.join(names)} is not in the trained span {text[:80]!r}")
        return
    else:
        raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the trained span {text[:80]!r} does not "
                              "start with the assistant's content (the template changes it)")
    if not any(t in specials for t in piece):
        raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: writes no end-of-turn token after the "
                              f"assistant's answer (after it: {after!r}), so the model would never learn to stop")
    rest = after
    for t in sorted({tokenizer.convert_ids_to_tokens(i) for i in piece if i in specials}, key=len, reverse=True):
        rest = rest.replace(t, "")
    if rest.strip():
        raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: writes text other than its end-of-turn "
                              f"token after the assistant's answer ({after!r}), which would be trained")


def _drop_oldest(messages: list[dict]) -> list[dict] | None:
    """The conversation without its oldest exchange (the system turn stays); ``None`` when nothing can go."""
    start = 1 if messages and messages[0]["role"] == "system" else 0
    for j in range(start + 1, len(messages)):
        if messages[j]["role"] == "user" and any(m["role"] == "assistant" for m in messages[start:j]):
            return messages[:start] + messages[j:]
    return None


@dataclass
class ChatReport(EncodeReport):
    """Encoding counts for conversations: turns dropped to fit, per-role turns and tokens."""

    turns_dropped: int = 0
    rows_shortened: list[tuple[str, int]] = field(default_factory=list)  # (where, turns dropped)
    roles: dict[str, int] = field(default_factory=dict)  # turns per role
    tools_rows: int = 0  # rows that give tool schemas
    tool_call_turns: int = 0  # assistant turns that call a tool
    tools_how: str = ""  # how the template got them, in words

    def summary(self) -> str:
        base = super().summary()
        if self.tools_rows:
            base += f"; {self.tools_rows} rows give tools ({self.tools_how})"
        if self.rows_shortened:
            base += (f"; {len(self.rows_shortened)} conversations shortened to fit --max_seq_length (oldest "
                     f"{self.turns_dropped} turns dropped, system kept)")
        return base


def encode_conversations(rows: list[Row], tokenizer: Any, fmt: ChatFormat, settings: ChatEncodeSettings,
                         split: str = "train") -> tuple[list[Example], ChatReport, list[tuple[str, str]], set[int]]:
    """Encode conversation rows (``messages`` / ``tools`` fields); labels by position on the template's render.

    Long conversations lose their oldest exchanges first (``drop_oldest``; the system turn stays) or are excluded
    (``exclude``); an assistant turn is never cut. Both are counted in the report.

    Returns:
        ``(examples, report, template_problems, terminator_ids)``: ``template_problems`` are ``(where, text)`` of
        rows the template cannot label (the caller reports them; nothing trains on a mislabelled row).
    """
    report = ChatReport(split=split, rows=len(rows))
    examples: list[Example] = []
    failures: list[tuple[str, str]] = []
    terminators: set[int] = set()
    for row in rows:
        messages: list[dict] = row.fields["messages"]
        tools = row.fields.get("tools")
        dropped = 0
        excluded = False
        try:
            while True:
                ids, labels, prompt_len, term, _ = label_conversation(tokenizer, fmt, messages, tools,
                                                                     settings.train_on)
                if len(ids) <= settings.max_seq_length:
                    break
                shorter = _drop_oldest(messages) if settings.truncation == "drop_oldest" else None
                if shorter is None or not _trained_turns(shorter, settings.train_on):
                    how = ("even with only its last exchange" if settings.truncation == "drop_oldest"
                           else "(--truncation exclude)")
                    report.excluded.append((row.where, f"{len(ids)} tokens {how}; --max_seq_length is "
                                                       f"{settings.max_seq_length}"))
                    excluded = True
                    break
                dropped += len(messages) - len(shorter)
                messages = shorter
        except TemplateProblem as e:
            failures.append((row.where, str(e)))
            continue
        if excluded:
            continue
        if dropped:
            report.turns_dropped += dropped
            report.rows_shortened.append((row.where, dropped))
        for m in messages:
            report.roles[m["role"]] = report.roles.get(m["role"], 0) + 1
            report.tool_call_turns += bool(m.get("tool_calls"))
        if tools:
            report.tools_rows += 1
            report.tools_how = ("passed to the chat template" if fmt.takes_tools else "the chat template takes no "
                                "tools: written into the system turn as JSON")
        terminators |= term
        ex = Example(input_ids=ids, labels=labels, prompt_len=prompt_len, row=row)
        examples.append(ex)
        report.tokens += len(ids)
        report.supervised_tokens += ex.num_supervised
        report.longest_target = max(report.longest_target, len(ids) - prompt_len)
    report.encoded = len(examples)
    return examples, report, failures, terminators


def chat_prompt(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None) -> list[int]:
    """Generation prompt ids: the conversation so far, then the assistant header."""
    return _ids(tokenizer, render_chat(tokenizer, fmt, messages, tools, add_generation_prompt=True))
