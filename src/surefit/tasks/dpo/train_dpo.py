"""Preference tuning of a causal LM on chosen / rejected pairs: pairs -> encoding -> model -> loop -> final/.

The pieces that decide correctness live in library code: the pair shapes and their encoding (``data/pairs.py``: the
prompt rendered and tokenised once, labels by position), the losses and the reference (``training/preference.py``),
and the one training loop (``training/loop.py``: a pair is one example, so the loss is normalised per pair over the
whole accumulated step and an out-of-memory split keeps a pair together). The runner is the one every task uses
(``tasks/common.train``); this file wires them and reports in counts what happened to the pairs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import surefit.startup as startup
import surefit.startup.cache as startup_cache
from surefit.config.dpo_config import DPOConfig
from surefit.data import encoded_store
from surefit.data.encode import resolve_chat_template
from surefit.data.encoded_store import EncodedStore, IntColumn, StoreUse, StoreWriter
from surefit.data.formats import field_table
from surefit.data.pairs import PairCollator, PairExample, PairReport, detect_pair_format, encode_pairs, to_pairs
from surefit.data.readers import Rejected, read_splits
from surefit.data.rows import Row
from surefit.data.split import normalize_key, split_or_check
from surefit.data.summary import DataSummary, TextFacts
from surefit.doctor.checks_dpo import check_pairs
from surefit.errors import ConfigError, DataError, ModelError, Problem, raise_if, raise_with_rejected
from surefit.eval.progress import phase
from surefit.models import apply_lora, load_tokenizer, model_folder, resolve_model
from surefit.models.lowbit import require_bitsandbytes
from surefit.run_folder import EXCLUDED, Found
from surefit.tasks.baseline_eval import BaselineReuse, rows_digest
from surefit.tasks.dpo.dpo_store import SIDES, StoredExamples, StoredPairs, side_arrays, store_key
from surefit.tasks.runner import Evaluation, Prepared, RunResult, render_columns, train
from surefit.tasks.sft.train_sft import load_model, save
from surefit.training.dropout import seed_dropout
from surefit.training.memory import enable_gradient_checkpointing
from surefit.training.precision import make_accelerator, precision_name
from surefit.training.preference import PreferenceLoss, Reference, compute_reference
from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora
from surefit.training.work import PlanInputs, TrainingWork

Say = Callable[[str], None]
REFERENCE_FILE = "reference_logps.json"
LOSS_NAMES = {"sigmoid": "sigmoid (DPO)", "ipo": "IPO", "hinge": "hinge (SLiC)", "simpo": "SimPO", "orpo": "ORPO"}


def prompt_key(row: Row) -> str:
    """What makes two pairs the same example for the split and the leakage check: their prompt."""
    prompt = row.fields["pair_prompt"]
    if isinstance(prompt, str):
        return normalize_key(prompt)
    return normalize_key(" \n ".join(m["content"] for m in prompt if m["role"] in ("system", "user")))


def load_pairs(cfg: DPOConfig, say: Say = print,
               problems: list[Problem] | None = None) -> tuple[list[Row], list[Row], DataSummary]:
    """Read, detect the pair shape, check every pair, and split by prompt. Every problem is reported at once.

    Returns:
        ``(train_rows, val_rows, summary)``: the summary holds the notes printed, the pair shape, the rows rejected
        under ``--on_bad_rows skip`` and what became of each field (``facts.field_table``). A problem raised
        carries the rejected rows too (``error.rejected``), for the run folder to list.
    """
    problems = list(problems or [])
    assert cfg.data is not None  # required: the config's checks say so first
    rejected: list[Rejected] = []
    notes: list[str] = []
    report = DataSummary(notes=notes, rejected=rejected, facts=TextFacts())
    rejects = rejected if cfg.on_bad_rows == "skip" else None
    loaded = read_splits(cfg.data, cfg.val_data, cfg.limit, problems, rejects, notes)
    choice = None
    table: list[dict[str, str]] = []
    for name, path in (("train", cfg.data), ("validation", cfg.val_data)):
        raw = loaded.get(name)
        if not raw:
            continue
        found = detect_pair_format(raw, str(path))
        if isinstance(found, Problem):
            problems.append(found)
            loaded[name] = []
            continue
        if choice is None:
            choice, table = found, field_table(raw, found)
        before = len(rejects or [])
        loaded[name] = to_pairs(raw, found, str(path), problems, rejects)
        if rejects is not None and raw and not loaded[name]:
            problems.append(Problem(f"all {len(raw)} pairs of {path} were rejected (first: {rejects[before].where}: "
                                    f"{rejects[before].reason})", str(path), "fix the pairs (see the rejected rows "
                                    "file)"))
    raise_with_rejected(problems, rejected)
    assert choice is not None
    # format_conversational is left unset: it tells SFT's predict how to prompt, and pair shapes are all "conversational"
    report.format = choice.name
    report.facts_as(TextFacts).field_table = table
    say(choice.line())
    say("fields of the rows:\n" + render_columns(table))
    train_rows, val, split_notes = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction,
                                                  cfg.seed, prompt_key, "prompt")
    notes += split_notes
    report.train_rows, report.val_rows = len(train_rows), len(val)
    for note in notes:
        say(note)
    return train_rows, val, report


def choose_reference(cfg: DPOConfig) -> tuple[Reference, str]:
    """Where the reference log-probabilities come from, and why, in words."""
    if cfg.reference_free:
        return "none", f"none: {cfg.loss} is reference-free"
    if cfg.lora_r == 0:
        return "precomputed", ("the model before training, its log-probabilities computed once before step 1 and "
                               f"stored in {REFERENCE_FILE} (full fine-tuning: no second copy of the model is kept)")
    if cfg.precompute_ref:
        return "precomputed", (f"the model with its adapters off, computed once before step 1 and stored in "
                               f"{REFERENCE_FILE} (--precompute_ref)")
    return "adapters_off", ("the same model with its LoRA adapters off, one no-grad forward per step (no second copy "
                            "of the model; --precompute_ref computes it once instead)")


def features_digest(features: Sequence[dict[str, Any]]) -> str:
    """A hash of the encoded pairs (token ids and labels), in order."""
    h = hashlib.sha256()
    for f in features:
        h.update(json.dumps([f["chosen_ids"], f["chosen_labels"], f["rejected_ids"], f["rejected_labels"]]).encode())
    return h.hexdigest()


def reference_logps(cfg: DPOConfig, model: Any, accelerator: Any, collate: Any, splits: dict[str, Sequence[dict]],
                    adapters: bool, say: Say) -> dict[str, Any]:
    """The stored reference of a resumed run (refused when its data changed), or the reference computed now."""
    digests = {name: features_digest(feats) for name, feats in splits.items()}
    saved = Path(cfg.output_dir) / REFERENCE_FILE
    if cfg.resume and saved.is_file():
        stored = json.loads(saved.read_text(encoding="utf-8"))
        changed = [n for n in digests if stored.get("digests", {}).get(n) != digests[n]]
        if changed:
            raise DataError(Problem(
                f"the {' and '.join(changed)} pairs differ from those whose reference log-probabilities this run "
                f"computed before step 1 ({saved}): resuming would compare the policy with the reference of other data",
                "--data", "resume with the data the run started with, or start a new run (--overwrite or a new "
                "--output_dir)"))
        say(f"reference: the log-probabilities stored in {saved} (the same pairs, hashes checked)")
        return stored
    with startup.phase("reference log-probabilities"):
        out = {"digests": digests, "model": cfg.model or "embedded default", "adapters_off": adapters}
        for name, feats in splits.items():
            out[name] = compute_reference(model, feats, collate, cfg.resolved_eval_batch_size, accelerator, adapters)
    say(f"reference: log-probabilities of {sum(len(f) for f in splits.values())} pairs computed once before step 1")
    return out


def _encode(rows: list[Row], tokenizer: Any, chat: Any, cfg: DPOConfig,
            split: str) -> tuple[list[PairExample], PairReport, set[int]]:
    examples, report, failures, terms = encode_pairs(rows, tokenizer, chat, max_seq_length=cfg.max_seq_length,
                                                     truncation=cfg.truncation, split=split)
    if failures and cfg.on_bad_rows != "skip":
        shown = "; ".join(f"{w}: {why}" for w, why in failures[:5])
        more = f" and {len(failures) - 5} more" if len(failures) > 5 else ""
        raise DataError(Problem(f"{len(failures)} {split} pair{'s' if len(failures) != 1 else ''} cannot be used: "
                                f"{shown}{more}", "--data", "fix these pairs, or pass --on_bad_rows skip to exclude "
                                "them (listed in excluded_rows.jsonl)"))
    report.excluded += failures
    return examples, report, terms


@dataclass
class EncodedPairs:
    """A run's encoded pairs, read from the encoded-data cache or encoded in memory (``--no_cache``).

    Attributes:
        summary: what reading and encoding did; path, tokenizer: the model's folder and tokenizer.
        examples, features, lengths: the training pairs (``PairExample``), as the collator takes them, and both
            sequences' tokens of each (lists, or the store read by position).
        where: a training pair's index -> its source row in words.
        val_ex: the validation pairs (in memory, with their rows). excluded: the rows ``excluded_rows.jsonl`` lists.
        terms: the end-of-turn ids encoding found. store: what the cache did (``data_report.json``'s
            ``encoded_store``).
    """

    summary: DataSummary
    path: str
    tokenizer: Any
    examples: Sequence[PairExample]
    features: Sequence[dict[str, Any]]
    lengths: Sequence[int]
    where: Callable[[int], str]
    val_ex: list[PairExample]
    excluded: list[dict[str, Any]]
    terms: set[int]
    store: StoreUse = field(default_factory=lambda: StoreUse("off"))


def _tokenizer(cfg: DPOConfig, source: Any, say: Say) -> tuple[str, Any]:
    with startup.phase("model conversion"), phase("model conversion"):
        path = model_folder(source, log=say)
    with startup.phase("tokenizer"):
        tokenizer, notes = load_tokenizer(path, source, cfg.trust_remote_code)
    for note in notes:
        say(note)
    return path, tokenizer


def load_encoded(cfg: DPOConfig, source: Any, say: Say, early: list[Problem]) -> EncodedPairs:
    """The run's pairs, encoded: read from the encoded-data cache when an identical run encoded them (the data files'
    content, the tokenizer, every reading and encoding setting and the code unchanged: the lines it printed are
    printed again), else read, split, encoded and written there (``--no_cache``: in memory, nothing read or written).
    The tokenizer is loaded before the rows are read only when a store for these data files exists. ``source``:
    the model, ``None`` when it could not be resolved (its problem is in ``early``, reported with the data's)."""
    use, data_key = encoded_store.store_use(cfg.no_cache, cfg.trust_remote_code, [cfg.data, cfg.val_data])
    loaded: tuple[str, Any] | None = None
    key = None
    if source is not None and data_key is not None and encoded_store.has_any(data_key):
        loaded = _tokenizer(cfg, source, say)
        key = store_key(cfg, data_key, *loaded)
        if key is not None:
            store, use = encoded_store.lookup(data_key, key, say)
            if store is not None:
                raise_with_rejected(early, [])  # the run folder's problems, found before the data
                return _from_store(store, *loaded, say, use)
    record = encoded_store.Recorder(say)
    with startup.phase("reading data"), phase("reading data"):
        train_rows, val_rows, data_report = load_pairs(cfg, record, early)
    path, tokenizer = loaded or _tokenizer(cfg, source, say)
    if data_key is not None and key is None:
        key = store_key(cfg, data_key, path, tokenizer)
        use = StoreUse("miss") if key is not None else StoreUse("not cacheable", why="the model is not a local folder")
    chat, why = resolve_chat_template(tokenizer, cfg.chat_template, cfg.chat_format)
    texts = all(isinstance(r.fields["pair_prompt"], str) for r in train_rows + val_rows)
    if chat is None and not texts:
        raise ConfigError(Problem(f"the pairs are conversations ({data_report.format}) and need a chat template, "
                                  f"but {why}", "--chat_format", "pass --chat_format chatml (or llama3, gemma, or a "
                                  "Jinja file); it is saved with the tokenizer"))
    template = why if not texts else "prompts as written (text pairs: no template), answers end with EOS"
    record(template)
    with startup.phase("encoding data"), phase("encoding data"):
        train_ex, train_rep, terms = _encode(train_rows, tokenizer, chat, cfg, "train")
        val_ex, val_rep, _ = _encode(val_rows, tokenizer, chat, cfg, "validation")
    excluded = [{"split": r.split, "where": w, "reason": why} for r in (train_rep, val_rep) for w, why in r.excluded]
    for rep in (train_rep, val_rep):
        record(rep.summary())
        for where, reason in rep.excluded[:10]:
            record(f"  excluded {where}: {reason}")
        if len(rep.excluded) > 10:
            record(f"  ... and {len(rep.excluded) - 10} more (all listed in {Path(cfg.output_dir) / EXCLUDED})")
    raise_if([Problem(f"no {r.split} pairs left after encoding: all {r.rows} were excluded (first: "
                      f"{r.excluded[0][1] if r.excluded else '?'})", "--max_seq_length",
                      f"raise --max_seq_length (now {cfg.max_seq_length}) or shorten the pairs")
              for r in (train_rep, val_rep) if r.encoded == 0 and r.rows], DataError)
    data_report.encoding = {r.split: {k: v for k, v in r.__dict__.items() if k != "excluded"}
                            | {"excluded": len(r.excluded)} for r in (train_rep, val_rep)}
    data_report.facts_as(TextFacts).template = template
    rows = encoded_store.rows_record([e.row for e in val_ex]) if key is not None else None
    if key is not None and rows is None:
        key, use = None, StoreUse("not cacheable", why="a validation row holds a value JSON cannot hold")
    if key is not None:
        writer = None
        try:
            writer = StoreWriter(encoded_store.locate(data_key, key), key)
            for split, examples in (("train", train_ex), ("validation", val_ex)):
                for side in SIDES:
                    writer.add(f"{split}_{side}", side_arrays(examples, side))
            rec = {"summary": encoded_store.summary_record(data_report), "lines": record.lines, "excluded": excluded,
                   "terms": sorted(terms), "validation_rows": rows}
            with startup.phase("encoded data write"):
                folder = writer.commit(rec)
        except OSError as e:  # a cache is a speed-up: one that cannot be written costs the next run an encoding
            if writer is not None:
                writer.discard()
            say(f"note: the encoded-data cache cannot be written ({e}); the pairs stay in memory")
            use = StoreUse("not cacheable", why=f"the cache cannot be written: {e}")
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        else:
            store = EncodedStore.open(folder, key, say)
            assert store is not None, f"the encoded-data cache just written to {folder} does not check out"
            return _from_store(store, path, tokenizer, say, use, val_ex=val_ex)
    data = EncodedPairs(data_report, path, tokenizer, train_ex, [e.features() for e in train_ex],
                        [e.tokens for e in train_ex], lambda i: train_ex[i].row.where, val_ex, excluded, terms, use)
    _say_store(data, say)
    return data


def stored_pairs(cfg: DPOConfig, source: Any, say: Say) -> EncodedPairs | None:
    """The encoded pairs of an earlier run with these settings, when the encoded-data cache holds them (a hit);
    ``None`` otherwise. Never encodes nor writes (``surefit inspect`` reads a large file's pairs without encoding)."""
    if cfg.no_cache or cfg.trust_remote_code:
        return None
    data_key = encoded_store.data_identity([cfg.data, cfg.val_data])
    if data_key is None or not encoded_store.has_any(data_key):
        return None
    path, tokenizer = _tokenizer(cfg, source, say)
    key = store_key(cfg, data_key, path, tokenizer)
    store = None if key is None else EncodedStore.open(encoded_store.locate(data_key, key), key, say)
    return None if store is None else _from_store(store, path, tokenizer, lambda _: None, StoreUse("hit"))


def _from_store(store: EncodedStore, path: str, tokenizer: Any, say: Say, use: StoreUse,
                val_ex: list[PairExample] | None = None) -> EncodedPairs:
    """The run's pairs from an opened store: the training pairs read by position, the validation pairs (and their
    rows) in memory; on a hit (``val_ex`` not given), the lines the encoding run printed."""
    header = str(store.folder / encoded_store.HEADER)
    rec = store.record
    encoded_store.checked_record(rec, header, {
        "summary": dict, "lines": list, "excluded": list, "terms": list, "validation_rows": list},
        {"validation_rows": encoded_store.ROW_SHAPE, "excluded": {"split": str, "where": str, "reason": str}},
        {"lines": str, "terms": int})
    summary = encoded_store.summary_of(rec["summary"], header)
    if val_ex is None:
        for line in rec["lines"]:
            say(line)
        chosen = store.split("validation_chosen")
        held_out = StoredPairs(chosen, store.split("validation_rejected"), store.extras(chosen))
        val_ex = [held_out.example(i, row) for i, row in enumerate(encoded_store.rows_of(rec["validation_rows"]))]
        held_out.close()
    chosen = store.split("train_chosen")
    pairs = StoredPairs(chosen, store.split("train_rejected"), store.extras(chosen))
    use.folder = str(store.folder)
    data = EncodedPairs(summary, path, tokenizer, StoredExamples(pairs), pairs, IntColumn(pairs.lengths()),
                        chosen.where, val_ex, rec["excluded"], set(rec["terms"]), use)
    _say_store(data, say)
    return data


def _say_store(data: EncodedPairs, say: Say) -> None:
    """One line on what the encoded-data cache did, also saved in ``data_report.json`` (``encoded_store``)."""
    say(data.store.line(len(data.features)))
    data.summary.facts_as(TextFacts).encoded_store = data.store.to_json()


def prepare(cfg: DPOConfig, say: Say = print, problems: list[Problem] | None = None) -> Prepared:
    """Everything the loop needs: pairs -> encoded examples, the model with LoRA, the collator, the preference loss and
    the per-epoch evaluation. Nothing is written to the run folder (the reference is returned as a file to write)."""
    early = list(problems or [])
    source: Any = None
    try:
        source = resolve_model(cfg.model)
    except ModelError as e:
        early += e.problems
    if cfg.quantize != "none":
        try:
            require_bitsandbytes(cfg.quantize)
        except ConfigError as e:
            early += e.problems
    data = load_encoded(cfg, source, say, early)
    data_report, path, tokenizer, val_ex, terms = data.summary, data.path, data.tokenizer, data.val_ex, data.terms

    with startup.phase("model load"), phase("model load"):
        model = load_model(cfg, path, source, say)
    with startup.phase("LoRA setup"):
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model, lora=cfg.lora_r > 0)
        model = apply_lora(model, cfg, "CAUSAL_LM", say)
        if cfg.lora_r:
            fuse_lora(model)  # falls back to peft's forward while the adapters are off (the reference)
        seed_dropout(model)
    with startup.phase("accelerate setup"):
        accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers,
                                       project_dir=cfg.output_dir)
    model.to(accelerator.device)
    reference, why_ref = choose_reference(cfg)
    extra = {"simpo": f", gamma {cfg.gamma}", "orpo": f", lambda {cfg.orpo_lambda}"}.get(cfg.loss, "")
    say(f"loss: {LOSS_NAMES[cfg.loss]}, beta {cfg.beta}{extra} (--loss, --beta); reference: {why_ref}")
    say(f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device}")
    collate = PairCollator(pad_token_id=tokenizer.pad_token_id)
    features = data.features
    val_features = [e.features() for e in val_ex]
    files: dict[str, Any] = {}
    if reference == "precomputed":
        stored = reference_logps(cfg, model, accelerator, collate, {"train": features, "validation": val_features},
                                 cfg.lora_r > 0, say)
        files[REFERENCE_FILE] = stored
        if isinstance(features, StoredPairs):  # read from disk per access: the pairs carry the list instead
            features.reference = list(stored["train"])
        for feats, name in ((features, "train"), (val_features, "validation")):
            if isinstance(feats, list):
                for f, ref in zip(feats, stored[name], strict=True):
                    f["reference_logps"] = ref
    loss_fn = PreferenceLoss(cfg.loss, cfg.beta, reference, gamma=cfg.gamma, orpo_lambda=cfg.orpo_lambda)
    tokenizer.padding_side = "left"  # generation pads on the left; the saved tokenizer says so
    if terms:
        data_report.facts_as(TextFacts).stop_ids = sorted(terms | {tokenizer.eos_token_id})

    # Epoch 0 reused when nothing it reads changed (tasks/baseline_eval.py): the pairs as encoded (with the stored
    # reference log-probabilities, when precomputed), the model's files and the settings (loss, beta, reference).
    reusable = source is not None and Path(path).exists() and not cfg.trust_remote_code
    baseline = BaselineReuse(None if not reusable else lambda: {
        "model": startup_cache.files_identity(path), "tokenizer": startup_cache.tokenizer_identity(tokenizer),
        "validation": startup_cache.features_digest(val_features), "rows": rows_digest([e.row for e in val_ex])})

    def evaluate(m: Any, epoch: int | float, batch_size: int) -> Evaluation:
        def compute() -> Evaluation:
            return Evaluation(*evaluate_pairs(m, val_ex, val_features, loss_fn, collate, batch_size, accelerator))

        result = baseline.evaluation(epoch, m, {"batch_size": batch_size}, compute)
        say(f"epoch {epoch}/{cfg.epochs}  " + "  ".join(f"{k}={v:.4f}" for k, v in result.metrics.items()))
        return result

    # A pair is one example of the loop: it counts 1 in the loss, and its two sequences are its length.
    work = TrainingWork(features=features, lengths=data.lengths, counts=IntColumn(np.ones(len(features), np.int32)),
                        collate=collate, loss_fn=loss_fn, evaluate=evaluate, where=data.where,
                        plan=PlanInputs(eval_lengths=[e.tokens for e in val_ex], lora=cfg.lora_r > 0),
                        activation_store=SavedActivationsIn)
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, work=work, save=lambda m, folder: save(m, tokenizer, folder),
        check=lambda: check_pairs(model, tokenizer, data.examples, features, collate, loss_fn, accelerator, cfg),
        baseline=baseline, found=Found(data_report, files=files, jsonl={EXCLUDED: data.excluded}),
        saved=f"{'LoRA adapter (load with peft)' if cfg.lora_r else 'full model (load with transformers)'} and tokenizer")


def evaluate_pairs(model: Any, examples: list[PairExample], features: list[dict[str, Any]], loss_fn: PreferenceLoss,
                   collate: Any, batch_size: int, accelerator: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Held-out pairs scored: mean loss per pair, reward accuracy (chosen reward above rejected), mean margin, and
    mean log-probabilities of both answers under the policy and the reference; and one record per pair."""
    import torch

    was = model.training
    model.eval()
    records: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            for start in range(0, len(features), batch_size):
                batch = collate(features[start:start + batch_size])
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                with accelerator.autocast():
                    s = loss_fn.score(model, batch)
                for j, ex in enumerate(examples[start:start + batch_size]):
                    rec: dict[str, Any] = {
                        "where": ex.row.where, "loss": float(s.losses[j]), "logps_chosen": float(s.chosen[j]),
                        "logps_rejected": float(s.rejected[j]), "reward_chosen": float(s.chosen_rewards[j]),
                        "reward_rejected": float(s.rejected_rewards[j])}
                    if s.ref_chosen is not None and s.ref_rejected is not None:
                        rec.update(ref_logps_chosen=float(s.ref_chosen[j]), ref_logps_rejected=float(s.ref_rejected[j]))
                    rec["margin"] = rec["reward_chosen"] - rec["reward_rejected"]
                    rec["correct"] = rec["margin"] > 0
                    records.append(rec)
    finally:
        model.train(was)
    n = max(len(records), 1)
    mean = lambda k: sum(r[k] for r in records) / n  # noqa: E731
    metrics = {"eval_loss": mean("loss"), "eval_reward_accuracy": sum(r["correct"] for r in records) / n,
               "eval_margin": mean("margin"), "eval_logps_chosen": mean("logps_chosen"),
               "eval_logps_rejected": mean("logps_rejected")}
    if records and "ref_logps_chosen" in records[0]:
        metrics.update(eval_ref_logps_chosen=mean("ref_logps_chosen"), eval_ref_logps_rejected=mean("ref_logps_rejected"))
    return metrics, records


def run(cfg: DPOConfig, say: Say = print) -> RunResult:
    """Train, evaluating the held-out pairs before the first epoch and after each one (``tasks/common.train``)."""
    return train(cfg, prepare, say)
