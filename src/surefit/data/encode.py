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

from surefit.data.chat_render import (  # noqa: F401 - re-exported: templates, probes, the sandboxed render
    BUILTIN_CHAT_TEMPLATES,
    ChatFormat,
    TemplateLimit,
    TemplateProblem,
    TemplateTraits,
    answer_end,
    answer_start,
    chat_format,
    differ,
    prefilled_turn,
    render_chat,
    row_variables,
    special_texts,
    split_reasoning,
    template_special_ids,
    template_traits,
    thinking_line,
)
from surefit.data.rows import Row

DEFAULT_TEMPLATE = (
    "Below is an input. Write the response it asks for, and nothing else.\n\n### Input:\n{input}\n\n### Response:\n"
)
# A marker no real text contains: the template (or chat template) is rendered once with it, then split around it.
_SENTINEL = "\u2063SUREFIT_INPUT\u2063"
# One int object per token id for every row: a tokenizer makes a 32-byte object per id above 256 (most of a row).
_INTS: dict[int, int] = {}


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


def build_prompt_format(tokenizer: Any, template: str | None = None, chat_template: bool = False,
                        system: str | None = None) -> PromptFormat:
    """Tokenize the template's fixed parts once.

    Args:
        tokenizer: a Hugging Face tokenizer.
        template: text with ``{input}`` once; ``None`` uses :data:`DEFAULT_TEMPLATE`.
        chat_template: use the tokenizer's chat template (a single user turn, then the assistant header).
        system: a system turn before the user turn (``--system_prompt``); ``None``: none given.
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
        turns = [{"role": "system", "content": system}] if system is not None else []
        text = tokenizer.apply_chat_template(
            [*turns, {"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        name = "chat"
        specials: list[int] = []  # chat templates write their own BOS into the text
    else:
        text = (template or DEFAULT_TEMPLATE).replace("{input}", _SENTINEL)
        name = "custom" if template else "default"
        specials = leading_special_ids(tokenizer)
    prefix, _, suffix = text.partition(_SENTINEL)
    return PromptFormat(
        prefix_ids=specials + _ids(tokenizer, prefix),
        suffix_ids=_ids(tokenizer, suffix),
        prefix=prefix,
        suffix=suffix,
        name=name,
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None) if _plain_call(type(tokenizer)) else None
    # The Rust tokenizer directly where that is what the call computes (no truncation or padding set on it, special
    # tokens split as the tokenizer says): the call's Python wrapping cost more than the tokenization itself (a
    # fifth of encoding a short conversation, benchmarks/results/encoded_store.md).
    if backend is not None and backend.truncation is None and backend.padding is None and \
            backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_PLAIN: dict[type, bool] = {}


def _plain_call(cls: type) -> bool:
    """Whether ``cls(text)`` is the transformers fast tokenizers' own call (no subclass changes what it encodes)."""
    if cls not in _PLAIN:
        try:
            from transformers import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: the call, always
            _PLAIN[cls] = False
        else:
            _PLAIN[cls] = issubclass(cls, TokenizersBackend) and cls.__call__ is PreTrainedTokenizerBase.__call__ \
                and cls._encode_plus is TokenizersBackend._encode_plus
    return _PLAIN[cls]


def leading_special_ids(tokenizer: Any) -> list[int]:
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

    def __post_init__(self) -> None:  # the ids as shared objects (_INTS): 8 bytes a token instead of 40
        share = _INTS.setdefault
        self.input_ids, self.labels = [share(t, t) for t in self.input_ids], [share(t, t) for t in self.labels]

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
    # the prompt template's own tokens (around the input), 0 where not one fixed template; alike in every chunk
    template_tokens: int = field(default=0, metadata={"merge": "max"})
    template_name: str = ""  # PromptFormat.name of that template
    longest_whole: int = 0  # tokens the longest row needs kept whole (template + input + target + EOS)

    def nothing_fits(self, max_seq_length: int, unit: str = "targets", shorter: str = "") -> tuple[str, str]:
        """(what happened, the fix) when every row of the split was excluded as too long: the template's share
        named where it is what left no room, and a length that keeps every row whole (a fix that cuts no input).
        ``shorter``: the settings that make this run's template shorter, in words (empty: none)."""
        if not self.template_tokens:
            return (f"no {self.split} rows left after encoding: all {self.rows} {unit} are longer than "
                    f"--max_seq_length allows", f"raise --max_seq_length (now {max_seq_length}) or shorten the rows")
        fixed, cap = self.template_tokens, max_seq_length
        share = (f"the prompt template alone is {fixed} tokens" if fixed >= cap else
                 f"the prompt template takes {fixed} of them and every row's target with its EOS needs more than "
                 f"the other {cap - fixed}, even with its input cut to nothing")
        return (f"no {self.split} rows left after encoding: none of its {self.rows} rows fits --max_seq_length {cap}: "
                + share, f"--max_seq_length {self.longest_whole} keeps every row whole, input included"
                + (f"; {shorter}" if shorter else ""))

    def summary(self) -> str:
        parts = [f"{self.split}: {self.encoded}/{self.rows} rows encoded"]
        if self.truncated:
            parts.append(f"{self.truncated} prompts truncated ({self.tokens_cut} input tokens cut)")
        if self.answer_cut:
            parts.append(f"{self.answer_cut} of them lost the part of the input that contained the answer")
        if self.excluded:
            parts.append(f"{len(self.excluded)} rows excluded (too long for --max_seq_length"
                         + (" even with the input cut)" if self.template_tokens else ")"))
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
    report.template_tokens, report.template_name = fixed, fmt.name
    examples: list[Example] = []
    for row, text, target, inp, tgt in zip(rows, inputs, targets, input_ids, target_ids, strict=True):
        tgt = list(tgt) + [eos]
        report.longest_whole = max(report.longest_whole, fixed + len(inp) + len(tgt))
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
        elif "{%" in template_name or "{{" in template_name:  # the Jinja text itself (Axolotl's chat_template_jinja)
            fmt = chat_format(template_name, "the given Jinja text")
            why = "chat template: the Jinja text given (--chat_format)"
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


@dataclass
class ChatEncodeSettings:
    """How conversations are encoded: what is trained, what long conversations lose, the thinking choice and what
    happens to a system turn the template rejects."""

    max_seq_length: int
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    truncation: Literal["drop_oldest", "exclude"] = "drop_oldest"
    thinking: Literal["train_empty", "switch_off"] = "train_empty"
    system_turn: Literal["fold", "refuse"] = "fold"


def _trained_turns(messages: list[dict], train_on: str) -> list[int]:
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True)]
    return turns[-1:] if train_on == "last_assistant" else turns


@dataclass
class Labelled:
    """One encoded example of a conversation.

    ``prompt_len``: where the last trained turn begins; ``terminators``: the ids that end the trained turns (stop
    ids); ``scaffolds``: per trained turn without reasoning, what the template writes before the answer.
    """

    input_ids: list[int]
    labels: list[int]
    prompt_len: int
    terminators: set[int]
    text: str
    scaffolds: list[str] = field(default_factory=list)
    turn: int = -1  # the last trained turn (its answer is the example's gold)


def label_conversation(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None,
                       settings: ChatEncodeSettings | str = "all_assistant", full: str | None = None) -> list[Labelled]:
    """Token ids and labels of one conversation, labels by position.

    For each trained assistant turn, the prompt generation would build (the turns before it with the generation
    prompt, the thinking switch as the run sets it) must be a prefix of the render up to and including the turn:
    the text between the two is what the model must write, trained whole: template scaffolding (a think block, a
    channel header), reasoning, the answer, and the token that ends the turn. Whitespace after that token is not
    trained. Where each such render is also a prefix of the full render, the conversation is one example; where the
    template rewrites earlier turns (Qwen3 drops their reasoning), each trained turn is its own example, the
    conversation up to it, as the model sees it at inference.

    Raises:
        TemplateProblem: the generation prompt is not the start of the training render (names the turn and the first
            differing characters), the template drops the turn's content or reasoning, or nothing ends the turn.
    """
    if isinstance(settings, str):
        settings = ChatEncodeSettings(max_seq_length=1 << 62, train_on=settings)  # type: ignore[arg-type]
    traits = template_traits(tokenizer, fmt)
    variables = row_variables(tokenizer, fmt, messages, settings.thinking)

    def r(msgs: list[dict], gen: bool) -> str:
        return render_chat(tokenizer, fmt, msgs, tools, gen, variables, settings.system_turn)

    turns = _trained_turns(messages, settings.train_on)
    if not turns:
        raise TemplateProblem("no assistant turn to train")
    closing = traits.closing

    def body(text: str) -> str:
        return text[: len(text) - len(closing)] if closing and text.endswith(closing) else text

    full = r(messages, False) if full is None else full  # the caller's render of the same conversation, if any
    renders = []
    stable = True
    for k in turns:
        # The last turn's render up to it is the full render (rendered once: a quarter of a short row's encoding)
        before, upto = r(messages[:k], True), full if k + 1 == len(messages) else r(messages[: k + 1], False)
        if not upto.startswith(before) and traits.prefill:
            # The generation prompt prefills what the template's render of the turn never writes (DeepSeek-R1's
            # "<think>\n"): the turn is written after that prompt, its reasoning (or an empty block) then the answer.
            plain = r([*messages[:k], {key: v for key, v in messages[k].items() if key != "reasoning"}], False)
            upto = prefilled_turn(before, plain, messages[k].get("reasoning") or "", traits) or upto
        if not upto.startswith(before):
            hint = ("; this turn has reasoning, and the template's generation prompt does not let the model write it "
                    "(thinking off): train such rows with the model's thinking template, or without their reasoning"
                    if messages[k].get("reasoning") else "")
            raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the prompt generation builds is not "
                                  f"the start of the training render, so training would not match inference; they "
                                  f"part {differ(before, upto)}{hint}")
        stable = stable and body(full).startswith(body(upto))
        renders.append((k, before, upto))
    if stable:
        spans = [(k, len(before), len(body(upto))) for k, before, upto in renders]
        return [_tokenize(tokenizer, fmt, traits, messages, full, spans, renders[-1][1])]
    return [_tokenize(tokenizer, fmt, traits, messages, upto, [(k, len(before), len(body(upto)))], before)
            for k, before, upto in renders]


def _tokenize(tokenizer: Any, fmt: ChatFormat, traits: TemplateTraits, messages: list[dict],
              text: str, spans: list[tuple[int, int, int]], last_prompt: str) -> Labelled:
    """Ids and labels of ``text`` with the character ``spans`` ``(turn, start, end)`` trained up to the token that
    ends each turn. Each piece between span boundaries is tokenized on its own, so the spans are exact token spans;
    the last span's prompt is checked against the prompt generation tokenizes whole."""
    specials = template_special_ids(tokenizer)
    ids: list[int] = []
    labels: list[int] = []
    terminators: set[int] = set()
    scaffolds: list[str] = []
    pos = 0
    prompt_len = 0
    for n, (k, start, end) in enumerate(spans):
        if start > pos:
            piece = _ids(tokenizer, text[pos:start])
            ids += piece
            labels += [-100] * len(piece)
        prompt_len = len(ids)
        span = text[start:end]
        cut = answer_end(span, messages[k], fmt, k)
        scaffolds.append("" if messages[k].get("reasoning") else span[: answer_start(span, messages[k])])
        head, tail = _ids(tokenizer, span[:cut]), _ids(tokenizer, span[cut:])
        if tokenizer.decode(head + tail, skip_special_tokens=False) != span:
            raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: the assistant span's tokens do not "
                                  f"decode to its text {span[:60]!r}")
        ends = [i for i, t in enumerate(tail) if t in specials]
        if ends:
            last = ends[-1] + 1
            terminators.add(tail[ends[-1]])
            ids += head + tail
            labels += head + tail[:last] + [-100] * (len(tail) - last)
            pos = end
            continue
        # No end-of-turn token in the span: the token the template writes next ends the turn (the next role's header
        # or EOS); it is trained and becomes a stop id.
        ids += head + tail
        labels += head + tail
        after = text[end:]
        if n == len(spans) - 1 and not after.strip():
            # The last turn: what would come next ends it (a closing EOS, else the next turn's header).
            after = traits.closing if traits.closing.strip() else traits.next_turn
            text = text[:end] + after
        nxt = _ids(tokenizer, after.lstrip())[:1]
        if not nxt or nxt[0] not in specials:
            raise TemplateProblem(f"chat template ({fmt.name}), turn {k + 1}: writes no end-of-turn token after the "
                                  f"assistant's answer (after it: {span[cut:]!r}, then {after[:30]!r}), so the model "
                                  "would never learn to stop")
        ws = _ids(tokenizer, after[: len(after) - len(after.lstrip())])
        ids += ws + nxt
        labels += [-100] * len(ws) + nxt
        terminators.add(nxt[0])
        pos = end + len(after) - len(after.lstrip()) + len(tokenizer.decode(nxt, skip_special_tokens=False))
    rest = text[pos:]
    closing = traits.closing.strip()
    if rest.strip() and rest.strip() == closing and all(t in specials for t in _ids(tokenizer, closing)):
        # A closing EOS after the last turn (Phi-3): trained there only, so the sequence ends as the template ends it
        ws, tail = _ids(tokenizer, rest[: rest.index(closing)]), _ids(tokenizer, closing)
        ids += ws + tail
        labels += [-100] * len(ws) + tail
    elif rest.strip():
        piece = _ids(tokenizer, rest)
        ids += piece
        labels += [-100] * len(piece)
    # Whitespace after the last terminator (ChatML's "\n") is left out: the sequence ends on the terminator.
    while ids and labels[-1] == -100 and not tokenizer.decode(ids[-1:], skip_special_tokens=False).strip():
        ids.pop()
        labels.pop()
    # Training = inference, in tokens: the prompt of the last trained turn is what generation tokenizes.
    whole = _ids(tokenizer, last_prompt)
    if whole != ids[:prompt_len]:
        i = next((j for j, (a, b) in enumerate(zip(whole, ids[:prompt_len], strict=False)) if a != b), min(len(whole), prompt_len))
        raise TemplateProblem(f"chat template ({fmt.name}), turn {spans[-1][0] + 1}: the generation prompt "
                              f"tokenizes differently from the training example at token {i} "
                              f"({tokenizer.decode(whole[i:i + 3])!r} vs {tokenizer.decode(ids[i:i + 3])!r})")
    return Labelled(ids, labels, prompt_len, terminators, text, scaffolds, spans[-1][0])


def _drop_candidates(messages: list[dict]) -> list[list[dict]]:
    """The conversation without its 1, 2, ... oldest exchanges (the system turn stays)."""
    start = 1 if messages and messages[0]["role"] == "system" else 0
    first = next((j for j in range(start, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
    cuts = [j for j in range(first + 1, len(messages)) if messages[j]["role"] == "user"]
    return [messages[:start] + messages[j:] for j in cuts]


@dataclass
class ChatReport(EncodeReport):
    """Encoding counts for conversations: turns dropped to fit, per-role turns and tokens, examples per
    conversation, the thinking choice and system turns folded."""

    turns_dropped: int = 0
    rows_shortened: list[tuple[str, int]] = field(default_factory=list)  # (where, turns dropped)
    roles: dict[str, int] = field(default_factory=dict)  # turns per role
    tools_rows: int = 0  # rows that give tool schemas
    tool_call_turns: int = 0  # assistant turns that call a tool
    tools_how: str = ""  # how the template got them, in words
    examples: int = 0  # encoded examples (more than rows where the template rewrites earlier turns)
    split_rows: int = 0  # conversations that became one example per trained turn
    reasoning_turns: int = 0  # assistant turns with reasoning
    reasoning_inline: int = 0  # ... written inline as <think>...</think> (the template reads no reasoning field)
    scaffold: dict[str, int] = field(default_factory=dict)  # what the template writes before an answer -> turns
    thinking: str = "train_empty"
    thinking_rows: int = 0  # rows rendered with the thinking switch off (--thinking switch_off)
    system_folded: int = 0  # system turns written into the first user turn

    def summary(self) -> str:
        base = super().summary()
        if self.split_rows:
            base += (f"; {self.split_rows} conversations became {self.split_examples} examples: the template rewrites "
                     "earlier turns (e.g. drops their reasoning), so each trained turn is its own example, rendered "
                     "as at inference")
        if self.reasoning_turns:
            base += f"; {self.reasoning_turns} assistant turns with reasoning (trained with the answer)"
            if self.reasoning_inline:
                base += (f", {self.reasoning_inline} of them written into the answer as <think>...</think> (the "
                         "template reads no reasoning field)")
        if self.system_folded:
            base += (f"; {self.system_folded} system turns written at the start of the first user turn (the template "
                     "rejects the system role; --system_turn refuse keeps its error)")
        if self.tools_rows:
            base += f"; {self.tools_rows} rows give tools ({self.tools_how})"
        if self.rows_shortened:
            base += (f"; {len(self.rows_shortened)} conversations shortened to fit --max_seq_length (oldest "
                     f"{self.turns_dropped} turns dropped, system kept)")
        return base

    split_examples: int = 0

    def thinking_line(self) -> str | None:
        """The thinking choice, where it applied (see :func:`surefit.data.chat_render.thinking_line`)."""
        return thinking_line(self.thinking, self.thinking_rows, self.scaffold)


def encode_conversations(rows: list[Row], tokenizer: Any, fmt: ChatFormat, settings: ChatEncodeSettings,
                         split: str = "train") -> tuple[list[Example], ChatReport, list[tuple[str, str]], set[int]]:
    """Encode conversation rows (``messages`` / ``tools`` fields); labels by position on the template's render.

    Long conversations lose their oldest exchanges first (``drop_oldest``; the system turn stays) or are excluded
    (``exclude``); an assistant turn is never cut. Both are counted in the report. The fit is found with one render
    per step of a binary search, so a long conversation costs about one labelling of what is kept.

    Returns:
        ``(examples, report, template_problems, terminator_ids)``: ``template_problems`` are ``(where, text)`` of
        rows the template cannot label (the caller reports them; nothing trains on a mislabelled row).

    Raises:
        ConfigError: the template ran past the render limits (it would do so on any row).
    """
    from surefit.errors import ConfigError, Problem

    report = ChatReport(split=split, rows=len(rows), thinking=settings.thinking)
    examples: list[Example] = []
    failures: list[tuple[str, str]] = []
    terminators: set[int] = set()
    traits = None
    for row in rows:
        tools = row.fields.get("tools")
        try:
            traits = traits or template_traits(tokenizer, fmt)
            messages, labelled, dropped, why = _fit(tokenizer, fmt, row.fields["messages"], tools, settings)
        except TemplateLimit as e:
            raise ConfigError(Problem(str(e), f"{row.where}", "use a chat template that renders in bounded time "
                                      "and size (--chat_format chatml|llama3|gemma|FILE.jinja)")) from None
        except TemplateProblem as e:
            failures.append((row.where, str(e)))
            continue
        if messages is None:
            report.excluded.append((row.where, why))
            continue
        if dropped:
            report.turns_dropped += dropped
            report.rows_shortened.append((row.where, dropped))
        for m in messages:
            report.roles[m["role"]] = report.roles.get(m["role"], 0) + 1
            report.tool_call_turns += bool(m.get("tool_calls"))
            if m["role"] == "assistant" and m.get("reasoning"):
                report.reasoning_turns += 1
                report.reasoning_inline += not fmt.reasoning_fields
        if tools:
            report.tools_rows += 1
            report.tools_how = ("passed to the chat template" if fmt.takes_tools else "the chat template takes no "
                                "tools: written into the system turn as JSON")
        if messages[0]["role"] == "system" and traits.rejects_system and settings.system_turn == "fold":
            report.system_folded += 1
        if "enable_thinking" in row_variables(tokenizer, fmt, messages, settings.thinking):
            report.thinking_rows += 1
        if len(labelled) > 1:
            report.split_rows += 1
            report.split_examples += len(labelled)
        for lab in labelled:
            for s in lab.scaffolds:
                if s.strip():
                    report.scaffold[s] = report.scaffold.get(s, 0) + 1
            terminators |= lab.terminators
            # An example of one turn answers that turn: its row holds the conversation up to it (gold, input)
            one = row if len(labelled) == 1 else row.with_fields(messages=messages[: lab.turn + 1])
            ex = Example(input_ids=lab.input_ids, labels=lab.labels, prompt_len=lab.prompt_len, row=one)
            examples.append(ex)
            report.tokens += len(ex.input_ids)
            report.supervised_tokens += ex.num_supervised
            report.longest_target = max(report.longest_target, len(ex.input_ids) - ex.prompt_len)
        report.encoded += 1
    report.examples = len(examples)
    return examples, report, failures, terminators


def _fit(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None,
         settings: ChatEncodeSettings) -> tuple[list[dict] | None, list[Labelled], int, str]:
    """The conversation (oldest exchanges dropped to fit, or ``None``: excluded), its examples, the turns dropped
    and, when excluded, why. The length is measured on the full render; the search over how many exchanges to drop
    is a binary search, and only the kept conversation is labelled."""
    limit = settings.max_seq_length
    variables = row_variables(tokenizer, fmt, messages, settings.thinking)

    def render(msgs: list[dict]) -> str:
        return render_chat(tokenizer, fmt, msgs, tools, False, variables, settings.system_turn)

    whole = render(messages)  # measured here and labelled below when it fits: rendered once

    def length(msgs: list[dict]) -> int:
        return len(_ids(tokenizer, whole if msgs is messages else render(msgs)))

    cands = _drop_candidates(messages) if settings.truncation == "drop_oldest" else []
    cands = [c for c in cands if _trained_turns(c, settings.train_on)]
    first = 0  # candidates before it are known not to fit
    kept = messages
    if length(messages) > limit:
        lo, hi = 0, len(cands)  # smallest i with cands[i] fitting; len(cands): none
        while lo < hi:
            mid = (lo + hi) // 2
            if length(cands[mid]) <= limit:
                hi = mid
            else:
                lo = mid + 1
        first = lo + 1
        kept = cands[lo] if lo < len(cands) else None  # type: ignore[assignment]
    while kept is not None:
        labelled = label_conversation(tokenizer, fmt, kept, tools, settings, whole if kept is messages else None)
        longest = max(len(lab.input_ids) for lab in labelled)
        if longest <= limit:
            return kept, labelled, len(messages) - len(kept), ""
        kept = cands[first] if first < len(cands) else None  # type: ignore[assignment]
        first += 1
    how = "even with only its last exchange" if settings.truncation == "drop_oldest" else "(--truncation exclude)"
    return None, [], 0, f"{length(messages)} tokens {how}; --max_seq_length is {limit}"


def chat_prompt(tokenizer: Any, fmt: ChatFormat, messages: list[dict], tools: list | None,
                thinking: str = "train_empty", system_turn: str = "fold") -> list[int]:
    """Generation prompt ids: the conversation so far, then what the template writes for generation, with the
    thinking switch as training set it."""
    variables = row_variables(tokenizer, fmt, messages, thinking)
    return _ids(tokenizer, render_chat(tokenizer, fmt, messages, tools, True, variables, system_turn))
