"""Preference pairs: row shapes -> one internal form, checked; then prompt and answers -> tokens, labels by position.

Five shapes are read with no flag (detected from the fields):

- ``explicit_prompt`` (TRL): ``prompt`` / ``chosen`` / ``rejected``, as strings or as message lists;
- ``implicit_prompt`` (TRL): ``chosen`` and ``rejected`` are whole conversations (message lists) sharing their start;
- ``sharegpt_pairs`` (LLaMA-Factory): ``conversations`` plus ``chosen`` / ``rejected`` messages;
- ``alpaca_pairs``: ``instruction`` / ``input`` (/ ``system`` / ``history``) plus ``chosen`` / ``rejected`` texts;
- ``anthropic_hh``: ``chosen`` / ``rejected`` texts of ``\\n\\nHuman:`` / ``\\n\\nAssistant:`` turns whose last
  assistant turn differs.

Each becomes a row with ``pair_prompt`` (messages, or a text used as written), ``pair_chosen`` and ``pair_rejected``
(assistant messages, or texts) and ``tools``. Conversations are rendered by the same chat template and labelled by
the same function as SFT (:func:`surefit.data.encode.label_conversation`); the prompt is the same text in both
sequences and is tokenised once, so its tokens are identical in both, token for token, even when the prompt ends
inside what would otherwise be a BPE merge with the answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from surefit.data.conversation_shapes import (
    RowProblems,
    json_list,
    messages_from_alpaca,
    messages_from_openai,
    messages_from_sharegpt,
    parse_tools,
)
from surefit.data.encode import ChatFormat, Labelled, TemplateProblem, label_conversation, leading_special_ids
from surefit.data.formats import MAX_WHERES, SHAREGPT_ROLES, FormatChoice, check_messages, field_counts
from surefit.data.readers import SKIP_HINT, Rejected
from surefit.data.rows import Row
from surefit.errors import Problem

PAIR_FORMATS = ("explicit_prompt", "implicit_prompt", "sharegpt_pairs", "alpaca_pairs", "anthropic_hh")
HH_HUMAN, HH_ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def detect_pair_format(rows: list[Row], source: str) -> FormatChoice | Problem:
    """The pair shape most rows have (see the module's docstring), or a Problem naming the fields found."""
    keys, has = field_counts(rows)

    used = ("chosen", "rejected")
    if not has(*used):
        found = ", ".join(repr(k) for k in sorted(keys)) or "(none)"
        return Problem(f"cannot read {source} as preference pairs: its fields are {found}", "--data",
                       "pairs need 'chosen' and 'rejected' (with 'prompt', 'conversations' or 'instruction' for the "
                       "prompt, or whole conversations / Anthropic HH texts sharing their start); see docs/preference.md")
    if has("prompt"):
        return FormatChoice("explicit_prompt", True, ("prompt", *used, "tools"), "prompt / chosen / rejected",
                            "prompt -> shared prompt (never trained), chosen / rejected -> the two trained answers")
    if has("conversations"):
        return FormatChoice("sharegpt_pairs", True, ("conversations", *used, "system", "tools"),
                            "conversations / chosen / rejected", "conversations -> shared prompt, chosen / rejected "
                            "messages -> the two trained answers", dict(SHAREGPT_ROLES))
    if has("instruction"):
        return FormatChoice("alpaca_pairs", True, ("instruction", "input", "system", "history", *used),
                            "instruction / input / chosen / rejected", "system, history, instruction + input -> "
                            "shared prompt, chosen / rejected -> the two trained answers")
    sample = next((r.fields["chosen"] for r in rows if isinstance(r.fields.get("chosen"), str)), None)
    if sample is not None and HH_HUMAN in sample and HH_ASSISTANT in sample:
        return FormatChoice("anthropic_hh", True, used, "chosen / rejected (Human: / Assistant: text)",
                            "turns before the last assistant turn -> shared prompt, last assistant turns -> the two "
                            "trained answers")
    return FormatChoice("implicit_prompt", True, (*used, "tools"), "chosen / rejected (whole conversations)",
                        "the turns both share -> prompt, the rest of each -> the trained answer")


def _answer(value: Any, bad: RowProblems, name: str, roles: dict[str, str] | None = None) -> list[dict] | str:
    """A chosen / rejected field: a text, one message, or a list of messages (all trained)."""
    value = json_list(value)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if roles is not None and isinstance(value, list) and value and isinstance(value[0], dict) and "from" in value[0]:
        msgs = messages_from_sharegpt(value, roles, bad)
    else:
        msgs = messages_from_openai(value, bad, name)
    for m in msgs:
        if m.get("role") == "assistant":
            m["train"] = True
    return msgs


def parse_hh(text: str) -> list[dict] | None:
    """Anthropic HH text -> messages (``None`` when it is not alternating Human / Assistant turns)."""
    out: list[dict] = []
    rest = text
    if not rest.startswith(HH_HUMAN):
        rest = rest.lstrip("\n")
        rest = "\n\n" + rest if rest.startswith("Human:") else rest
    while rest:
        if rest.startswith(HH_HUMAN):
            role, rest = "user", rest[len(HH_HUMAN):]
        elif rest.startswith(HH_ASSISTANT):
            role, rest = "assistant", rest[len(HH_ASSISTANT):]
        else:
            return None
        ends = [i for i in (rest.find(HH_HUMAN), rest.find(HH_ASSISTANT)) if i >= 0]
        end = min(ends) if ends else len(rest)
        out.append({"role": role, "content": rest[:end].strip()} | ({"train": False} if role == "assistant" else {}))
        rest = rest[end:]
    return out or None


def _split_shared(chosen: list[dict], rejected: list[dict], bad: RowProblems) -> tuple[list[dict], list[dict], list[dict]]:
    """Whole conversations -> (shared prompt, chosen rest, rejected rest): the prompt is their common turns, up to the
    first assistant turn where they differ."""
    k = 0
    while k < min(len(chosen), len(rejected)) and _same(chosen[k], rejected[k]):
        k += 1
    while k > 0 and chosen[k - 1]["role"] == "assistant" and (k == len(chosen) or k == len(rejected)):
        k -= 1  # identical conversations: the last assistant turn is the answer (then reported as identical)
    prompt = [{**m, "train": False} if m["role"] == "assistant" else m for m in chosen[:k]]
    c, r = chosen[k:], rejected[k:]
    for name, part in (("chosen", c), ("rejected", r)):
        if part and part[0]["role"] != "assistant":
            bad.add("shape", f"'{name}' and the other answer differ at a {part[0]['role']} turn (turn {k + 1}), not "
                             "at an assistant turn: the prompt both share must end before the answers")
        for m in part:
            if m["role"] == "assistant":
                m["train"] = True
    return prompt, c, r


def _same(a: dict, b: dict) -> bool:
    strip = lambda m: {k: v for k, v in m.items() if k != "train"}  # noqa: E731
    return strip(a) == strip(b)


def _text_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Texts sharing their start -> (prompt, chosen rest, rejected rest), the prompt ending before a space where the
    texts part (as TRL's ``extract_prompt``)."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k > 0 and not chosen[k - 1].isspace() and k < len(chosen) and k < len(rejected):
        k -= 1
    if k and chosen[k - 1] == " ":
        k -= 1
    return chosen[:k], chosen[k:], rejected[k:]


def _plain(answer: list[dict] | str) -> str:
    if isinstance(answer, str):
        return answer.strip()
    return json.dumps([{k: v for k, v in m.items() if k != "train"} for m in answer], sort_keys=True)


_FIXES = {
    "identical": "remove the pairs whose chosen and rejected answers are the same (they teach nothing and make the "
                 "loss a constant)",
    "empty": "fill in or remove the empty answers and turns",
    "shape": "see docs/preference.md for the shape of each pair format",
    "missing": "add the field to these rows or remove them",
    "order": "a prompt starts with an optional system turn, then alternates user (or tool) and assistant turns; each "
             "answer is assistant turns; fix or remove these rows",
    "role": "use the roles system, user, assistant, tool, or fix these rows",
    "tools": "make 'tools' a JSON list of tool objects, or remove it",
}
_KIND_TEXT = {"identical": "chosen equal to rejected", "empty": "an empty answer or turn", "shape": "a malformed pair",
              "missing": "a missing field", "order": "an impossible turn order", "role": "an unknown role",
              "tools": "a bad 'tools' field"}


def to_pairs(rows: list[Row], choice: FormatChoice, source: str, problems: list[Problem],
             rejects: list[Rejected] | None = None) -> list[Row]:
    """Rows of a pair format -> rows with ``pair_prompt``, ``pair_chosen``, ``pair_rejected`` and ``tools``; every row
    checked. Bad rows are problems (one per kind, rows listed), or under ``--on_bad_rows skip`` (``rejects`` a list)
    appended to ``rejects`` with every reason."""
    out: list[Row] = []
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        bad = RowProblems()
        f = row.fields
        prompt: list[dict] | str = []
        chosen: list[dict] | str = ""
        rejected: list[dict] | str = ""
        tools = parse_tools(f.get("tools"), bad)
        missing = [k for k in ("chosen", "rejected") if f.get(k) is None]
        if missing:
            bad.add("missing", f"{' and '.join(repr(k) for k in missing)} missing")
        elif choice.name == "explicit_prompt":
            raw = json_list(f.get("prompt"))
            chosen, rejected = _answer(f["chosen"], bad, "chosen"), _answer(f["rejected"], bad, "rejected")
            if isinstance(raw, str) and isinstance(chosen, str) and isinstance(rejected, str):
                prompt = raw  # TRL's standard (not conversational) form: the prompt as written, no template
            elif isinstance(raw, str):
                prompt = [{"role": "user", "content": raw}]
            else:
                prompt = messages_from_openai(raw, bad, "prompt", train=False)
            if not isinstance(prompt, str):
                chosen, rejected = (_as_messages(a) for a in (chosen, rejected))
        elif choice.name == "sharegpt_pairs":
            prompt = messages_from_sharegpt(f.get("conversations"), choice.role_map, bad)
            for m in prompt:
                if m.get("role") == "assistant":
                    m["train"] = False
            system = f.get("system")
            if isinstance(system, str) and system.strip() and not (prompt and prompt[0]["role"] == "system"):
                prompt.insert(0, {"role": "system", "content": system})
            chosen = _as_messages(_answer(f["chosen"], bad, "chosen", choice.role_map))
            rejected = _as_messages(_answer(f["rejected"], bad, "rejected", choice.role_map))
        elif choice.name == "alpaca_pairs":
            if not isinstance(f.get("instruction"), str) or not f["instruction"].strip():
                bad.add("missing", "'instruction' is missing or empty")
            msgs = messages_from_alpaca({**f, "output": ""}, bad)
            prompt = [{**m, "train": False} if m["role"] == "assistant" else m for m in msgs[:-1]]
            chosen = _as_messages(_answer(f["chosen"], bad, "chosen"))
            rejected = _as_messages(_answer(f["rejected"], bad, "rejected"))
        elif choice.name == "anthropic_hh":
            c, r = (parse_hh(f[k]) if isinstance(f[k], str) else None for k in ("chosen", "rejected"))
            if c is None or r is None:
                bad.add("shape", "'chosen' / 'rejected' are not texts of '\\n\\nHuman:' / '\\n\\nAssistant:' turns")
            else:
                prompt, chosen, rejected = _split_shared(c, r, bad)
        else:
            c, r = json_list(f["chosen"]), json_list(f["rejected"])
            if isinstance(c, str) and isinstance(r, str):
                prompt, chosen, rejected = _text_prompt(c, r)
                if not prompt.strip():
                    bad.add("shape", "'chosen' and 'rejected' share no prompt text (give a 'prompt' field)")
            else:
                c_msgs = messages_from_openai(c, bad, "chosen", train=False)
                r_msgs = messages_from_openai(r, bad, "rejected", train=False)
                prompt, chosen, rejected = _split_shared(c_msgs, r_msgs, bad)
        if not any(k in ("shape", "missing") for k, _ in bad.items):
            _check_pair(prompt, chosen, rejected, bad)
        if not bad.items:
            out.append(row.with_fields(pair_prompt=prompt, pair_chosen=chosen, pair_rejected=rejected, tools=tools))
            continue
        if rejects is not None:
            rejects.append(Rejected(row.where, "; ".join(t for _, t in bad.items),
                                    json.dumps(row.fields, ensure_ascii=False)[:2000]))
            continue
        local = row.where[len(source) + 1:] if row.where.startswith(source + " ") else row.where
        for kind, text in bad.items:
            by_kind.setdefault(kind, []).append((local, text))
    for kind, items in by_kind.items():
        hit = len({w for w, _ in items})
        shown = "; ".join(f"{w} {t}" for w, t in items[:MAX_WHERES])
        shown += f"; and {len(items) - MAX_WHERES} more" if len(items) > MAX_WHERES else ""
        problems.append(Problem(f"{hit} pair{'s' if hit != 1 else ''} {'have' if hit != 1 else 'has'} "
                                f"{_KIND_TEXT.get(kind, kind)}: {shown}", where=source,
                                fix=f"{_FIXES.get(kind, 'fix or remove these rows')}; {SKIP_HINT}"))
    return out


def _as_messages(answer: list[dict] | str) -> list[dict]:
    return [{"role": "assistant", "content": answer, "train": True}] if isinstance(answer, str) else answer


def _check_pair(prompt: list[dict] | str, chosen: list[dict] | str, rejected: list[dict] | str,
                bad: RowProblems) -> None:
    """Non-empty answers that differ; conversations in a possible order (checked as SFT checks them)."""
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, str):
            if not answer.strip():
                bad.add("empty", f"the {name} answer is empty")
        elif not answer:
            bad.add("empty", f"the {name} answer has no turn")
        elif not any(m["role"] == "assistant" for m in answer):
            bad.add("order", f"the {name} answer has no assistant turn")
        else:
            for m in answer:
                if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls"):
                    bad.add("empty", f"the {name} answer is empty")
    if isinstance(prompt, list):
        if not prompt:
            bad.add("shape", "the prompt has no turn")
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            if isinstance(answer, list) and answer:
                sub = RowProblems()
                check_messages(prompt + answer, sub)
                for kind, text in sub.items:
                    if kind != "empty" and (kind, f"{name}: {text}") not in bad.items:
                        bad.add(kind, f"{name}: {text}")
    elif not prompt.strip():
        bad.add("empty", "the prompt is empty")
    if not any(k == "empty" for k, _ in bad.items) and _plain(chosen) == _plain(rejected):
        bad.add("identical", "chosen and rejected are the same answer")


# ------------------------------------------------------------------------------------------------------------ encoding


@dataclass
class PairExample:
    """One encoded pair: two sequences that begin with the same prompt tokens.

    Attributes:
        chosen_ids / rejected_ids: prompt + answer (+ terminator); chosen_labels / rejected_labels: -100 over the
            prompt (and anything not trained), the answer's ids and its terminator elsewhere.
        prompt_len: tokens of the shared prompt (``chosen_ids[:prompt_len] == rejected_ids[:prompt_len]``).
        row: the source row; prompt_cut: prompt tokens (or turns, for conversations) dropped to fit.
    """

    chosen_ids: list[int]
    chosen_labels: list[int]
    rejected_ids: list[int]
    rejected_labels: list[int]
    prompt_len: int
    row: Row
    prompt_cut: int = 0

    @property
    def tokens(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def longest(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))

    def features(self) -> dict[str, Any]:
        return {"chosen_ids": self.chosen_ids, "chosen_labels": self.chosen_labels,
                "rejected_ids": self.rejected_ids, "rejected_labels": self.rejected_labels}


@dataclass
class PairReport:
    """What encoding did to the pairs of a split: counted so nothing is silent."""

    split: str
    rows: int = 0
    encoded: int = 0
    truncated: int = 0  # pairs whose prompt was shortened (from the left / oldest turns first)
    tokens_cut: int = 0
    excluded: list[tuple[str, str]] = field(default_factory=list)  # (where, reason)
    tokens: int = 0
    supervised_tokens: int = 0
    prompt_tokens: int = 0

    def summary(self) -> str:
        parts = [f"{self.split}: {self.encoded}/{self.rows} pairs encoded"]
        if self.truncated:
            parts.append(f"{self.truncated} prompts shortened from the left to fit ({self.tokens_cut} tokens or turns "
                         "cut; answers are never cut)")
        if self.excluded:
            parts.append(f"{len(self.excluded)} pairs excluded (listed)")
        if self.tokens:
            parts.append(f"{self.tokens} tokens in both sequences, {self.supervised_tokens} supervised, "
                         f"{self.prompt_tokens} shared prompt tokens")
        return "; ".join(parts)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_pairs(rows: list[Row], tokenizer: Any, chat: ChatFormat | None, *, max_seq_length: int,
                 truncation: str = "drop_oldest", split: str = "train"
                 ) -> tuple[list[PairExample], PairReport, list[tuple[str, str]], set[int]]:
    """Encode pair rows; the prompt is rendered and tokenised once per pair and shared by both sequences.

    Text prompts (TRL's standard form) are used as written, answers get the tokenizer's EOS; message prompts are
    rendered by ``chat`` and labelled by position as SFT labels them. A pair longer than ``max_seq_length`` has its
    prompt shortened from the left (the oldest exchanges of a conversation first; the system turn stays) unless
    ``truncation == "exclude"``; answers are never cut, and a pair whose answers do not fit, or whose prompt would be
    emptied, is excluded and listed.

    Returns:
        ``(examples, report, failures, terminators)``: ``failures`` are ``(where, why)`` of pairs that cannot be used
        as they are (a template that cannot label them, answers identical once tokenised): the caller refuses them
        or, with ``--on_bad_rows skip``, excludes them.
    """
    report = PairReport(split=split, rows=len(rows))
    examples: list[PairExample] = []
    failures: list[tuple[str, str]] = []
    terminators: set[int] = set()
    for row in rows:
        f = row.fields
        try:
            if isinstance(f["pair_prompt"], str):
                ex, why = _encode_text(row, tokenizer, max_seq_length, truncation)
            else:
                ex, why, term = _encode_chat(row, tokenizer, chat, max_seq_length, truncation)
                terminators |= term
        except TemplateProblem as e:
            failures.append((row.where, str(e)))
            continue
        if ex is None:
            report.excluded.append((row.where, why))
            continue
        p = ex.prompt_len
        if ex.chosen_ids[:p] != ex.rejected_ids[:p]:  # by construction; checked because everything rests on it
            failures.append((row.where, "the prompt's tokens differ between the chosen and rejected sequences"))
            continue
        if ex.chosen_ids[p:] == ex.rejected_ids[p:]:
            failures.append((row.where, "chosen and rejected are the same tokens once rendered and tokenised"))
            continue
        if ex.prompt_cut:
            report.truncated += 1
            report.tokens_cut += ex.prompt_cut
        examples.append(ex)
        report.tokens += ex.tokens
        report.prompt_tokens += p
        report.supervised_tokens += sum(t != -100 for t in ex.chosen_labels) + sum(t != -100 for t in ex.rejected_labels)
    report.encoded = len(examples)
    return examples, report, failures, terminators


def _encode_text(row: Row, tokenizer: Any, max_len: int, truncation: str) -> tuple[PairExample | None, str]:
    f = row.fields
    lead = leading_special_ids(tokenizer)
    prompt = _ids(tokenizer, f["pair_prompt"])
    eos = tokenizer.eos_token_id
    answers = [_ids(tokenizer, f[k]) + [eos] for k in ("pair_chosen", "pair_rejected")]
    room = max_len - len(lead) - max(len(a) for a in answers)
    cut = 0
    if len(prompt) > room:
        if room < 1:
            return None, (f"the answers alone need {max(len(a) for a in answers)} tokens (with EOS) and "
                          f"--max_seq_length is {max_len}: nothing of the prompt would be left")
        if truncation == "exclude":
            return None, (f"{len(lead) + len(prompt) + max(len(a) for a in answers)} tokens; --max_seq_length is "
                          f"{max_len} (--truncation exclude)")
        cut = len(prompt) - room
        prompt = prompt[cut:]  # from the left: the end of the prompt (what is answered) stays
    shared = lead + prompt
    c, r = answers
    return PairExample(shared + c, [-100] * len(shared) + c, shared + r, [-100] * len(shared) + r, len(shared), row,
                       cut), ""


def _encode_chat(row: Row, tokenizer: Any, chat: ChatFormat | None, max_len: int,
                 truncation: str) -> tuple[PairExample | None, str, set[int]]:
    if chat is None:
        raise TemplateProblem("the pair is a conversation and needs a chat template (--chat_format)")
    f = row.fields
    prompt: list[dict] = list(f["pair_prompt"])
    dropped = 0
    while True:
        encoded = [_one_sequence(label_conversation(tokenizer, chat, prompt + list(f[k]), f.get("tools"),
                                                    "all_assistant"), chat)
                   for k in ("pair_chosen", "pair_rejected")]
        longest = max(len(e.input_ids) for e in encoded)
        if longest <= max_len:
            break
        shorter = _drop_oldest_prompt(prompt)
        if truncation == "exclude" or shorter is None:
            how = "(--truncation exclude)" if truncation == "exclude" else "even with only the last exchange of its prompt"
            return None, f"{longest} tokens {how}; --max_seq_length is {max_len}", set()
        dropped += len(prompt) - len(shorter)
        prompt = shorter
    c, r = encoded
    # The shared prompt ends where the first trained token of either sequence begins.
    p = min(next(i for i, t in enumerate(c.labels) if t != -100), next(i for i, t in enumerate(r.labels) if t != -100))
    return PairExample(c.input_ids, c.labels, r.input_ids, r.labels, p, row, dropped), "", c.terminators | r.terminators


def _one_sequence(labelled: list[Labelled], chat: ChatFormat) -> Labelled:
    """A pair's answer as one sequence. A template that rewrites earlier turns makes an answer of several assistant
    turns several examples (each turn with the conversation up to it): a pair cannot be compared that way."""
    if len(labelled) != 1:
        raise TemplateProblem(f"chat template ({chat.name}) rewrites earlier turns, so an answer of "
                              f"{len(labelled)} assistant turns is not one sequence: give each answer as one "
                              "assistant turn, or use a template that keeps history as written")
    return labelled[0]


def _drop_oldest_prompt(prompt: list[dict]) -> list[dict] | None:
    """The prompt without its oldest exchange (the system turn stays, a user turn stays last); None: nothing can go."""
    start = 1 if prompt and prompt[0]["role"] == "system" else 0
    for j in range(start + 1, len(prompt)):
        if prompt[j]["role"] == "user":
            return prompt[:start] + prompt[j:]
    return None


# ------------------------------------------------------------------------------------------------------------ collation


@dataclass
class PairCollator:
    """Pads a list of pairs into one batch of ``2 x pairs`` rows: the chosen sequences first, then the rejected ones
    in the same order (row ``i`` and row ``pairs + i`` are one pair), and nothing else. A pair's precomputed
    reference log-probabilities travel as ``reference_logps`` (``[pairs, 2]``: chosen, rejected).

    >>> batch = PairCollator(pad_token_id=0)([{"chosen_ids": [5, 6, 2], "chosen_labels": [-100, 6, 2],
    ...                                        "rejected_ids": [5, 7], "rejected_labels": [-100, 7]}])
    >>> batch["input_ids"].tolist(), batch["labels"].tolist()
    ([[5, 6, 2], [5, 7, 0]], [[-100, 6, 2], [-100, 7, -100]])
    """

    pad_token_id: int

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        from surefit.data.collate import PadCollator

        rows = [{"input_ids": f[f"{side}_ids"], "labels": f[f"{side}_labels"]}
                for side in ("chosen", "rejected") for f in features]
        batch: dict[str, Any] = PadCollator(pad_token_id=self.pad_token_id)(rows)
        if "reference_logps" in features[0]:
            batch["reference_logps"] = torch.tensor([f["reference_logps"] for f in features], dtype=torch.float32)
        return batch
