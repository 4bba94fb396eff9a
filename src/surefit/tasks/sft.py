"""Instruction tuning of a causal LM on input -> target rows: data -> encoding -> model -> loop -> final/, top to bottom.

The correctness-critical pieces live in library code shared by every task: encoding builds the labels once
(``data/encode.py``), the collator only pads (``data/collate.py``), the loop normalises the loss by supervised tokens
(``training/loop.py``), checkpoints are atomic (``training/checkpoint.py``). This file wires them together, reports in
counts everything that happened to the data, and reads back the ``final/`` it writes (``load``, ``evaluate``,
``predict``, ``export``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from surefit.config import SFTConfig
from surefit.data.augment import augment_rows
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
from surefit.data.formats import (
    FormatChoice,
    apply_template,
    detect_format,
    field_table,
    fill_template,
    last_assistant,
    parse_role_map,
    template_fields,
    to_conversations,
)
from surefit.data.readers import Rejected, check_text_fields, read_checked, read_splits
from surefit.data.rows import Row
from surefit.data.split import leaked, normalize_key, split_or_check
from surefit.doctor import check
from surefit.errors import ConfigError, DataError, ModelError, Problem, raise_if, raise_input_problems
from surefit.eval.generate import greedy_generate
from surefit.eval.metrics import exact_match, rouge_l, squad_scores, token_f1
from surefit.models import ModelSource, apply_lora, load_causal_lm, load_tokenizer, model_folder, resolve_model
from surefit.run_folder import EXCLUDED, Run
from surefit.tasks.common import Evaluation, Loaded, Prepared, chunks, render_columns, rows_from_texts, train
from surefit.training.distributed import sum_over_processes
from surefit.training.dropout import seed_dropout
from surefit.training.loop import evaluate_loss
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.memory import enable_gradient_checkpointing, shrink_on_oom
from surefit.training.precision import make_accelerator, precision_name, store_frozen_in
from surefit.training.speedups.lora_fast import fuse_lora
from surefit.training.speedups.prefixes import PrefixSharing, why_not_shared

Say = Callable[[str], None]
# The column flags of an sft run (``surefit eval`` / ``predict`` take them for other data).
FIELDS = ("input_field", "target_field")
# What ``final/`` holds: a LoRA adapter, or a full model.
FINAL_FILES = [("adapter_config.json",), ("config.json",)]


def final_files(cfg: SFTConfig) -> list[tuple[str, ...]]:
    """The alternatives of what ``final/`` holds (any one of them)."""
    return FINAL_FILES


# ------------------------------------------------------------------------------------------------------------ data


def _read_formatted(rows: list[Row], cfg: SFTConfig, source: str, problems: list[Problem],
                    rejects: list[Rejected] | None, wanted: str | None = None) -> tuple[list[Row], FormatChoice | None,
                                                                                     list[str]]:
    """Rows of one file in the internal form of their format (detected, or ``wanted``), every row checked.

    Rows of no known shape are read as input/target rows, so that the problems name the missing field, what the rows
    have instead, and the shapes read without flags. Returns ``(rows, format, notes)``.
    """
    role_map, role_problems = parse_role_map(cfg.role_map)
    if wanted is None:  # once per run: the training file's read
        problems += role_problems
    choice = detect_format(rows, source, wanted or cfg.format, cfg.input_field, cfg.target_field, role_map,
                           needs_input=not prerendered(cfg))
    if isinstance(choice, Problem):
        # No known shape: the flat fields' own problems say which field is missing and what the rows have instead.
        choice = detect_format(rows, source, "input_target", cfg.input_field, cfg.target_field)
        found = len(problems)
        rows, _, notes = _read_formatted(rows, cfg, source, problems, rejects, "input_target")
        problems[found:] = [replace(p, fix=p.fix + FORMAT_HINT) if p.where in ("--input_field", "--target_field")
                            else p for p in problems[found:]]
        return rows, choice, notes
    if choice.conversational:
        rows = to_conversations(rows, choice, source, problems, rejects)
        if cfg.template and choice.name == "alpaca":
            rows, notes = apply_template(rows, cfg.template, choice, cfg.input_field, source, problems)
            return rows, choice, notes
        if cfg.template:
            problems.append(Problem(f"--template writes the prompt of input/target and Alpaca rows; the turns of "
                                    f"{choice.name} rows are written by the chat template", "--template",
                                    "drop --template (or --chat_format NAME|FILE.jinja to change the chat template)"))
        return rows, choice, []
    fields = [(cfg.input_field, "--input_field"), (cfg.target_field, "--target_field")]
    if choice.name == "prompt_completion":
        fields = [("prompt", "--format"), ("completion", "--format")]
    if prerendered(cfg):  # the template's fields are the prompt: the input field may be absent or empty
        fields = fields[1:]
        names = template_fields(cfg.template)
        choice.fields = " / ".join([*names, fields[0][0]])
        choice.mapping = f"--template fills the prompt from {', '.join(names)}; {fields[0][0]} -> trained answer"
    kept, notes = check_text_fields(rows, fields, problems, source, rejects=rejects)
    if choice.name == "prompt_completion":
        kept = [r.with_fields(**{cfg.input_field: r.fields["prompt"], cfg.target_field: r.fields["completion"]})
                for r in kept]
    if prerendered(cfg):
        kept, more = apply_template(kept, cfg.template, choice, cfg.input_field, source, problems)
        notes += more
    return kept, choice, notes


def prerendered(cfg: SFTConfig) -> bool:
    """A --template naming fields other than {input} is filled per row while reading (see
    :func:`surefit.data.formats.apply_template`); one with only {input} is split around it as it always was."""
    return bool(cfg.template) and template_fields(cfg.template) != ["input"]


FORMAT_HINT = ("; or give the rows a shape surefit reads without field flags: 'messages', 'conversations', "
               "'instruction' + 'output', 'prompt' + 'completion' (see --format)")


def conversation_key(row: Row, input_field: str) -> str:
    """What makes two rows the same example for the split and the leakage check: a conversation's user turns (and
    system prompt) as a whole, or a flat row's input."""
    messages = row.fields.get("messages")
    if isinstance(messages, list):
        return normalize_key(" \n ".join(m["content"] for m in messages if m["role"] in ("system", "user")))
    return normalize_key(str(row.fields[input_field]))


def _augment_conversations(rows: list[Row], factor: int, seed: int) -> tuple[list[Row], Any]:
    """Augment a conversation's last user turn only: assistant text (what is trained) is never changed."""
    field_name = "\u2063user"

    def last_user(r: Row) -> int:
        return max(i for i, m in enumerate(r.fields["messages"]) if m["role"] == "user")

    staged = [r.with_fields(**{field_name: r.fields["messages"][last_user(r)]["content"]}) for r in rows]
    out, stats = augment_rows(staged, factor, seed, field_name)
    rebuilt = []
    for r in out:
        messages = [dict(m) for m in r.fields["messages"]]
        messages[last_user(r)]["content"] = r.fields[field_name]
        fields = {k: v for k, v in r.fields.items() if k != field_name}
        rebuilt.append(replace(r, fields={**fields, "messages": messages}))
    return rebuilt, stats


def load_data(cfg: SFTConfig, say: Say = print, problems: list[Problem] | None = None,
              on_rejected: Callable[[list[Rejected]], None] | None = None) -> tuple[list[Row], list[Row], dict[str, Any]]:
    """Read, detect the format, check, split (before augmentation) and augment. Every problem in every file is
    reported at once.

    Args:
        problems: problems already found (e.g. with ``--output_dir``), reported together with the data's.
        on_rejected: given the rows dropped under ``--on_bad_rows skip`` before any problem is raised (so that an
            "all rows rejected" problem can point at the file they were written to).

    Returns:
        ``(train_rows, val_rows, report)``; ``report`` holds the counts printed to the user and saved, the format
        (``report["format"]``) and what became of each field (``report["field_table"]``).
    """
    problems = list(problems or [])
    report: dict[str, Any] = {"notes": []}
    rejects: list[Rejected] | None = [] if cfg.on_bad_rows == "skip" else None
    loaded = read_splits(cfg.data, cfg.val_data, cfg.limit, problems, rejects, report["notes"])
    choice: FormatChoice | None = None
    table: list[dict[str, str]] = []
    for name, path in (("train", cfg.data), ("validation", cfg.val_data)):
        if loaded.get(name):
            raw = loaded[name]
            before = len(rejects or [])
            loaded[name], found, notes = _read_formatted(raw, cfg, str(path), problems, rejects,
                                                        choice.name if choice else None)
            report["notes"] += notes
            if found is not None and choice is None:
                choice = found
                named = tuple(template_fields(cfg.template)) if cfg.template else ()
                table = field_table(raw, found, named)
            if found is not None and found.conversational and rejects is not None and raw and not loaded[name]:
                problems.append(Problem(f"all {len(raw)} rows of {path} were rejected (first: {rejects[before].where}: "
                                        f"{rejects[before].reason})", str(path), "fix the rows (see the rejected rows "
                                        "file)"))
    if rejects and on_rejected is not None:
        on_rejected(rejects)
    report["rejected_rows"] = len(rejects or [])
    raise_input_problems(problems)
    assert choice is not None
    report["format"] = choice.name
    report["format_conversational"] = choice.conversational
    report["field_table"] = table
    say(choice.line())
    say("fields of the rows:\n" + render_columns(table))

    key = lambda r: conversation_key(r, cfg.input_field)  # noqa: E731
    train_rows, val, notes = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction, cfg.seed,
                                            key, "conversation" if choice.conversational else "input")
    report["notes"] += notes
    # Augment AFTER the split and only the training side: a variant of a validation row in training is a leak.
    if choice.conversational:
        train_rows, stats = _augment_conversations(train_rows, cfg.augmentation_factor, cfg.seed)
    else:
        train_rows, stats = augment_rows(train_rows, cfg.augmentation_factor, cfg.seed, cfg.input_field)
    report["notes"].append(stats.summary())
    if not cfg.val_data:
        assert not leaked(train_rows, val, key), "split/augment invariant broken: a validation row leaked into training"
    report.update(train_rows=len(train_rows), val_rows=len(val), augmentation=stats.__dict__)
    for note in report["notes"]:
        say(note)
    return train_rows, val, report


def _golds(row: Row, target_field: str) -> list[str]:
    if isinstance(row.fields.get("messages"), list):
        return [last_assistant(row.fields["messages"])]
    answers = row.fields.get("answers")
    if isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers):
        return answers
    return [str(row.fields[target_field])]


def _encode_settings(cfg: SFTConfig, input_field: str | None = None, target_field: str | None = None) -> dict:
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

    @classmethod
    def build(cls, cfg: SFTConfig, tokenizer: Any, format_name: str, conversational: bool) -> Encoder:
        """Choose the template: ``--chat_format``, else the model's own chat template (unless ``--chat_template
        false``); flat rows take ``--template`` first, string prompt / completion rows no template at all."""
        chat, why = resolve_chat_template(tokenizer, cfg.chat_template, cfg.chat_format)
        if conversational:
            if chat is None:
                raise ConfigError(Problem(
                    f"the rows are conversations ({format_name}) and need a chat template, but {why}",
                    "--chat_format", "pass --chat_format chatml (or llama3, gemma, or a Jinja file); it is saved with "
                    "the tokenizer so that inference formats prompts the same way"))
            return cls(cfg, tokenizer, why, chat=chat)
        if cfg.template:
            return cls(cfg, tokenizer, "prompt template: --template",
                       prompt=build_prompt_format(tokenizer, "{input}" if prerendered(cfg) else cfg.template))
        if format_name == "prompt_completion":
            return cls(cfg, tokenizer, "prompt template: none (prompt / completion rows: the prompt as written)",
                       prompt=build_prompt_format(tokenizer, "{input}"))
        if chat is not None or cfg.chat_template:
            return cls(cfg, tokenizer, why + ", one user turn per row",
                       prompt=build_prompt_format(tokenizer, chat_template=True))
        return cls(cfg, tokenizer, why, prompt=build_prompt_format(tokenizer))

    def encode(self, rows: list[Row], split: str, skip: bool = False,
               on_rejected: Callable[[list[Rejected]], None] | None = None) -> tuple[list[Example], EncodeReport]:
        """Examples and the report of one split. A row the chat template cannot label is an error (or, with
        ``--on_bad_rows skip``, excluded and listed)."""
        if self.chat is None:
            return encode_rows(rows, self.tokenizer, self.prompt, split=split, **_encode_settings(self.cfg))
        settings = ChatEncodeSettings(self.cfg.max_seq_length, self.cfg.train_on, self.cfg.truncation)
        examples, report, failures, terminators = encode_conversations(rows, self.tokenizer, self.chat, settings, split)
        self.terminators |= terminators
        if failures and not skip:
            shown = "; ".join(f"{w}: {why}" for w, why in failures[:5])
            more = f" and {len(failures) - 5} more" if len(failures) > 5 else ""
            raise DataError(Problem(f"{len(failures)} {split} row{'s' if len(failures) != 1 else ''} cannot be rendered and labelled by position with "
                                    f"the chat template: {shown}{more}", "--chat_format",
                                    "use a chat template that renders these conversations, and whose render of a "
                                    "conversation's start is the start of its full render (e.g. --chat_format chatml), "
                                    "or pass --on_bad_rows skip to exclude these rows (listed)"))
        report.excluded += failures
        return examples, report

    def prompt_ids(self, row: Row, room: int) -> tuple[list[int], int]:
        """Generation prompt of a row and how many tokens were cut from it: a conversation continues with the next
        assistant turn (oldest exchanges dropped to fit ``room``); a flat row's input is cut as in training."""
        if self.chat is None:
            [ids], [cut] = encode_prompts([str(row.fields[self.cfg.input_field])], self.tokenizer, self.prompt,
                                          max_prompt_length=room, truncation_side=self.cfg.truncation_side)
            return ids, cut
        messages = list(row.fields["messages"])
        while messages and messages[-1]["role"] == "assistant":  # predict the last answer again
            messages.pop()
        ids = chat_prompt(self.tokenizer, self.chat, messages, row.fields.get("tools"))
        full = len(ids)
        while len(ids) > room:
            start = 1 if messages[0]["role"] == "system" else 0
            nxt = next((j for j in range(start + 1, len(messages)) if messages[j]["role"] == "user"), None)
            if nxt is None:
                break
            messages = messages[:start] + messages[nxt:]
            ids = chat_prompt(self.tokenizer, self.chat, messages, row.fields.get("tools"))
        return ids, full - len(ids)


# ------------------------------------------------------------------------------------------------------------ prepare


def prepare(cfg: SFTConfig, say: Say = print, problems: list[Problem] | None = None,
            on_rejected: Callable[[list[Rejected]], None] | None = None) -> Prepared:
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
    train_rows, val_rows, data_report = load_data(cfg, say, early, on_rejected)
    path = model_folder(source, log=say)
    tokenizer, notes = load_tokenizer(path, source, cfg.trust_remote_code)
    for note in notes:
        say(note)
    conversational = data_report["format_conversational"]
    encoder = Encoder.build(cfg, tokenizer, data_report["format"], conversational)
    say(encoder.why)
    train_ex, train_rep = encoder.encode(train_rows, "train", cfg.on_bad_rows == "skip", on_rejected)
    val_ex, val_rep = encoder.encode(val_rows, "validation", cfg.on_bad_rows == "skip", on_rejected)
    excluded = [{"split": r.split, "where": w, "reason": why} for r in (train_rep, val_rep) for w, why in r.excluded]
    for rep in (train_rep, val_rep):
        say(rep.summary())
        for where, why in rep.excluded[:10]:
            say(f"  excluded {where}: {why}")
        if len(rep.excluded) > 10:
            say(f"  ... and {len(rep.excluded) - 10} more (all listed in {Path(cfg.output_dir) / EXCLUDED})")
        for where, n in getattr(rep, "rows_shortened", [])[:10]:
            say(f"  shortened {where}: its oldest {n} turns dropped to fit --max_seq_length {cfg.max_seq_length}")
    too_long = "conversations are longer" if conversational else "targets are longer"
    raise_if([Problem(f"no {r.split} rows left after encoding: all {r.rows} {too_long} than "
                      "--max_seq_length allows", "--max_seq_length",
                      f"raise --max_seq_length (now {cfg.max_seq_length}) or shorten the rows")
              for r in (train_rep, val_rep) if r.encoded == 0 and r.rows], DataError)
    data_report["encoding"] = {
        r.split: {k: v for k, v in r.__dict__.items() if k not in ("excluded", "rows_shortened")}
        | {"excluded": len(r.excluded)}
        for r in (train_rep, val_rep)
    }
    data_report["template"] = encoder.why

    model = load_causal_lm(path, source, cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, lora=cfg.lora_r > 0)
        say("gradient checkpointing on: activations are recomputed in the backward pass")
    model = apply_lora(model, cfg, "CAUSAL_LM", say)
    if cfg.lora_r:
        fuse_lora(model)  # the same weights and files; adapters summed in fp32 (training/speedups/lora_fast.py)
    seed_dropout(model)  # masks fixed by (seed, step, example): an out-of-memory split draws the same ones
    accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers,
                                   project_dir=cfg.output_dir)
    max_new = cfg.max_new_tokens or train_rep.longest_target + 4
    why_new = ("--max_new_tokens" if cfg.max_new_tokens else
               f"the longest training answer, {train_rep.longest_target} tokens with its terminator, + 4")
    generating = f"eval generates up to {max_new} tokens ({why_new})" if cfg.eval_generate else \
        "eval computes the validation loss only (--eval_generate false)"
    say(f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device}; {generating}")

    collate = PadCollator(pad_token_id=tokenizer.pad_token_id)
    # Generation pads on the left (eval/generate.py does it by hand); the saved tokenizer says so too.
    tokenizer.padding_side = "left"
    features = [e.features() for e in train_ex]
    eos_ids = sorted(set(eos_token_ids(model, tokenizer)) | encoder.terminators)
    if encoder.terminators - set(eos_token_ids(model, tokenizer)):
        # Saved with the model: plain transformers generation then stops at the template's end of turn too.
        model.generation_config.eos_token_id = eos_ids
    metric = choose_metric(cfg, conversational)
    say(f"metrics: {metric}" + (" (--metric auto: " + ("open-ended answers" if conversational else
                                                        "extractive answers") + ")" if cfg.metric == "auto" else ""))
    data_report["stop_ids"] = eos_ids

    def evaluate(m: Any, epoch: int, batch_size: int) -> Evaluation:
        metrics, preds, golds = evaluate_examples(m, val_ex, tokenizer, target_field=cfg.target_field,
                                                  eos_token_ids=eos_ids, max_new_tokens=max_new, batch_size=batch_size,
                                                  accelerator=accelerator, say=say, share_prefixes=cfg.share_prefixes,
                                                  generate=cfg.eval_generate, metric=metric)
        # The answers' scores first, then the loss (as every run has printed them)
        shown = [k for k in metrics if k != "eval_loss"] + ["eval_loss"]
        say(f"epoch {epoch}/{cfg.epochs}  " + "  ".join(f"{k}={metrics[k]:.4f}" for k in shown))
        if not cfg.eval_generate:
            return Evaluation(metrics, None)
        return Evaluation(metrics, prediction_records(val_ex, preds, golds, cfg.input_field))

    sharing, train_loss = None, causal_lm_loss_sum
    if cfg.share_prefixes:
        reason = why_not_shared(model)
        if reason:
            say(f"shared prompt prefixes: each row computes its own, because {reason}")
        else:
            sharing = PrefixSharing()
            train_loss = functools.partial(causal_lm_loss_sum, share=sharing)

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
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, features=features,
        lengths=[len(e.input_ids) for e in train_ex], counts=[e.num_supervised for e in train_ex], collate=collate,
        loss_fn=train_loss, evaluate=evaluate, save=lambda m, folder: save(m, tokenizer, folder),
        check=lambda: check(model, tokenizer, features, [e.features() for e in val_ex] or None, collate, args=doctor_args,
                            task="sft"),
        data_report=data_report, jsonl={EXCLUDED: excluded},
        plan={"eval_lengths": [len(e.input_ids) for e in val_ex],
              "generate_lengths": [len(e.prompt_ids) + max_new for e in val_ex], "lora": cfg.lora_r > 0,
              # the planner measures with the plain loss: a shared layout is never larger
              "loss_fn": causal_lm_loss_sum},
        saved=f"{'LoRA adapter (load with peft)' if cfg.lora_r else 'full model (load with transformers)'} and tokenizer",
        on_epoch=on_epoch, counters=sharing, rejected=data_report["rejected_rows"], where=lambda i: train_ex[i].row.where)


def run(cfg: SFTConfig, say: Say = print) -> dict[str, Any]:
    """Train, evaluating before the first epoch and after each one; see :func:`surefit.tasks.common.train`."""
    return train(cfg, prepare, say)


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """``final/``: the LoRA adapter (or the full model) in safetensors, and the tokenizer."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


# ------------------------------------------------------------------------------------------------------------ evaluation


def generate_texts(model: Any, prompts: list[list[int]], tokenizer: Any, *, eos_token_ids: list[int],
                   max_new_tokens: int, batch_size: int, accelerator: Any, say: Say = print,
                   progress: bool = False, lengths: list[int] | None = None) -> list[str]:
    """Greedy continuations of tokenized prompts, decoded and stripped (out of memory halves the batch).

    With ``progress`` a bar over the generation batches shows how far it is, with an estimate of the time left (on
    the main process, when there is more than one batch). ``lengths`` (a list) receives each continuation's length in
    tokens, its stop token excluded."""
    import sys

    from tqdm.auto import tqdm

    from surefit.training.distributed import is_main_process

    bar = None
    if progress and len(prompts) > batch_size:
        # As the training bar: in a log file (not a terminal) redrawn at most every 30 s.
        bar = tqdm(total=len(prompts), desc="generating", unit="answer", dynamic_ncols=True,
                   mininterval=0.5 if sys.stderr.isatty() else 30.0, disable=not is_main_process())

    def show(done: int, total: int) -> None:
        bar.update(done - bar.n)

    generated = shrink_on_oom(
        lambda bs: greedy_generate(
            accelerator.unwrap_model(model),
            prompts,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=eos_token_ids,
            max_new_tokens=max_new_tokens,
            batch_size=bs,
            device=accelerator.device,
            autocast=accelerator.autocast,
            progress=show if bar is not None else None,
        ),
        batch_size,
        "generation",
        say,
    )
    if bar is not None:
        bar.close()
    if lengths is not None:
        lengths += [len(g) for g in generated]
    return [tokenizer.decode(g, skip_special_tokens=True).strip() for g in generated]


def evaluate_examples(model: Any, examples: list[Example], tokenizer: Any, *, target_field: str,
                      eos_token_ids: list[int], max_new_tokens: int, batch_size: int, accelerator: Any,
                      say: Say = print, share_prefixes: bool = True,
                      generate: bool = True, metric: str = "squad") -> tuple[dict[str, float], list[str],
                                                                             list[list[str]]]:
    """Validation loss (per supervised token) and, with ``generate``, SQuAD F1 / exact match (normalised) and
    ROUGE-L of greedy generations against the gold answers (a conversation's gold is its last assistant turn).

    Used after every epoch of training and by ``surefit eval``, so both report the same numbers. With
    ``share_prefixes`` the loss computes prompt prefixes that rows of a batch share once, as training does (the
    same loss; see :mod:`surefit.training.speedups.prefixes`).

    Returns:
        ``({"eval_loss", "eval_f1", "eval_em", "eval_rouge_l"}, predictions, gold answers per example)``.
    """
    collate = PadCollator(pad_token_id=tokenizer.pad_token_id)
    share = share_prefixes and why_not_shared(model) is None
    loss = evaluate_loss(
        model,
        [e.features() for e in examples],
        [len(e.input_ids) for e in examples],
        loss_fn=functools.partial(causal_lm_loss_sum, share=PrefixSharing()) if share else causal_lm_loss_sum,
        collate=collate,
        batch_size=batch_size,
        accelerator=accelerator,
        say=say,
    )
    if not generate:
        return {"eval_loss": loss}, [], []
    preds = generate_texts(model, [e.prompt_ids for e in examples], tokenizer, eos_token_ids=eos_token_ids,
                           max_new_tokens=max_new_tokens, batch_size=batch_size, accelerator=accelerator, say=say,
                           progress=True)
    golds = [_golds(e.row, target_field) for e in examples]
    return {"eval_loss": loss, **score(metric, preds, golds)}, preds, golds


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
    import importlib

    module, _, name = metric.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
        out = fn(preds, [g[0] for g in golds])
    except (ImportError, AttributeError) as e:
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
                       input_field: str) -> list[dict[str, Any]]:
    """Per example: where it came from, input, gold answers, prediction, F1 and EM (``predictions/epoch_N.jsonl``)."""
    return [
        {
            "where": ex.row.where,
            "input": _input_text(ex.row, input_field),
            "gold": gold,
            "prediction": pred,
            "f1": max(token_f1(pred, g) for g in gold),
            "em": max(exact_match(pred, g) for g in gold),
        }
        for ex, pred, gold in zip(examples, preds, golds, strict=True)
    ]


def _input_text(row: Row, input_field: str) -> Any:
    """What a prediction answers: a flat row's input, or a conversation's last user (or tool) turn."""
    messages = row.fields.get("messages")
    if isinstance(messages, list):
        return next((m["content"] for m in reversed(messages) if m["role"] in ("user", "tool")), "")
    return row.fields[input_field]


# ------------------------------------------------------------------------------------------------------------ a finished run


def _base_model(run: Run, say: Say) -> tuple[str, ModelSource]:
    """The base model the run was trained from (a LoRA adapter is applied to it), resolved as training did."""
    try:
        source = resolve_model(run.cfg.model)
        return model_folder(source, log=say), source
    except ModelError as e:
        raise run.config_problem(e, ("model",)) from e


def load(run: Run, say: Say = print, as_trained: bool = True) -> Loaded:
    """The causal LM (base + LoRA adapter, or the full model), its tokenizer and the run's prompt format.

    ``as_trained``: frozen weights in the dtype training computed with (``False``: fp32, e.g. to merge for export).
    """
    import torch

    run.require(*FINAL_FILES)
    cfg = run.cfg
    final_source = ModelSource("folder", str(run.final), str(run.final))
    tokenizer, _ = load_tokenizer(str(run.final), final_source, cfg.trust_remote_code)
    if (run.final / "adapter_config.json").is_file():
        from peft import PeftModel

        path, source = _base_model(run, say)
        # Adapters marked trainable as in training: what stays frozen is what training may have stored in 16 bits.
        model = PeftModel.from_pretrained(load_causal_lm(path, source, cfg.trust_remote_code), str(run.final),
                                          is_trainable=bool(run.frozen_dtype))
        if as_trained:
            fuse_lora(model)  # the forward training used (adapters summed in fp32)
            if run.frozen_dtype:
                store_frozen_in(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[run.frozen_dtype])
    else:
        model = load_causal_lm(str(run.final), final_source, cfg.trust_remote_code)
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    # The saved tokenizer carries the chat template training used (a --chat_format file need not exist any more).
    used = replace(cfg, chat_format=None) if getattr(tokenizer, "chat_template", None) else cfg
    encoder = Encoder.build(used, tokenizer, run.report.get("format", "input_target"),
                            bool(run.report.get("format_conversational")))
    eos = sorted(set(eos_token_ids(model, tokenizer)) | set(run.report.get("stop_ids") or []))
    return Loaded(model, tokenizer, accelerator, {"fmt": encoder.prompt, "encoder": encoder, "eos": eos})


def _quiet(_: str) -> None:
    pass


def evaluate(run: Run, data: str | None, batch_size: int, max_new_tokens: int | None, fields: dict[str, str],
             say: Say = print) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
    """``surefit eval`` of an sft run: its validation split re-derived as training did (or ``data``), scored by
    :func:`evaluate_examples` as each epoch was.

    Returns:
        ``(what was evaluated, rows, metrics, prediction records)``.
    """
    cfg = run.cfg
    input_field = fields.get("input_field") or cfg.input_field
    target_field = fields.get("target_field") or cfg.target_field
    train_rows = None
    if data is None:
        run.check_training_data()
        train_rows, rows, _ = load_data(cfg, say=_quiet)
        described = run.validation_described()
    else:
        rows = _read_run_file(run, data, [(input_field, "--input_field"), (target_field, "--target_field")])
        described = str(data)
    loaded = load(run, say)
    enc = _encode_settings(cfg, input_field, target_field)
    encoder: Encoder = loaded.extra["encoder"]
    if encoder.chat is not None:
        examples, rep = encoder.encode(rows, "evaluation")
    else:
        examples, rep = encode_rows(rows, loaded.tokenizer, loaded.extra["fmt"], split="evaluation", **enc)
    for where, why in rep.excluded[:10]:
        say(f"excluded {where}: {why}")
    if not examples:
        raise DataError(Problem(f"no rows of {described} fit: all {rep.rows} targets are longer than "
                                f"max_seq_length {cfg.max_seq_length} allows", run.where("max_seq_length"),
                                "evaluate on rows with shorter targets"))
    max_new = _max_new_tokens(run, max_new_tokens, loaded, train_rows, enc)
    metrics, preds, golds = evaluate_examples(loaded.model, examples, loaded.tokenizer, target_field=target_field,
                                              eos_token_ids=loaded.extra["eos"], max_new_tokens=max_new,
                                              batch_size=batch_size, accelerator=loaded.accelerator, say=say,
                                              metric=choose_metric(cfg, bool(run.report.get("format_conversational"))))
    records = prediction_records(examples, preds, golds, input_field)
    if rep.excluded:
        metrics["excluded_rows"] = len(rep.excluded)
    return described, len(examples), metrics, records


def _max_new_tokens(run: Run, given: int | None, loaded: Loaded, train_rows: list | None, enc: dict) -> int:
    """Generation length as training chose it: --max_new_tokens, else the longest training target + 4."""
    if given:
        return given
    if run.cfg.max_new_tokens:
        return run.cfg.max_new_tokens
    longest = ((run.report.get("encoding") or {}).get("train") or {}).get("longest_target")
    if not longest and train_rows is not None:
        longest = loaded.extra["encoder"].encode(train_rows, "train")[1].longest_target
    if not longest:
        raise ConfigError(Problem(f"cannot tell how many tokens to generate: {run.folder / 'data_report.json'} does not "
                                  "give the longest training target", "--max_new_tokens", "pass --max_new_tokens N"))
    return longest + 4


def _read_run_file(run: Run, path: str, text_fields: list[tuple[str, str]], complete: bool = True) -> list[Row]:
    """Rows of another file for ``eval`` / ``predict``, in the run's format: conversations when the run trained on
    conversations (and the file holds them), else the flat fields checked. Every problem is raised at once."""
    from surefit.data.readers import SKIP_HINT, read_rows
    from surefit.errors import raise_input_problems

    if not run.report.get("format_conversational"):
        return read_checked(path, text_fields)
    problems: list[Problem] = []
    rows = read_rows(path, problems)
    choice = detect_format(rows, str(path), "auto", text_fields[0][0], "target", parse_role_map(run.cfg.role_map)[0])
    if isinstance(choice, Problem):
        problems.append(choice)
    elif choice.conversational:
        rows = to_conversations(rows, choice, str(path), problems, complete=complete)
    else:  # flat rows for a chat run: each input is one user turn
        rows, _ = check_text_fields(rows, text_fields[:1], problems, str(path))
        rows = [r.with_fields(messages=[{"role": "user", "content": str(r.fields[text_fields[0][0]])}]
                              + ([{"role": "assistant", "content": str(r.fields[text_fields[1][0]]), "train": True}]
                                 if len(text_fields) > 1 and text_fields[1][0] in r.fields else []), tools=None)
                for r in rows]
    raise_input_problems([replace(p, fix=p.fix.replace(f"; {SKIP_HINT}", "").replace(SKIP_HINT, ""))
                          for p in problems])
    return rows


def predict(run: Run, inputs: str | list[str] | None, file: str | None, batch_size: int,
            max_new_tokens: int | None, fields: dict[str, str], say: Say = print) -> Iterator[list[dict[str, Any]]]:
    """Generated responses in the run's prompt format, one batch of records at a time, in input order.

    A conversation (``messages`` / ``conversations`` row) is continued with the next assistant turn; generation
    stops at every end-of-turn id of the template and the generation config."""
    input_field = fields.get("input_field") or run.cfg.input_field
    text_fields = [(input_field, "--input_field")]
    conversational = bool(run.report.get("format_conversational"))
    if file is not None:
        rows = _read_run_file(run, str(file), text_fields, complete=False)
    else:
        rows = rows_from_texts(inputs, text_fields)
        if conversational:
            rows = [r.with_fields(messages=[{"role": "user", "content": r.fields[input_field]}], tools=None)
                    for r in rows]
    cfg = run.cfg
    if prerendered(cfg) and not conversational:
        names = template_fields(cfg.template)
        rows = [r.with_fields(**{input_field: fill_template(cfg.template, {
            n: r.fields.get(input_field if n == "input" else n) for n in names})}) for r in rows]
    loaded = load(run, say)
    encoder: Encoder = loaded.extra["encoder"]
    max_new = _max_new_tokens(run, max_new_tokens, loaded, None, _encode_settings(cfg))
    # Like training, prompt + answer fit in max_seq_length: the input is cut (and counted) so that they do.
    room = max(cfg.max_seq_length - max_new, 1)
    for part in chunks(rows, batch_size):
        prompts, cut = [], []
        for r in part:
            ids, n_cut = encoder.prompt_ids(r, room)
            prompts.append(ids)
            cut.append(n_cut)
        lengths: list[int] = []
        preds = generate_texts(loaded.model, prompts, loaded.tokenizer, eos_token_ids=loaded.extra["eos"],
                               max_new_tokens=max_new, batch_size=batch_size, accelerator=loaded.accelerator, say=say,
                               lengths=lengths)
        batch = []
        for row, pred, n_cut, n in zip(part, preds, cut, lengths, strict=True):
            rec = {"where": row.where, "input": _input_text(row, input_field), "prediction": pred,
                   "stopped": "end of turn" if n < max_new else f"max_new_tokens ({max_new})"}
            if n_cut:
                rec["input_tokens_cut"] = n_cut
                what = "oldest turns" if conversational else f"input tokens cut from the {cfg.truncation_side}"
                say(f"{row.where}: {n_cut} tokens of {what} dropped so that prompt + answer "
                    f"fit max_seq_length {cfg.max_seq_length}")
            batch.append(rec)
        yield batch


def export(run: Run, folder: Path, merge: bool, say: Say = print) -> str:
    """Write the run's model into ``folder`` (new); with ``merge``, a LoRA adapter folded into the base weights: a
    plain causal LM that ``AutoModelForCausalLM`` loads without peft. Returns what was written, in words."""
    import shutil

    run.require(*FINAL_FILES)
    lora = (run.final / "adapter_config.json").is_file()
    if merge and lora:
        folder.mkdir(parents=True)
        loaded = load(run, say, as_trained=False)
        loaded.model.merge_and_unload().save_pretrained(folder, safe_serialization=True)
        loaded.tokenizer.save_pretrained(folder)
        return "merged model (adapter folded into the base weights)"
    shutil.copytree(run.final, folder)
    if merge:
        say(f"--merge: {run.folder} was trained in full (no LoRA adapter); copied the model as it is")
    return "LoRA adapter (load with peft; its base model is named in adapter_config.json)" if lora else "model"


# ------------------------------------------------------------------------------------------------------------ inspect


def inspect(cfg: SFTConfig, out: str | None = None, show: int = 2, color: bool | None = None,
            say: Say = print) -> dict[str, Any]:
    """``surefit inspect --task sft``: what training would supervise, without loading the model's weights.

    Every row is read, checked and encoded as training would (format, template, truncation); the first ``show``
    examples are printed with the supervised spans marked (colour on a terminal, ``[[ ]]`` otherwise), then counts
    per role. ``out``: one JSON object per encoded example (``where``, ``input_ids``, ``labels``, ``text``).

    Returns:
        The counts printed.
    """
    import json
    import sys

    rows_cfg = replace(cfg, val_fraction=0.0, augmentation_factor=1)
    rows, _, report = load_data(rows_cfg, say)
    source = resolve_model(cfg.model)
    path = model_folder(source, log=say)
    tokenizer, _ = load_tokenizer(path, source, cfg.trust_remote_code)
    encoder = Encoder.build(cfg, tokenizer, report["format"], report["format_conversational"])
    say(encoder.why)
    examples, rep = encoder.encode(rows, "all", cfg.on_bad_rows == "skip")
    if color is None:
        color = sys.stdout.isatty()
    on, off = ("\033[1;32m", "\033[0m") if color else ("[[", "]]")
    for ex in examples[:show]:
        say(f"--- {ex.row.where} (supervised spans marked {on}like this{off}) ---")
        say(marked_text(tokenizer, ex, on, off))
    roles = getattr(rep, "roles", {}) or {}
    counts = {"rows": rep.rows, "encoded": rep.encoded, "tokens": rep.tokens, "supervised_tokens": rep.supervised_tokens,
              "turns": roles, "shortened": len(getattr(rep, "rows_shortened", [])), "excluded": len(rep.excluded)}
    say(f"{rep.encoded}/{rep.rows} rows encoded; {rep.tokens} tokens, {rep.supervised_tokens} supervised "
        f"({100.0 * rep.supervised_tokens / max(rep.tokens, 1):.1f}%)")
    if roles:
        trained = "every assistant turn" if cfg.train_on == "all_assistant" else "the last assistant turn"
        say("turns per role: " + ", ".join(f"{r} {n}" for r, n in roles.items()) + f"; supervised: {trained} "
            "and its terminator; system, user and tool turns never")
    if getattr(rep, "tools_rows", 0):
        say(f"tools: {rep.tools_rows} rows give tool schemas ({rep.tools_how}); {rep.tool_call_turns} assistant turns "
            "call a tool (trained like any assistant turn)")
    say(f"shortened to fit: {counts['shortened']} of {rep.rows} rows (oldest turns dropped); excluded: "
        f"{counts['excluded']} of {rep.rows} rows")
    for where, why in rep.excluded[:10]:
        say(f"  excluded {where}: {why}")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            for ex in examples:
                f.write(json.dumps({"where": ex.row.where, "input_ids": ex.input_ids, "labels": ex.labels,
                                    "text": tokenizer.decode(ex.input_ids, skip_special_tokens=False)},
                                   ensure_ascii=False) + "\n")
        say(f"wrote {len(examples)} encoded examples to {out}")
    return counts


def marked_text(tokenizer: Any, ex: Example, on: str, off: str) -> str:
    """The example's text with each supervised run of tokens between ``on`` and ``off``."""
    parts: list[str] = []
    run: list[int] = []
    trained = False
    for t, label in [*zip(ex.input_ids, ex.labels, strict=True), (None, None)]:
        if t is None or (label != -100) != trained:
            if run:
                text = tokenizer.decode(run, skip_special_tokens=False)
                parts.append(f"{on}{text}{off}" if trained else text)
            run, trained = [], label is not None and label != -100
        if t is not None:
            run.append(t)
    return "".join(parts)
