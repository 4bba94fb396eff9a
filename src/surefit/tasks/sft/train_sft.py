"""Instruction tuning of a causal LM on input -> target rows: data -> encoding -> model -> loop -> final/, top to bottom.

The correctness-critical pieces live in library code shared by every task: encoding builds the labels once
(``data/encode.py``), the collator only pads (``data/collate.py``), the loop normalises the loss by supervised tokens
(``training/loop.py``), checkpoints are atomic (``training/checkpoint.py``). This file wires them together and reports in
counts everything that happened to the data; ``use_sft.py`` beside it reads back the ``final/`` that ``save`` writes.
"""

from __future__ import annotations

import functools
import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import surefit.doctor  # noqa: F401 - importing it registers the checks that run_checks runs
import surefit.startup as startup
import surefit.startup.cache as startup_cache
from surefit.config import SFTConfig
from surefit.data import encoded_store
from surefit.data.augment import AugmentStats, augment_conversations, augment_rows
from surefit.data.chat_render import answer_of, reasoning_answer
from surefit.data.collate import PadCollator
from surefit.data.encode import (
    ChatEncodeSettings,
    ChatFormat,
    EncodeReport,
    Example,
    PromptFormat,
    build_prompt_format,
    chat_prompt,
    encode_conversations,
    encode_prompts,
    encode_rows,
    resolve_chat_template,
)
from surefit.data.encoded_store import (
    EncodedStore,
    SplitArrays,
    StoreRecord,
    StoreUse,
    StoreWriter,
    chunked,
    merge_reports,
)
from surefit.data.formats import (
    FormatChoice,
    ReadSettings,
    detect_format,
    field_table,
    format_rows,
    last_assistant,
    parse_role_map,
    read_formatted,
    template_fields,
)
from surefit.data.readers import CountedNote, Rejected, limit_note, merge_counted, read_limited, read_splits
from surefit.data.readers.streamed import RowsOnDisk
from surefit.data.rows import Row
from surefit.data.split import (
    KEY_DTYPE,
    key_hash,
    leaked,
    normalize_key,
    overlap_note,
    split_hashes,
    split_or_check,
)
from surefit.data.summary import DataSummary, TextFacts
from surefit.data.system_prompt import describe as describe_system
from surefit.data.system_prompt import injected_system_prompt, system_turn, with_system
from surefit.doctor.core import Setup, run_checks
from surefit.errors import (
    ConfigError,
    DataError,
    ModelError,
    Problem,
    raise_if,
    raise_with_rejected,
)
from surefit.eval.generate import Decode, LossPass, LossPassUnfit, greedy_generate, other_layer_kinds, why_no_loss_pass
from surefit.eval.metrics import exact_match, rouge_l, squad_scores, token_f1
from surefit.eval.progress import Progress, phase
from surefit.models import (
    apply_lora,
    inner_model,
    load_causal_lm,
    load_tokenizer,
    model_folder,
    resolve_model,
)
from surefit.models.lowbit import keep_4bit_trainable, require_bitsandbytes
from surefit.run_folder import EXCLUDED, SHORTENED, Found
from surefit.tasks.baseline_eval import BaselineReuse, rows_digest
from surefit.tasks.runner import Evaluation, Prepared, RunResult, render_columns, train
from surefit.training.dropout import seed_dropout
from surefit.training.loop import evaluate_loss
from surefit.training.loss import causal_lm_dry_run, causal_lm_loss_sum
from surefit.training.memory import enable_gradient_checkpointing, shrink_on_oom
from surefit.training.plan import GenerationBatch, MeasuringDryRun, generation_batch, resolve_budget
from surefit.training.precision import autocast_where, make_accelerator, precision_name, resolve_precision
from surefit.training.processes import is_main_process, sum_over_processes
from surefit.training.schedule import plan_schedule
from surefit.training.speedups import fused_head
from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora
from surefit.training.speedups.lora_generate import lean_lora, packed_lora
from surefit.training.speedups.prefixes import PrefixSharing, why_not_shared
from surefit.training.work import PlanInputs, Switches, TrainingWork

Say = Callable[[str], None]
# The column flags of an sft run (``surefit eval`` / ``predict`` take them for other data).
FIELDS = ("input_field", "target_field")
# What ``final/`` holds: a LoRA adapter, or a full model.
FINAL_FILES: list[tuple[str, ...]] = [("adapter_config.json",), ("config.json",)]


def final_files(cfg: SFTConfig) -> list[tuple[str, ...]]:
    """The alternatives of what ``final/`` holds (any one of them)."""
    return FINAL_FILES


# ------------------------------------------------------------------------------------------------------------ data


def read_settings(cfg: SFTConfig) -> ReadSettings:
    """The flags of ``cfg`` that say how its rows are read."""
    return ReadSettings(cfg.format, cfg.input_field, cfg.target_field, cfg.template, cfg.role_map)


def prerendered(cfg: SFTConfig) -> bool:
    """A --template naming fields other than {input} fills each row's prompt while reading (see
    :func:`surefit.data.formats.read_formatted`)."""
    return read_settings(cfg).prerendered


def system_shape(row: Row) -> int:
    """What :meth:`Encoder.system_line` counts of a row: 1 for a conversation without a system turn, plus 2 when it
    gives tools."""
    messages = row.fields.get("messages")
    if not isinstance(messages, list) or (messages and messages[0].get("role") == "system"):
        return 0
    return 1 + 2 * bool(row.fields.get("tools"))


def conversation_key(row: Row, input_field: str) -> str:
    """What makes two rows the same example for the split and the leakage check: a conversation's user turns (and
    system prompt) as a whole, or a flat row's input."""
    messages = row.fields.get("messages")
    if isinstance(messages, list):
        return normalize_key(" \n ".join(m["content"] for m in messages if m["role"] in ("system", "user")))
    return normalize_key(str(row.fields[input_field]))


def load_data(cfg: SFTConfig, say: Say = print,
              problems: list[Problem] | None = None) -> tuple[list[Row], list[Row], DataSummary]:
    """Read, detect the format, check, split (before augmentation) and augment. Every problem in every file is
    reported at once.

    Args:
        problems: problems already found (e.g. with ``--output_dir``), reported together with the data's.

    Returns:
        ``(train_rows, val_rows, summary)``: the summary holds the counts printed to the user and saved, the format,
        the rows rejected under ``--on_bad_rows skip`` and what became of each field (``facts.field_table``).
        A problem raised carries the rejected rows too (``error.rejected``), for the run folder to list.
    """
    problems = list(problems or [])
    assert cfg.data is not None  # required: the config's checks say so first
    rejects: list[Rejected] = []
    read_notes: list[str] = []  # the summary's notes, added to as the data is read
    facts = TextFacts()
    report = DataSummary(notes=read_notes, rejected=rejects, facts=facts)
    loaded = read_splits(cfg.data, cfg.val_data, cfg.limit, problems, rejects if cfg.on_bad_rows == "skip" else None,
                         read_notes)
    choice: FormatChoice | None = None
    table: list[dict[str, str]] = []
    how = read_settings(cfg)
    for name, path in (("train", cfg.data), ("validation", cfg.val_data)):
        if loaded.get(name):
            raw = loaded[name]
            before = len(rejects or [])
            loaded[name], found, notes = read_formatted(raw, how, str(path), problems,
                                                       rejects if cfg.on_bad_rows == "skip" else None,
                                                       choice.name if choice else None)
            read_notes += notes
            if found is not None and choice is None:
                choice = found
                named = tuple(template_fields(cfg.template)) if cfg.template else ()
                table = field_table(raw, found, named)
            if found is not None and found.conversational and cfg.on_bad_rows == "skip" and raw and not loaded[name]:
                problems.append(Problem(f"all {len(raw)} rows of {path} were rejected (first: {rejects[before].where}: "
                                        f"{rejects[before].reason})", str(path), "fix the rows (see the rejected rows "
                                        "file)"))
    raise_with_rejected(problems, rejects)
    assert choice is not None
    report.format, report.format_conversational = choice.name, choice.conversational
    facts.field_table = table
    say(choice.line())
    say("fields of the rows:\n" + render_columns(table))

    key = lambda r: conversation_key(r, cfg.input_field)  # noqa: E731
    train_rows, val, notes = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction, cfg.seed,
                                            key, "conversation" if choice.conversational else "input")
    read_notes += notes
    # Augment AFTER the split and only the training side: a variant of a validation row in training is a leak.
    if choice.conversational:
        train_rows, stats = augment_conversations(train_rows, cfg.augmentation_factor, cfg.seed)
    else:
        train_rows, stats = augment_rows(train_rows, cfg.augmentation_factor, cfg.seed, cfg.input_field)
    read_notes.append(stats.summary())
    if not cfg.val_data:
        assert not leaked(train_rows, val, key), "split/augment invariant broken: a validation row leaked into training"
    report.train_rows, report.val_rows = len(train_rows), len(val)
    facts.augmentation = stats.__dict__
    for note in read_notes:
        say(note)
    return train_rows, val, report


# Rows encoded (and written to the store) at a time; a streamed miss holds a few chunks of rows per worker
STREAM_CHUNK = 2048
# Rows formatted at a time by each pass of a streamed read
READ_CHUNK = 4096


@dataclass
class StreamedRows:
    """:func:`load_data`'s result for a file read in passes, the training rows left on disk.

    Attributes:
        shapes: each training row's :func:`system_shape` (one byte a row).
        batches: the training rows, in order, in lists of a multiple of ``chunk`` rows (the last one shorter).
    """

    report: DataSummary
    val: list[Row]
    n_train: int
    shapes: bytes
    batches: Callable[[int], Iterator[list[Row]]]


def stream_data(cfg: SFTConfig, say: Say, problems: list[Problem]) -> StreamedRows | None:
    """:func:`load_data` with the training rows never all in memory: the same lines printed, the same summary, the
    same split and the same rows, in passes over a JSONL file (read and count; detect the format and list the
    fields; format each chunk and keep its key hash, 16 bytes a row; collect the validation rows, or read a
    ``--val_data`` file whole; with ``--augmentation_factor`` above 1 augment the training rows for the summary's
    counts; then :attr:`StreamedRows.batches` reads, and augments, the training rows once more, chunk by chunk).
    ``None`` (before anything is printed) where this cannot give what :func:`load_data` gives, which then reads the
    rows in memory: a document format or CSV/TSV, any problem (its report comes from :func:`load_data`; a row that
    cannot be augmented too, or a field missing from a whole chunk).

    Raises:
        DataError: the training file changed between two passes.
    """
    if problems or not 0 <= cfg.val_fraction < 1:
        return None
    assert cfg.data is not None
    source, skip, chunk = str(cfg.data), cfg.on_bad_rows == "skip", READ_CHUNK
    rejects: list[Rejected] = []
    keep = rejects if skip else None
    found: list[Problem] = []
    read_notes: list[str] = []
    disk = RowsOnDisk.open(source, keep, cfg.limit)
    if disk is not None and disk.cut:
        read_notes.append(limit_note(source, disk.n, None))
    # A validation file is bounded by the validation set: read whole, as load_data reads it
    raw_val = read_limited(cfg.val_data, cfg.limit, found, keep, read_notes) if cfg.val_data else None
    how = read_settings(cfg)
    role_map, role_problems = parse_role_map(how.role_map)
    if disk is None or role_problems or found:
        return None
    choice = detect_format(disk, source, how.format, how.input_field, how.target_field, role_map,
                           needs_input=not how.prerendered)
    if isinstance(choice, Problem):
        return None
    hashes, shapes = bytearray(), bytearray()
    counted: list[list[CountedNote]] = []
    for rows in disk.chunks(chunk):
        counted.append([])
        kept, notes = format_rows(rows, choice, how, source, found, keep, counted[-1])
        if found:  # a problem is reported over the file: read in memory
            return None
        if len(notes) != len(counted[-1]):  # a note that cannot add up over chunks
            return None
        for r in kept:
            hashes += key_hash(conversation_key(r, cfg.input_field))
            shapes.append(system_shape(r))
    n = len(shapes)
    read_notes += merge_counted(counted, n)  # the notes counted over the file, as one read gives them
    given_val: list[Row] = []
    if raw_val is not None:
        given_val, notes = format_rows(raw_val, choice, how, str(cfg.val_data), found, keep)
        read_notes += notes
        if found or (choice.conversational and skip and not given_val):
            return None
    if n == 0:
        return None
    in_val = np.zeros(n, dtype=bool)
    split_notes = [f"no validation split: all {n} rows train (val_fraction 0)"]
    if raw_val is not None:  # a validation file: its overlap with the training rows is noted (split_or_check)
        split_notes = _overlap(given_val, hashes, disk, chunk, choice, cfg)
    elif cfg.val_fraction:
        try:
            in_val, split_notes = split_hashes(np.frombuffer(bytes(hashes), dtype=KEY_DTYPE), cfg.val_fraction,
                                               cfg.seed)
        except DataError:  # printed after the format, by load_data
            return None
    del hashes
    table = field_table(disk, choice, tuple(template_fields(cfg.template)) if cfg.template else ())

    factor = cfg.augmentation_factor

    def formatted() -> Iterator[tuple[bool, Row]]:
        at = 0
        for rows in disk.chunks(chunk):
            kept, _ = format_rows(rows, choice, how, source, [], [] if skip else None)
            yield from zip(in_val[at: at + len(kept)].tolist(), kept, strict=True)
            at += len(kept)

    def augmented(stats: AugmentStats) -> Iterator[list[Row]]:
        """The training rows chunk by chunk, each followed by its variants: one generator carried across the
        chunks in row order draws what :func:`load_data`'s one call over all rows draws (split before augmenting)."""
        rng = random.Random(cfg.seed)
        train: list[Row] = []
        for v, r in formatted():
            if not v:
                train.append(r)
            if len(train) == chunk:
                yield augment_chunk(train, rng, stats)
                train = []
        if train:
            yield augment_chunk(train, rng, stats)

    def augment_chunk(train: list[Row], rng: random.Random, stats: AugmentStats) -> list[Row]:
        if factor == 1:
            return train
        out, got = (augment_conversations(train, factor, cfg.seed, rng) if choice.conversational
                    else augment_rows(train, factor, cfg.seed, cfg.input_field, rng))
        stats.add(got)
        return out

    def batches(size: int) -> Iterator[list[Row]]:
        batch: list[Row] = []
        for rows in augmented(AugmentStats(0, 0)):
            for r in rows:
                batch.append(r)
                if len(batch) == size:
                    yield batch
                    batch = []
        if batch:
            yield batch

    val = given_val if raw_val is not None else [r for v, r in formatted() if v]
    n_train = n - int(in_val.sum())
    stats = AugmentStats(rows_before=n_train, rows_after=n_train)
    if factor != 1:  # a pass that augments for the counts of the summary, checking what load_data asserts
        stats = AugmentStats(0, 0)
        val_keys = {key_hash(conversation_key(v, cfg.input_field)) for v in val} if raw_val is None else set()
        try:
            for rows in augmented(stats):
                if any(key_hash(conversation_key(r, cfg.input_field)) in val_keys for r in rows):
                    return None  # a variant with a validation row's key: load_data's leak assertion says so
        except DataError:  # rows that cannot be augmented: reported over the file by load_data
            return None
    notes = read_notes + split_notes
    notes.append(stats.summary())
    facts = TextFacts(field_table=table, augmentation=stats.__dict__)
    report = DataSummary(notes=notes, rejected=rejects, facts=facts, format=choice.name,
                         format_conversational=choice.conversational, train_rows=stats.rows_after,
                         val_rows=len(val))
    say(choice.line())
    say("fields of the rows:\n" + render_columns(table))
    for note in notes:
        say(note)
    # a variant keeps its source's system turn and tools: its shape repeated
    train_shapes = np.repeat(np.frombuffer(bytes(shapes), dtype=np.uint8)[~in_val], factor)
    return StreamedRows(report, val, stats.rows_after, train_shapes.tobytes(), batches)


def _overlap(val: list[Row], hashes: bytearray, disk: RowsOnDisk, chunk: int, choice: FormatChoice,
             cfg: SFTConfig) -> list[str]:
    """:func:`split_or_check`'s note on a validation file, from the training rows' key hashes: the pairs of a
    training row and a validation row with the same key, the first pair's rows named (found by one more walk)."""
    by_key: dict[bytes, list[Row]] = {}
    for v in val:
        by_key.setdefault(key_hash(conversation_key(v, cfg.input_field)), []).append(v)
    per_row = [len(by_key.get(bytes(hashes[i:i + 16]), ())) for i in range(0, len(hashes), 16)]
    pairs = sum(per_row)
    if not pairs:
        return []
    first = next(i for i, k in enumerate(per_row) if k)
    at = 0
    how = read_settings(cfg)
    for rows in disk.chunks(chunk):
        kept, _ = format_rows(rows, choice, how, str(cfg.data), [], [] if cfg.on_bad_rows == "skip" else None)
        if first < at + len(kept):
            t = kept[first - at]
            return [overlap_note(pairs, t.where, by_key[key_hash(conversation_key(t, cfg.input_field))][0].where,
                                 "conversation" if choice.conversational else "input")]
        at += len(kept)
    raise AssertionError("the training row of an overlap was not found again")


def _golds(row: Row, target_field: str) -> list[str]:
    if isinstance(row.fields.get("messages"), list):
        return [last_assistant(row.fields["messages"])]
    answers = row.fields.get("answers")
    if isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers):
        return answers
    return [str(row.fields[target_field])]


def encode_settings(cfg: SFTConfig, input_field: str | None = None, target_field: str | None = None) -> dict:
    return dict(max_seq_length=cfg.max_seq_length, input_field=input_field or cfg.input_field,
                target_field=target_field or cfg.target_field, truncation_side=cfg.truncation_side)


# ------------------------------------------------------------------------------------------------------------ encoding


@dataclass
class Encoder:
    """How rows become token ids and labels for this run: a prompt template (flat rows) or a chat template
    (conversations), chosen once and used the same way by training, ``eval``, ``predict`` and ``inspect``.

    Attributes:
        why: the choice in words (printed, and saved in ``data_report.json``).
        terminators: the end-of-turn ids found after assistant turns (generation stops on them too).
    """

    cfg: SFTConfig
    tokenizer: Any
    why: str
    prompt: PromptFormat | None = None
    chat: ChatFormat | None = None
    terminators: set[int] = field(default_factory=set)
    injected: str | None = None  # the default system prompt the chat template adds by itself (found by rendering)
    system: str | None = None  # the system turn given to rows without one (--system_prompt); None: none added

    @classmethod
    def build(cls, cfg: SFTConfig, tokenizer: Any, format_name: str, conversational: bool) -> Encoder:
        """Choose the template: ``--chat_format``, else the model's own chat template (unless ``--chat_template
        false``); flat rows take ``--template`` first, string prompt / completion rows no template at all."""
        chat, why = resolve_chat_template(tokenizer, cfg.chat_template, cfg.chat_format)
        injected = injected_system_prompt(tokenizer, chat.source) if chat is not None else None
        system = system_turn(cfg.system_prompt, injected)
        if conversational:
            if chat is None:
                raise ConfigError(Problem(
                    f"the rows are conversations ({format_name}) and need a chat template, but {why}",
                    "--chat_format", "pass --chat_format chatml (or llama3, gemma, or a Jinja file); it is saved with "
                    "the tokenizer so that inference formats prompts the same way"))
            return cls(cfg, tokenizer, why, chat=chat, injected=injected, system=system)
        if cfg.template:
            return cls(cfg, tokenizer, "prompt template: --template",
                       prompt=build_prompt_format(tokenizer, "{input}" if prerendered(cfg) else cfg.template))
        if format_name == "prompt_completion":
            return cls(cfg, tokenizer, "prompt template: none (prompt / completion rows: the prompt as written)",
                       prompt=build_prompt_format(tokenizer, "{input}"))
        if chat is not None or cfg.chat_template:
            if cfg.chat_template is None and not cfg.chat_format:  # the default, and why (measured: docs/sft.md)
                why = ("chat template: the model's own (the default for a model that ships one: it scored higher than "
                       "the plain template on extractive and open answers, docs/sft.md; --chat_template false uses the "
                       "plain template)")
            return cls(cfg, tokenizer, why + ", one user turn per row", injected=injected, system=system,
                       prompt=build_prompt_format(tokenizer, chat_template=True, system=system))
        return cls(cfg, tokenizer, why, prompt=build_prompt_format(tokenizer))

    def shorter(self) -> str:
        """The settings that make the prompt template of single-turn rows shorter, in words (empty: none)."""
        if self.prompt is None or self.prompt.name != "chat":
            return ""
        ways = ["--system_prompt none leaves out the chat template's default system turn"] \
            if self.injected is not None and self.cfg.system_prompt == "auto" else []
        if not self.cfg.chat_format:
            ways.append("--chat_template false uses the shorter plain template")
        return "; ".join(ways)

    def encode(self, rows: list[Row], split: str, skip: bool = False) -> tuple[list[Example], EncodeReport]:
        """Examples and the report of one split. A row the chat template cannot label is an error (or, with
        ``--on_bad_rows skip``, excluded and listed)."""
        examples, report, failures, terminators = self.encode_raw(rows, split)
        self.terminators |= terminators
        self.settle(failures, report, split, skip)
        return examples, report

    def encode_raw(self, rows: list[Row], split: str) -> tuple[list[Example], EncodeReport, list[tuple[str, str]],
                                                                set[int]]:
        """Examples, report, the rows the chat template cannot label and the end-of-turn ids found; nothing raised
        (what :meth:`encode` and :meth:`encode_into` share: one chunk of rows computes what it computes in a whole
        split)."""
        if self.chat is None:
            assert self.prompt is not None  # flat rows have a prompt format
            examples, report = encode_rows(rows, self.tokenizer, self.prompt, split=split, **encode_settings(self.cfg))
            return examples, report, [], set()
        rows = [self._with_system(r) for r in rows]
        return encode_conversations(rows, self.tokenizer, self.chat, self.chat_settings(), split)

    def encode_into(self, rows: list[Row], split: str, skip: bool, write: Callable[[SplitArrays], None],
                    workers: int, chunk: int = 2048) -> EncodeReport:
        """:meth:`encode` in chunks of ``chunk`` rows on ``workers`` processes, each chunk's arrays handed to
        ``write`` in order (no example held as Python objects): the same examples and report as :meth:`encode`,
        byte for byte."""

        return self.encode_stream(iter([rows]), split, skip, write, workers, chunk)

    def encode_stream(self, batches: Iterator[list[Row]], split: str, skip: bool, write: Callable[[SplitArrays], None],
                      workers: int, chunk: int = 2048) -> EncodeReport:
        """:meth:`encode_into` over rows given batch by batch (a file streamed): every batch but the last holds a
        multiple of ``chunk`` rows, so the chunks, the arrays written and the report are those of one call over
        all the rows, byte for byte, while only one batch is in memory."""
        reports: list[EncodeReport] = []
        failures: list[tuple[str, str]] = []
        for rows in batches:
            def job(a: int, b: int, rows: list[Row] = rows) -> tuple[SplitArrays, EncodeReport,
                                                                       list[tuple[str, str]], set[int]]:
                examples, report, failures, terminators = self.encode_raw(rows[a:b], split)
                return SplitArrays.of(examples), report, failures, terminators

            for arrays, report, failed, terminators in chunked(job, len(rows), workers, chunk):
                write(arrays)
                reports.append(report)
                failures += failed
                self.terminators |= terminators
        merged = merge_reports(reports) if reports else self.encode_raw([], split)[1]
        self.settle(failures, merged, split, skip)
        return merged

    def settle(self, failures: list[tuple[str, str]], report: EncodeReport, split: str, skip: bool) -> None:
        """Rows the chat template cannot label: an error, or with ``skip`` excluded and counted in ``report``."""
        if failures and not skip:
            shown = "; ".join(f"{w}: {why}" for w, why in failures[:5])
            more = f" and {len(failures) - 5} more" if len(failures) > 5 else ""
            n = len(failures)
            which = "" if split == "all" else f"{split} "  # inspect encodes every row: "3 rows", not "3 all rows"
            raise DataError(Problem(f"{n} {which}row{'s' if n != 1 else ''} cannot be rendered and labelled by "
                                    f"position with the chat template: {shown}{more}", "--chat_format",
                                    "use a chat template whose generation prompt is the start of its render of the "
                                    "assistant turn and that writes the turn's content and reasoning (e.g. "
                                    "--chat_format chatml or a fixed FILE.jinja), or pass --on_bad_rows skip to "
                                    "exclude these rows (listed)"))
        report.excluded += failures

    def reasoning_answer(self, raw: str) -> dict[str, str] | None:
        """A generated turn (special tokens kept) -> ``{"reasoning", "answer"}`` where the template marks them."""
        return None if self.chat is None else reasoning_answer(self.tokenizer, self.chat, raw)

    def answer_of(self) -> Callable[[str], str] | None:
        """The answer of a generated turn, for the metrics (``None``: the whole turn is the answer)."""
        return None if self.chat is None else answer_of(self.tokenizer, self.chat)

    def chat_settings(self) -> ChatEncodeSettings:
        return ChatEncodeSettings(self.cfg.max_seq_length, self.cfg.train_on, self.cfg.truncation,
                                  getattr(self.cfg, "thinking", "train_empty"),
                                  getattr(self.cfg, "system_turn", "fold"))
    def _with_system(self, row: Row) -> Row:
        """A conversation row with the --system_prompt turn in front when it has no system turn."""
        messages = row.fields.get("messages")
        if self.system is None or not isinstance(messages, list):
            return row
        return replace(row, fields={**row.fields, "messages": with_system(messages, self.system)})

    def system_line(self, rows: list[Row]) -> str | None:
        """What happens to system turns, with the count of rows it concerns (printed by the run)."""
        if self.prompt is not None and self.chat is None and self.prompt.name != "chat":
            return None if self.cfg.system_prompt == "auto" else \
                "system prompt: --system_prompt is not used: the plain prompt template has no system turn"
        return self.system_line_of(bytes(system_shape(r) for r in rows))

    def system_line_of(self, shapes: bytes) -> str | None:
        """:meth:`system_line` from each row's :func:`system_shape` (a file streamed keeps one byte a row)."""
        if self.prompt is not None and self.chat is None and self.prompt.name != "chat":
            return None if self.cfg.system_prompt == "auto" else \
                "system prompt: --system_prompt is not used: the plain prompt template has no system turn"
        bare = len(shapes)
        if self.chat is not None:  # rows that give tools get a system turn from the tools' note instead
            counts = np.bincount(np.frombuffer(shapes, dtype=np.uint8), minlength=4)
            bare = int(counts[1] + (counts[3] if self.chat.takes_tools else 0))
        return describe_system(self.injected, self.cfg.system_prompt, bare, len(shapes))

    def prompt_ids(self, row: Row, room: int) -> tuple[list[int], int]:
        """Generation prompt of a row and how many tokens were cut from it: a conversation continues with the next
        assistant turn (oldest exchanges dropped to fit ``room``); a flat row's input is cut as in training."""
        if self.chat is None:
            assert self.prompt is not None  # flat rows have a prompt format
            [ids], [cut] = encode_prompts([str(row.fields[self.cfg.input_field])], self.tokenizer, self.prompt,
                                          max_prompt_length=room, truncation_side=self.cfg.truncation_side)
            return ids, cut
        messages = list(self._with_system(row).fields["messages"])
        while messages and messages[-1]["role"] == "assistant":  # predict the last answer again
            messages.pop()
        st = self.chat_settings()
        ids = chat_prompt(self.tokenizer, self.chat, messages, row.fields.get("tools"), st.thinking, st.system_turn)
        full = len(ids)
        while len(ids) > room:
            start = 1 if messages[0]["role"] == "system" else 0
            nxt = next((j for j in range(start + 1, len(messages)) if messages[j]["role"] == "user"), None)
            if nxt is None:
                break
            messages = messages[:start] + messages[nxt:]
            ids = chat_prompt(self.tokenizer, self.chat, messages, row.fields.get("tools"), st.thinking,
                              st.system_turn)
        return ids, full - len(ids)


# ------------------------------------------------------------------------------------------------------------ encoded data


@dataclass
class EncodedData:
    """A run's encoded examples, read from the encoded-data cache or encoded in memory (``--no_cache``).

    Attributes:
        features, lengths, counts: the training examples as the collator takes them (a list, or a store's split read
            from disk by position), their lengths and supervised tokens.
        where: a training example's index -> its source row in words.
        val_ex: the validation examples (in memory: the evaluation generates from them and scores their rows).
        longest_target: the longest training answer in tokens (with its terminator).
        excluded, shortened: the rows ``excluded_rows.jsonl`` and ``shortened_rows.jsonl`` list.
        identity: what identifies the training examples in the start-up cache's key (the store's checksums), or
            ``None`` (hash the examples).
        store: what the cache did (``data_report.json``'s ``encoded_store``).
    """

    summary: DataSummary
    encoder: Encoder
    path: str
    tokenizer: Any
    features: Sequence[dict[str, list[int]]]
    lengths: Sequence[int]
    counts: Sequence[int]
    where: Callable[[int], str]
    val_ex: list[Example]
    longest_target: int
    excluded: list[dict[str, Any]]
    shortened: list[dict[str, Any]]
    identity: str | None = None
    store: StoreUse = field(default_factory=lambda: StoreUse("off"))

    def doctor_sample(self) -> Sequence[dict[str, list[int]]]:
        """What the doctor scans: every example in memory; from a store the rows its scans read (the first
        ``SCAN_ROWS``) and the longest, so that a large file is checked without holding it."""
        if isinstance(self.features, list):
            return self.features
        from surefit.doctor.checks_data import SCAN_ROWS

        head = list(self.features[:SCAN_ROWS])
        from surefit.data.sampling import longest_first

        longest = next(iter(longest_first(self.lengths, 1)), None)  # numpy: no Python int per example
        if longest is not None and longest >= SCAN_ROWS:
            head.append(self.features[longest])
        return head


# Settings that do not change what is read and encoded (training, evaluation, bookkeeping): every other setting is
# part of the encoded-data cache's key, so a setting added later misses rather than reads the wrong examples.
NOT_IN_STORE_KEY = startup_cache.NOT_IN_KEY | {
    "preset", "model", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_variant", "quantize", "precision",
    "gradient_checkpointing", "sharding", "gpu_memory_gb", "batch_size", "grad_accum", "eval_batch_size", "metric",
    "eval_generate", "eval_merge_lora", "eval_share_prefixes", "eval_pack_lora", "eval_loss_in_prefill", "share_prefixes",
    "fused_cross_entropy", "prompt_lookup_num_tokens",
    "max_new_tokens", "pad_to_multiple_of"}


def _tokenizer(cfg: SFTConfig, source: Any, say: Say) -> tuple[str, Any]:
    with startup.phase("model conversion"), phase("model conversion"):  # GGUF: once, then a cached folder
        path = model_folder(source, log=say)
    if not cfg.no_cache and not cfg.trust_remote_code and Path(path).exists():
        startup_cache.hash_ahead(path)  # the cache key's hashes, read on another core while the model loads
    with startup.phase("tokenizer"):
        tokenizer, notes = load_tokenizer(path, source, cfg.trust_remote_code)
    for note in notes:
        say(note)
    return path, tokenizer


def _store_key(cfg: SFTConfig, data_key: Any, path: str, tokenizer: Any) -> Any | None:
    from dataclasses import asdict

    files = encoded_store.tokenizer_files(path)
    if files is None:
        return None
    return {"data": data_key, "tokenizer_files": files, "tokenizer": startup_cache.tokenizer_identity(tokenizer),
            "settings": {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_STORE_KEY},
            "code": encoded_store.code_digest()}


def load_encoded(cfg: SFTConfig, source: Any, say: Say, early: list[Problem]) -> EncodedData:
    """The run's data, encoded: read from the encoded-data cache when an identical run encoded it (the data files'
    content, the tokenizer, the template, every reading and encoding setting and the code unchanged), else read,
    split, encoded on every core and written there (``--no_cache``: encoded in memory, nothing read or written).

    The data files are hashed first; the tokenizer is loaded before the rows are read only when a store for these
    files exists, so a data problem in new data still costs seconds, not a model conversion.
    """
    use, data_key = encoded_store.store_use(cfg.no_cache, cfg.trust_remote_code, [cfg.data, cfg.val_data])
    loaded: tuple[str, Any] | None = None
    key = None
    if data_key is not None and encoded_store.has_any(data_key):
        loaded = _tokenizer(cfg, source, say)
        key = _store_key(cfg, data_key, *loaded)
        if key is not None:
            store, use = encoded_store.lookup(data_key, key, say)
            if store is not None:
                raise_with_rejected(early, [])  # the run folder's problems, found before the data
                return _from_store(cfg, store, *loaded, say)
    record = encoded_store.Recorder(say)
    streamed = None
    with startup.phase("reading data"), phase("reading data"):
        # A miss that will write the store reads a JSONL file in passes: the training rows are never all in memory
        if data_key is not None:
            streamed = stream_data(cfg, record, early)
        if streamed is None:
            train_rows, val_rows, data_report = load_data(cfg, record, early)
        else:
            train_rows, val_rows, data_report = [], streamed.val, streamed.report
    path, tokenizer = loaded or _tokenizer(cfg, source, say)
    if data_key is not None and key is None:
        key = _store_key(cfg, data_key, path, tokenizer)
        use = StoreUse("miss") if key is not None else StoreUse("not cacheable", why="the model is not a local folder")
    conversational = bool(data_report.format_conversational)
    encoder = Encoder.build(cfg, tokenizer, str(data_report.format), conversational)
    say(encoder.why)
    system_line = (encoder.system_line(train_rows + val_rows) if streamed is None else
                   encoder.system_line_of(streamed.shapes + bytes(system_shape(r) for r in val_rows)))
    if system_line:
        record(system_line)
        data_report.facts_as(TextFacts).system_prompt = {"template_default": encoder.injected, "setting": cfg.system_prompt,
                                                "line": system_line}
    val_record = encoded_store.rows_record(val_rows) if key is not None else None
    if key is not None and val_record is None:
        key, use = None, StoreUse("not cacheable", why="a validation row holds a value JSON cannot hold")
    skip = cfg.on_bad_rows == "skip"
    writer = None
    if key is not None:
        try:
            writer = StoreWriter(encoded_store.locate(data_key, key), key)
        except OSError as e:  # a cache is a speed-up: one that cannot be written costs the next run an encoding
            use = StoreUse("not cacheable", why=f"the cache cannot be written: {e}")
    if writer is None and streamed is not None:  # nothing to write the training rows to: they are held after all
        train_rows, streamed = [r for batch in streamed.batches(4096) for r in batch], None
    try:
        with startup.phase("encoding data"), phase("encoding data"):
            train_ex: list[Example] = []
            if writer is None:
                train_ex, train_rep = encoder.encode(train_rows, "train", skip)
            elif streamed is not None:
                workers = encoded_store.cores()
                # batches of whole chunks (encode_stream's contract), enough for every worker to take one
                train_rep = encoder.encode_stream(streamed.batches(STREAM_CHUNK * 2 * workers), "train", skip,
                                                  lambda a: writer.add("train", a), workers, STREAM_CHUNK)
            else:
                train_rep = encoder.encode_into(train_rows, "train", skip, lambda a: writer.add("train", a),
                                                encoded_store.cores(), STREAM_CHUNK)
            del train_rows  # the rows are in the store now: what stays in memory does not grow with them
            val_ex, val_rep = encoder.encode(val_rows, "validation", skip)
        excluded, shortened = _encoding_lines(cfg, record, train_rep, val_rep, conversational, encoder.shorter())
        data_report.encoding = {
            r.split: {k: v for k, v in r.__dict__.items() if k not in ("excluded", "rows_shortened")}
            | {"excluded": len(r.excluded)}
            for r in (train_rep, val_rep)
        }
        data_report.facts_as(TextFacts).template = encoder.why
        if writer is None:
            data = EncodedData(data_report, encoder, path, tokenizer, [e.features() for e in train_ex],
                               [len(e.input_ids) for e in train_ex], [e.num_supervised for e in train_ex],
                               lambda i: train_ex[i].row.where, val_ex, train_rep.longest_target, excluded, shortened,
                               store=use)
            _say_store(data, say)
            return data
        writer.add("validation", SplitArrays.of(val_ex))
        rec = StoreRecord(data_report, record.lines, excluded, shortened, sorted(encoder.terminators),
                          train_rep.longest_target, [e.row for e in val_ex])
        with startup.phase("encoded data write"):
            folder = writer.commit(rec)
    except OSError as e:
        if writer is None:
            raise
        writer.discard()
        say(f"note: the encoded-data cache cannot be written ({e}); the data is read and encoded again, in memory")
        data = load_encoded(replace(cfg, no_cache=True), source, lambda _: None, early)
        data.store = StoreUse("not cacheable", why=f"the cache cannot be written: {e}")
        _say_store(data, say)
        return data
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    store = EncodedStore.open(folder, key, say)
    assert store is not None, f"the encoded-data cache just written to {folder} does not check out"
    return _from_store(cfg, store, path, tokenizer, say, use=use, val_ex=val_ex, replay=False)


def stored_data(cfg: SFTConfig, source: Any, say: Say) -> EncodedData | None:
    """The encoded data of an earlier run with these settings, when the encoded-data cache holds it (a hit); ``None``
    otherwise. Never encodes nor writes (``surefit inspect`` reads a large file's examples without encoding again)."""
    if cfg.no_cache or cfg.trust_remote_code:
        return None
    data_key = encoded_store.data_identity([cfg.data, cfg.val_data])
    if data_key is None or not encoded_store.has_any(data_key):
        return None
    path, tokenizer = _tokenizer(cfg, source, say)
    key = _store_key(cfg, data_key, path, tokenizer)
    store = None if key is None else EncodedStore.open(encoded_store.locate(data_key, key), key, say)
    return None if store is None else _from_store(cfg, store, path, tokenizer, lambda _: None)


def _encoding_lines(cfg: SFTConfig, say: Say, train_rep: EncodeReport, val_rep: EncodeReport,
                    conversational: bool, shorter: str = "") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Print what encoding did (counts, excluded and shortened rows); refuse a split left empty (``shorter``: what
    makes the template shorter, :meth:`Encoder.shorter`). Returns the rows excluded and shortened, for the run
    folder's lists."""
    excluded = [{"split": r.split, "where": w, "reason": why} for r in (train_rep, val_rep) for w, why in r.excluded]
    shortened: list[dict[str, Any]] = []
    for rep in (train_rep, val_rep):
        say(rep.summary())
        if rep is train_rep and (line := getattr(rep, "thinking_line", lambda: None)()):
            say(line)
        for where, why in rep.excluded[:10]:
            say(f"  excluded {where}: {why}")
        if len(rep.excluded) > 10:
            say(f"  ... and {len(rep.excluded) - 10} more (all listed in {Path(cfg.output_dir) / EXCLUDED})")
        shortened_rows = getattr(rep, "rows_shortened", [])
        for where, n in shortened_rows[:10]:
            say(f"  shortened {where}: its oldest {n} turns dropped to fit --max_seq_length {cfg.max_seq_length}")
        if len(shortened_rows) > 10:
            say(f"  ... and {len(shortened_rows) - 10} more (all listed in {Path(cfg.output_dir) / SHORTENED})")
        shortened += [{"split": rep.split, "where": w, "turns_dropped": n} for w, n in shortened_rows]
    unit = "conversations" if conversational else "targets"
    problems = []
    for r in (train_rep, val_rep):
        if r.encoded == 0 and r.rows:
            what, fix = r.nothing_fits(cfg.max_seq_length, unit, shorter)
            problems.append(Problem(what, "--max_seq_length", fix))
    raise_if(problems, DataError)
    return excluded, shortened


def _from_store(cfg: SFTConfig, store: EncodedStore, path: str, tokenizer: Any, say: Say, use: StoreUse | None = None,
                val_ex: list[Example] | None = None, replay: bool = True) -> EncodedData:
    """The run's data from an opened store: the training examples read by position, the validation examples (and
    their rows) rebuilt in memory, and, on a hit, the lines the encoding run printed."""
    rec = StoreRecord.from_json(store.record, str(store.folder / encoded_store.HEADER))
    summary = rec.summary
    encoder = Encoder.build(cfg, tokenizer, str(summary.format), bool(summary.format_conversational))
    encoder.terminators = set(rec.terminators)
    if replay:
        for line in rec.lines:
            say(line)
        say(encoder.why)
    if val_ex is None:
        val = store.split("validation")
        if len(val) != len(rec.validation_rows):
            where = str(store.folder / encoded_store.HEADER)
            raise DataError(Problem(f"the cache holds {len(val)} validation examples, its header's record "
                                    f"{len(rec.validation_rows)} validation rows", f"{where} 'record' 'validation_rows'",
                                    encoded_store.HeaderValues({}, where).fix()))
        val_ex = []
        for i, row in enumerate(rec.validation_rows):
            f = val[i]
            val_ex.append(Example(f["input_ids"], f["labels"], len(val.prompt_ids(i)), row))
        val.close()
    train = store.split("train")
    data = EncodedData(summary, encoder, path, tokenizer, train, train.lengths, train.counts, train.where, val_ex,
                       rec.longest_target, rec.excluded, rec.shortened, identity=f"store:{store.digest}",
                       store=use or StoreUse("hit"))
    data.store.folder = str(store.folder)
    _say_store(data, say)
    return data


def _say_store(data: EncodedData, say: Say) -> None:
    """One line on what the encoded-data cache did, also saved in ``data_report.json`` (``encoded_store``)."""
    use = data.store
    n = len(data.features)
    line = {"hit": f"encoded data: {n} training examples read from the cache {use.folder} (no encoding; "
                   "--no_cache encodes again)",
            "miss": f"encoded data: {n} training examples encoded and written to the cache {use.folder} (the next run "
                    "with the same data, tokenizer and settings reads them)",
            "rebuilt": f"encoded data: the damaged cache was rebuilt, {n} training examples written to {use.folder}",
            "off": "encoded data: in memory, not cached (--no_cache)",
            "not cacheable": f"encoded data: in memory, not cached ({use.why})"}[use.status]
    say(line)
    data.summary.facts_as(TextFacts).encoded_store = use.to_json()


# ------------------------------------------------------------------------------------------------------------ prepare


def prepare(cfg: SFTConfig, say: Say = print, problems: list[Problem] | None = None) -> Prepared:
    """Everything the loop needs: rows -> encoded examples, the model with LoRA, the collator, the loss and the
    per-epoch evaluation. Nothing is written to the run folder.

    Data comes before the model: a data problem should cost seconds, not a model load. Resolving ``--model`` is
    cheap, so its problems join the data's (and ``problems``, e.g. the run folder's) in one report.
    """
    early = list(problems or [])
    try:
        source = resolve_model(cfg.model)
    except ModelError as e:
        early += e.problems
    if cfg.quantize != "none":  # a missing bitsandbytes is reported with the data's problems, before any loading
        try:
            require_bitsandbytes(cfg.quantize)
        except ConfigError as e:
            early += e.problems
    data = load_encoded(cfg, source, say, early)
    data_report, encoder, path, tokenizer, val_ex = data.summary, data.encoder, data.path, data.tokenizer, data.val_ex
    conversational = bool(data_report.format_conversational)

    with startup.phase("model load"), phase("model load"):
        model = load_model(cfg, path, source, say)
    with startup.phase("LoRA setup"):
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model, lora=cfg.lora_r > 0)
            say("gradient checkpointing on: activations are recomputed in the backward pass")
        model = apply_lora(model, cfg, "CAUSAL_LM", say)
        if cfg.lora_r:
            fuse_lora(model)  # the same weights and files; adapters summed in fp32 (training/speedups/lora_fast.py)
        seed_dropout(model)  # masks fixed by (seed, step, example): an out-of-memory split draws the same ones
    if cfg.quantize != "none":
        say(f"QLoRA: bitsandbytes dequantises the {cfg.quantize} weights at each matmul; the adapters run surefit's "
            "fused LoRA forward (in fp32, a bit mask of the dropout kept for the backward pass)")
    with startup.phase("accelerate setup"):
        accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers,
                                       project_dir=cfg.output_dir)
    # No answer longer than the longest reference needs: the validation answers are what generation is scored on
    # (a longer answer only adds tokens no reference has); + 4 for a stop token the model writes late.
    val_longest = max((len(e.input_ids) - e.prompt_len for e in val_ex), default=0)
    longest, of = (val_longest, "validation") if val_longest else (data.longest_target, "training")
    max_new = cfg.max_new_tokens or longest + 4
    why_new = ("--max_new_tokens" if cfg.max_new_tokens else
               f"the longest {of} answer, {longest} tokens with its terminator, + 4")
    generate, why_not = generates(cfg.eval_generate, cfg.max_new_tokens, val_longest)
    generating = f"eval generates up to {max_new} tokens ({why_new})" if generate else \
        f"eval computes the validation loss only ({why_not})"
    say(f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device}; {generating}")

    # Lengths padded up to a multiple (the memory plan prints it): fewer batch shapes, so a CPU run's memory stops
    # growing with each new shape (oneDNN's per-shape kernels pin glibc's heap; results/step_memory.md).
    collate = PadCollator(pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=cfg.pad_to_multiple_of)
    # Generation pads on the left (eval/generate.py does it by hand); the saved tokenizer says so too.
    tokenizer.padding_side = "left"
    features = data.features
    eos_ids = sorted(set(eos_token_ids(model, tokenizer)) | encoder.terminators)
    if encoder.terminators - set(eos_token_ids(model, tokenizer)):
        # Saved with the model: plain transformers generation then stops at the template's end of turn too.
        model.generation_config.eos_token_id = eos_ids
    metric = choose_metric(cfg, conversational)
    if generate:  # without generation only the loss is computed: no metric name to print
        say(f"metrics: {metric}" + (" (--metric auto: " + ("open-ended answers" if conversational else
                                                            "extractive answers") + ")" if cfg.metric == "auto" else ""))
    else:
        say("metrics: eval_loss only (" + ("--eval_generate false" if cfg.eval_generate is False else
                                           f"answers of {val_longest} tokens are not generated by default") +
            ": no answers are generated to score)")
    data_report.facts_as(TextFacts).stop_ids = eos_ids

    # The epochs the run takes, as the loop's bar counts them: --max_steps may end it early or run more (schedule.py).
    run_epochs = plan_schedule(n_examples=len(features), batch_size=cfg.batch_size, epochs=cfg.epochs, lr=cfg.lr,
                               max_steps=getattr(cfg, "max_steps", None)).epochs
    switches = replace(Switches.of(cfg), eval_generate=generate)

    chosen: list[GenerationBatch] = []

    def decode_rows(m: Any, batch_size: int) -> int:
        # The planner sizes generation's decode batch from memory, once, when the model sits on its device.
        if cfg.eval_generate_batch_size:
            return cfg.eval_generate_batch_size
        if not chosen:
            budget = resolve_budget(getattr(cfg, "gpu_memory_gb", None), accelerator.device)[0]
            # with prompt lookup the cache has room for as many turned-down draft columns as answer tokens
            room = max_new * (2 if switches.prompt_lookup_num_tokens else 1)
            chosen.append(generation_batch(m, [len(e.prompt_ids) + room for e in val_ex], batch_size, budget,
                                           precision_name(accelerator) in ("bf16", "fp16")))
            say(f"generation decodes up to {chosen[0].rows} rows at once, their prompts run up to {chosen[0].prefill} "
                f"at a time in parts of similar length ({chosen[0].why}); --eval_generate_batch_size N sets it")
        return chosen[0].rows

    # The evaluation before training reads the model's files, the validation examples and rows and the settings: a
    # rerun with another learning rate, seed or number of epochs reuses it (tasks/baseline_eval.py). A metric of
    # the user's own is code the key cannot hold.
    reusable = Path(path).exists() and not cfg.trust_remote_code and metric in ("squad", "rouge_l")
    baseline = BaselineReuse(None if not reusable else lambda: {
        "model": startup_cache.files_identity(path), "tokenizer": startup_cache.tokenizer_identity(tokenizer),
        "validation": startup_cache.features_digest([e.features() for e in val_ex]),
        "prompts": startup_cache.features_digest([{"prompt_ids": e.prompt_ids} for e in val_ex]),
        "rows": rows_digest([e.row for e in val_ex])})

    def evaluate(m: Any, epoch: int | float, batch_size: int) -> Evaluation:
        rows = decode_rows(m, batch_size) if generate else None
        scoring = Scoring(cfg.target_field, metric, Generation(eos_ids, max_new, batch_size, switches, rows,
                                                               prefill_by_length=not cfg.eval_generate_batch_size),
                          answer=encoder.answer_of())

        def compute() -> Evaluation:
            metrics, preds, golds = evaluate_examples(m, val_ex, tokenizer, accelerator, scoring, say)
            if not generate:
                return Evaluation(metrics, None)
            return Evaluation(metrics, prediction_records(val_ex, preds, golds, cfg.input_field, metric))

        resolved = {"batch_size": batch_size, "decode_rows": rows, "max_new_tokens": max_new, "stop_ids": eos_ids,
                    "metric": metric, "switches": asdict(switches)}
        result = baseline.evaluation(epoch, m, resolved, compute)
        metrics = result.metrics
        # The answers' scores first, then the loss (as every run has printed them)
        shown = [k for k in metrics if k != "eval_loss"] + ["eval_loss"]
        say(f"epoch {epoch}/{run_epochs}  " + "  ".join(f"{k}={metrics[k]:.4f}" for k in shown))
        return result

    base_loss = functools.partial(causal_lm_loss_sum, fused=fused_head if cfg.fused_cross_entropy else None)
    if cfg.fused_cross_entropy and (why_unfused := fused_head.why_not_fused(model)):
        say(f"fused LM head + cross-entropy: off, because {why_unfused}; the head's logits for a batch's supervised "
            "tokens are computed at once")
    sharing, train_loss = None, base_loss
    if cfg.share_prefixes:
        reason = why_not_shared(model)
        if reason:
            say(f"shared prompt prefixes: each row computes its own, because {reason}")
        else:
            sharing = PrefixSharing()
            train_loss = functools.partial(base_loss, share=sharing)

    def on_epoch(record: dict[str, Any]) -> None:
        if sharing is None:
            return
        c = sharing.take()
        rows, saved, tokens, shared, batches = (int(v) for v in sum_over_processes(
            [c["rows"], c["tokens_saved"], c["tokens"], c["shared_batches"], c["batches"]], accelerator.device))
        record.update(shared_prefix_rows=rows, shared_prefix_tokens=saved)
        if shared:
            say(f"epoch {record['epoch']}: {rows} rows reused a prompt prefix computed once for another row of their "
                f"micro-batch ({saved:,} of {tokens:,} tokens not recomputed, {saved / max(tokens, 1):.0%}; "
                f"{shared} of {batches} micro-batches); --share_prefixes false computes every row in full")

    doctor_args = {"batch_size": cfg.micro_batch_size, "max_length": cfg.max_seq_length, "generation": True}
    val_features = [e.features() for e in val_ex]
    # The doctor and the planner read the model (its files + the settings), the tokenizer and these examples; the
    # files are hashed only when the cache is used (--no_cache reads and stores nothing).
    cache_key = None if not Path(path).exists() or cfg.trust_remote_code else lambda: {
        "model": startup_cache.files_identity(path), "tokenizer": startup_cache.tokenizer_identity(tokenizer), "doctor_args": doctor_args,
        "train": data.identity or startup_cache.features_digest(features), "validation": startup_cache.features_digest(val_features),
        "stop_ids": eos_ids, "plan": {"eval_lengths": [len(e.input_ids) for e in val_ex], "max_new_tokens": max_new}}
    plan_inputs = PlanInputs(eval_lengths=[len(e.input_ids) for e in val_ex],
                             generate_lengths=[len(e.prompt_ids) + max_new for e in val_ex], lora=cfg.lora_r > 0,
                             loss_fn=base_loss)  # the planner measures with the plain loss: a shared layout is never larger
    dry_run: Callable[[Any, Any], Any] = causal_lm_dry_run
    if accelerator.device.type == "cpu" and accelerator.num_processes == 1:
        # the model trains where it sits now: the doctor's one forward counts what the planner would have
        dry_run = MeasuringDryRun(base_loss, cfg.lora_r > 0, precision_name(accelerator), accelerator.device,
                                  SavedActivationsIn, plan_inputs.measured, no_backward=fused_head.gradients_unused)
    work = TrainingWork(
        features=features, lengths=data.lengths, counts=data.counts,
        collate=collate, loss_fn=train_loss, evaluate=evaluate, on_epoch=on_epoch, counters=sharing,
        where=data.where,
        plan=plan_inputs,
        activation_store=SavedActivationsIn)
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, work=work, save=lambda m, folder: save(m, tokenizer, folder),
        # the dry run calls the model as step 1 will; on a CPU it is the planner's measurement too (plan.py)
        check=lambda: _where_it_is(model, accelerator, lambda: run_checks(Setup(
            model, tokenizer, data.doctor_sample(), val_features or None, collate, args=doctor_args, task="sft",
            call=dry_run, sample=DRY_RUN_ROWS))),
        cache_key=cache_key, baseline=baseline, found=Found(data_report, jsonl={EXCLUDED: data.excluded, SHORTENED: data.shortened}),
        saved=f"{'LoRA adapter (load with peft)' if cfg.lora_r else 'full model (load with transformers)'} and tokenizer")


# The doctor's dry run on the first row and the longest: the planner scales its measurement per token, and the
# encoder has read every row, so more rows would only make the forward before step 1 longer.
DRY_RUN_ROWS = 2


def _where_it_is(model: Any, accelerator: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` under the run's autocast for the device the model is on: frozen weights loaded in 16 bits take
    16-bit inputs, as in training (accelerate's autocast is its device's: a model still on the CPU under a GPU run
    would get none)."""
    with autocast_where(model, accelerator):
        return fn()


def frozen_dtype(cfg: SFTConfig) -> str | None:
    """The dtype frozen weights are loaded in: the 16-bit compute dtype for LoRA under mixed precision (also the
    compute dtype of quantised layers), else ``None`` (fp32)."""
    mixed = resolve_precision(cfg.precision, lora=cfg.lora_r > 0)
    return mixed if cfg.lora_r > 0 and mixed in ("bf16", "fp16") else None


def load_model(cfg: SFTConfig, path: str, source: Any, say: Say = print) -> Any:
    """The base model as it will train: frozen weights read straight into the dtype they compute in, or quantised
    (``--quantize``); says which, and the weights' size."""
    from surefit.units import human_bytes

    dtype = frozen_dtype(cfg)
    model = load_causal_lm(path, source, cfg.trust_remote_code, dtype=dtype, quantize=cfg.quantize, say=say)
    size = human_bytes(sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]))
    if cfg.quantize != "none":
        keep_4bit_trainable(model)
        kind = "4-bit nf4 with double quantisation" if cfg.quantize == "4bit" else "8-bit (LLM.int8)"
        say(f"base weights quantised to {kind} by bitsandbytes while loading ({size}), computing in "
            f"{dtype or 'fp32'}; embeddings, output layer and norms are not quantised")
    elif dtype:
        say(f"frozen weights loaded in {dtype} ({size}; no fp32 copy of the model was made), norms in fp32")
    return model


def run(cfg: SFTConfig, say: Say = print) -> RunResult:
    """Train, evaluating before the first epoch and after each one; see :func:`surefit.tasks.runner.train`."""
    return train(cfg, prepare, say)


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """``final/``: the LoRA adapter (or the full model) in safetensors, and the tokenizer."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


# ------------------------------------------------------------------------------------------------------------ evaluation


@dataclass
class Generation:
    """How answers are generated: the ids that end one, the longest, the batch of prompts run at once (halved on out
    of memory, with the decode batch), the switches (``eval_merge_lora``, ``eval_share_prefixes``, ``eval_pack_lora``; the others do not
    touch generation) and the rows decoded at once (the planner's ``generation_batch``; None: the prompts' batch)."""

    eos_token_ids: list[int]
    max_new_tokens: int
    batch_size: int
    switches: Switches = field(default_factory=Switches)
    decode_rows: int | None = None  # rows decoded at once, prompts run batch_size at a time (None: batch_size)
    # the validation loss computed in the prompts' forward: each prompt's example (input_ids, labels) and the head's
    # loss on hidden states (eval/generate.LossPass); None: generation computes the prompts alone
    loss_pass: tuple[list[dict[str, list[int]]], Callable[[Any, Any, Any], Any]] | None = None
    # prompts prefilled in parts of similar length (data/collate.length_parts); False with --eval_generate_batch_size:
    # each batch prefilled whole, the tokens of generate() on the same batches
    prefill_by_length: bool = True


@dataclass
class Decoded:
    """What :func:`generate_texts` can hand back beside the answers: each continuation's length in tokens (its
    stop token excluded) and its raw text with special tokens kept (where a template marks reasoning and answer)."""

    lengths: list[int] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    loss_sum: float = 0.0  # with Generation.loss_pass: the validation loss summed over its supervised tokens
    loss_tokens: int = 0
    drafted: int = 0  # with --prompt_lookup_num_tokens: draft tokens run, and those the model confirmed
    confirmed: int = 0


def generate_texts(model: Any, prompts: list[list[int]], tokenizer: Any, accelerator: Any, gen: Generation,
                   say: Say = print, progress: bool = False, out: Decoded | None = None) -> list[str]:
    """Greedy continuations of tokenized prompts, decoded and stripped (out of memory halves the batch).

    With ``progress`` a bar over the answers shows how far it is, with an estimate of the time left (on the main
    process, for any number of batches; one line in a log file). ``out`` receives each continuation's length in tokens
    (its stop token excluded) and its raw text. ``gen.switches.eval_merge_lora``: decode with the adapter merged into a
    temporary copy of the weights; ``eval_share_prefixes``: compute a prompt beginning several prompts share once, for
    the model families verified for it (see :func:`surefit.eval.generate.greedy_generate`); ``eval_pack_lora``: each
    LoRA layer as one packed 16-bit matmul (``training/speedups/lora_generate.packed_lora``). Otherwise the answers are
    those of the unoptimised generation, bit for bit (the adapter's lean forward and the reserved cache compute the
    same numbers)."""

    # Any number of batches, one included: a single batch of long answers can take minutes. A bar with the time left
    # on a terminal, one line in a log file (eval/progress.py).
    # With the loss computed in the prompts' forward the bar (and --profile's part) covers both.
    bar = Progress("generating" if gen.loss_pass is None else "evaluating", total=len(prompts), unit="answer",
                   enabled=progress and is_main_process())
    inner = accelerator.unwrap_model(model)
    stats: dict[str, int] = {}
    passes: list[LossPass] = []
    # Drafts are confirmed in a forward whose mask has holes (the drafts turned down): the families verified for that
    lookup_tokens = gen.switches.prompt_lookup_num_tokens
    if lookup_tokens and why_not_shared(inner) is not None:
        _say_once(inner, f"--prompt_lookup_num_tokens: not used for this model ({why_not_shared(inner)}); answers are "
                  "decoded one token per step", say)
        lookup_tokens = 0

    def loss_pass() -> LossPass | None:
        # a fresh sum for each try: out of memory starts the generation again with a smaller batch
        passes[:] = [] if gen.loss_pass is None else [LossPass(*gen.loss_pass)]
        return passes[0] if passes else None

    with bar:
        generated = shrink_on_oom(
            lambda bs: greedy_generate(
                inner,
                prompts,
                Decode(pad_token_id=tokenizer.pad_token_id, eos_token_ids=gen.eos_token_ids,
                       max_new_tokens=gen.max_new_tokens, prefill_batch=bs, merge_lora=gen.switches.eval_merge_lora,
                       # out of memory halves the prompts' batch and the decode batch alike
                       batch_size=max(bs, (gen.decode_rows or gen.batch_size) * bs // gen.batch_size),
                       share_prefixes=gen.switches.eval_share_prefixes and why_not_shared(inner) is None,
                       loss_pass=loss_pass(), lookup_tokens=lookup_tokens,
                       prefill_by_length=gen.prefill_by_length),
                device=accelerator.device,
                autocast=accelerator.autocast,
                progress=lambda done, total: bar.set(done),
                lora_context=packed_lora if gen.switches.eval_pack_lora else lean_lora,
                stats=stats,
            ),
            gen.batch_size,
            "generation",
            say,
        )
    if stats.get("window_rows"):
        used = [f for f, on in (("--eval_share_prefixes", gen.switches.eval_share_prefixes),
                                ("--prompt_lookup_num_tokens", lookup_tokens)) if on]
        _say_once(inner, f"{' and '.join(used)}: not used for {stats['window_rows']} of {len(prompts)} answers: their "
                  f"prompt and answer can pass the model's sliding window ({stats['window']} tokens), which the gaps "
                  "these leave in the KV cache would move; those were generated from whole prompts, one token per "
                  "step (the same answers, slower)", say)
    if out is not None and stats.get("drafted"):
        out.drafted, out.confirmed = out.drafted + stats["drafted"], out.confirmed + stats["confirmed"]
    if stats.get("merge_out_of_memory"):
        say("out of memory while merging the LoRA adapter into a copy of the weights for generation: generated "
            "with the adapter applied as in training instead (slower; --eval_merge_lora false skips the attempt)")
    if stats.get("lora_out_of_memory"):
        say("out of memory while packing the LoRA layers' weights for generation: generated with the adapter applied "
            "as in training instead (slower; --eval_pack_lora false skips the attempt)")
    if out is not None and passes:
        out.loss_sum, out.loss_tokens = passes[0].loss_sum, passes[0].tokens
    if out is not None:
        out.lengths += [len(g) for g in generated]
        out.raw += [tokenizer.decode(g, skip_special_tokens=False) for g in generated]
    return [tokenizer.decode(g, skip_special_tokens=True).strip() for g in generated]


@dataclass
class Scoring:
    """How an evaluation scores: the gold answers' field, the metric (``--metric``, resolved) and how answers are
    generated (with the run's switches: ``share_prefixes`` and ``fused_cross_entropy`` compute the loss as training
    does, ``eval_generate`` false scores the loss only)."""

    target_field: str
    metric: str
    generation: Generation
    answer: Callable[[str], str] | None = None  # a reasoning template: the answer part of a raw generation


# Models for which something asked was not used, and said so once (a run evaluates many times).
_said: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _say_once(model: Any, text: str, say: Say) -> None:
    seen = _said.setdefault(model, set())
    if text not in seen:
        seen.add(text)
        say(text)


# Models whose cache or logits ruled out the loss in the prompts' forward (said once, then two passes every time).
_no_loss_in_prefill: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _loss_in_prefill(model: Any, examples: list[Example], scoring: Scoring, accelerator: Any, say: Say) -> tuple[
        list[dict[str, list[int]]], Callable[[Any, Any, Any], Any]] | None:
    """``Generation.loss_pass`` for this evaluation where ``--eval_loss_in_prefill`` holds and nothing rules it out
    (loss only, no answer tokens, merged or packed adapters, shared prompt prefixes, a model whose logits or cache
    it cannot handle); else None: the loss pass and the prompts' forward run apart."""
    gen = scoring.generation
    sw = gen.switches
    inner = accelerator.unwrap_model(model)
    if not (sw.eval_generate and sw.eval_loss_in_prefill) or gen.max_new_tokens <= 0 or sw.eval_pack_lora \
            or inner in _no_loss_in_prefill:
        return None
    if fused_head.softcap_of(inner) is not None:  # found at the first batch too; known before, so no bar breaks off
        _two_passes(inner, "the model soft-caps its logits after the LM head", say)
        return None
    if other_layer_kinds(inner):  # the same: found at the first batch, known from the config
        _two_passes(inner, f"its {', '.join(other_layer_kinds(inner))} layers keep states the prompts' cache cannot be "
                    "cut from", say)
        return None
    features = [e.features() for e in examples]
    share = sw.eval_share_prefixes and why_not_shared(inner) is None
    if why_no_loss_pass(inner, [e.prompt_ids for e in examples], features, merge_lora=sw.eval_merge_lora,
                        share_prefixes=share) is not None:
        return None
    fused = sw.fused_cross_entropy and fused_head.why_not_fused(inner) is None
    return features, functools.partial(head_loss, fused=fused)


def _two_passes(model: Any, why: str, say: Say) -> None:
    """Remember that this model's evaluations compute the loss and the prompts apart, and say so once."""
    _no_loss_in_prefill[model] = why
    say(f"evaluation: the validation loss and the prompts are computed in two passes for this model ({why}), not "
        "in one (--eval_loss_in_prefill)")


def head_loss(model: Any, hidden: Any, targets: Any, *, fused: bool) -> Any:
    """The LM head and the cross-entropy summed over ``hidden`` (``[n, H]``, the head's input at supervised positions):
    the fused head's chunks where the loss pass uses them, else the head in chunks of logits."""
    import torch.nn.functional as F

    head = inner_model(model).get_output_embeddings()
    if fused:
        return fused_head.fused_linear_cross_entropy(hidden, head.weight, head.bias, targets,
                                                     chunk_values=fused_head.FUSED_CHUNK_VALUES)
    step = max(1, 2**24 // head.out_features)  # at most 16 M logits at a time
    return sum(F.cross_entropy(head(hidden[i : i + step]).float(), targets[i : i + step], reduction="sum")
               for i in range(0, hidden.shape[0], step))


def evaluate_examples(model: Any, examples: list[Example], tokenizer: Any, accelerator: Any, scoring: Scoring,
                      say: Say = print) -> tuple[dict[str, float], list[str], list[list[str]]]:
    """Validation loss (per supervised token) and, with ``eval_generate``, SQuAD F1 / exact match (normalised) and
    ROUGE-L of greedy generations against the gold answers (a conversation's gold is its last assistant turn).

    Used after every epoch of training and by ``surefit eval``, so both report the same numbers. With
    ``share_prefixes`` the loss computes prompt prefixes that rows of a batch share once, as training does (the
    same loss; see :mod:`surefit.training.speedups.prefixes`); ``fused_cross_entropy`` runs the LM head and the loss
    fused (the same loss). Generation: :func:`generate_texts`.

    Returns:
        ``({"eval_loss", "eval_f1", "eval_em", "eval_rouge_l"}, predictions, gold answers per example)``.
    """
    gen = scoring.generation
    switches, batch_size = gen.switches, gen.batch_size
    prompts = [e.prompt_ids for e in examples]
    fused = _loss_in_prefill(model, examples, scoring, accelerator, say)
    if fused is not None:
        out = Decoded()
        try:
            preds = generate_texts(model, prompts, tokenizer, accelerator, replace(gen, loss_pass=fused), say,
                                   progress=True, out=out)
            loss = out.loss_sum / max(out.loss_tokens, 1)
        except LossPassUnfit as e:
            _two_passes(accelerator.unwrap_model(model), str(e), say)
            fused = None
    if fused is None:
        collate = PadCollator(pad_token_id=tokenizer.pad_token_id)
        share = switches.share_prefixes and why_not_shared(model) is None
        # The adapted layers' lean forward: the same numbers, fewer operations, a new adapter's zero term skipped
        with Progress("evaluation loss", enabled=is_main_process()), lean_lora(accelerator.unwrap_model(model)):
            loss = evaluate_loss(
                model,
                [e.features() for e in examples],
                [len(e.input_ids) for e in examples],
                loss_fn=functools.partial(causal_lm_loss_sum, share=PrefixSharing() if share else None,
                                          fused=fused_head if switches.fused_cross_entropy else None),
                collate=collate,
                batch_size=batch_size,
                accelerator=accelerator,
                say=say,
            )
        if not switches.eval_generate:
            return {"eval_loss": loss}, [], []
        out = Decoded()
        preds = generate_texts(model, prompts, tokenizer, accelerator, gen, say, progress=True, out=out)
    if out.drafted:
        say(f"prompt lookup: {out.confirmed:,} of {out.drafted:,} draft tokens confirmed "
            f"({out.confirmed / out.drafted:.0%}; answers {sum(out.lengths):,} tokens)")
    if scoring.answer is not None:  # a reasoning template: the metrics score the answer, not the reasoning before it
        preds = [scoring.answer(r) for r in out.raw]
    golds = [_golds(e.row, scoring.target_field) for e in examples]
    return {"eval_loss": loss, **score(scoring.metric, preds, golds)}, preds, golds


# --eval_generate's default generates answers of at most this many tokens: each generated token is a decode step over
# the whole model, so long answers (chat, instructions) make the evaluation cost about what training does
# (docs/performance.md), for a score of a few greedy continuations.
GENERATE_AUTO_TOKENS = 64


def generates(asked: bool | None, max_new_tokens: int | None, longest_answer: int) -> tuple[bool, str]:
    """Whether evaluations generate answers, and why not (in the run's words) when they do not.

    ``asked``: ``--eval_generate`` (None: the default); ``longest_answer``: the longest validation answer in tokens
    with its terminator (0 without validation examples)."""
    if asked is not None:
        return asked, "" if asked else "--eval_generate false"
    if max_new_tokens or longest_answer <= GENERATE_AUTO_TOKENS:
        return True, ""
    return False, (f"the validation answers run to {longest_answer} tokens, above the {GENERATE_AUTO_TOKENS} the "
                   "default generates: --eval_generate true generates and scores them, each answer token a decode step "
                   "over the whole model")


def choose_metric(cfg: SFTConfig, conversational: bool) -> str:
    """``--metric``, with 'auto' resolved: SQuAD F1 / EM for input -> target rows, ROUGE-L / EM for conversations."""
    if cfg.metric != "auto":
        return cfg.metric
    return "rouge_l" if conversational else "squad"


def score(metric: str, preds: list[str], golds: list[list[str]]) -> dict[str, float]:
    """The metrics of one evaluation, named ``eval_*``. A ``module:function`` metric is the user's own code,
    imported only because they named it in --metric."""
    scores = squad_scores(preds, golds)
    if metric == "squad":
        return {"eval_f1": scores["f1"], "eval_em": scores["em"]}
    if metric == "rouge_l":
        rouge = sum(max(rouge_l(p, g) for g in gs) for p, gs in zip(preds, golds, strict=True)) / len(preds)
        return {"eval_rouge_l": rouge, "eval_em": scores["em"]}
    from surefit.models import import_user_module

    module, _, name = metric.rpartition(":")
    try:
        fn = getattr(import_user_module(module, prefix="surefit_user_metric_"), name)
        out = fn(preds, [g[0] for g in golds])
    except (ImportError, AttributeError, FileNotFoundError) as e:
        raise ConfigError(Problem(f"cannot load metric {metric!r}: {e}", "--metric",
                                  "name an importable module:function (predictions, references) -> dict")) from e
    if not isinstance(out, dict):
        raise ConfigError(Problem(f"metric {metric!r} returned a {type(out).__name__}, not a dict", "--metric"))
    return {k if k.startswith("eval_") else f"eval_{k}": float(v) for k, v in out.items()}


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS and those of the model's generation config."""
    return sorted({tokenizer.eos_token_id} | _extra_eos(model))


def _extra_eos(model: Any) -> set[int]:
    """EOS ids from the model's generation config (chat models often end turns with a second token)."""
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, list) else {int(ids)}


def prediction_records(examples: list[Example], preds: list[str], golds: list[list[str]],
                       input_field: str, metric: str = "squad") -> list[dict[str, Any]]:
    """Per example: where it came from, input, gold answers, prediction, and its scores under the run's metric,
    named as computed (``f1``/``em`` for squad, ``rouge_l``/``em`` for rouge_l; none for a user's own metric, which
    scores the whole set) (``predictions/epoch_N.jsonl``)."""
    out = []
    for ex, pred, gold in zip(examples, preds, golds, strict=True):
        record: dict[str, Any] = {"where": ex.row.where, "input": prediction_input(ex.row, input_field), "gold": gold,
                                  "prediction": pred}
        if metric == "squad":
            record["f1"] = max(token_f1(pred, g) for g in gold)
        elif metric == "rouge_l":
            record["rouge_l"] = max(rouge_l(pred, g) for g in gold)
        if metric in ("squad", "rouge_l"):
            record["em"] = max(exact_match(pred, g) for g in gold)
        out.append(record)
    return out


def prediction_input(row: Row, input_field: str) -> Any:
    """What a prediction answers: a flat row's input, or a conversation's last user (or tool) turn."""
    messages = row.fields.get("messages")
    if isinstance(messages, list):
        return next((m["content"] for m in reversed(messages) if m["role"] in ("user", "tool")), "")
    return row.fields[input_field]
