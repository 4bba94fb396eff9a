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
        """Tokens that carry loss (target + EOS)."""
        return len(self.input_ids) - self.prompt_len

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
