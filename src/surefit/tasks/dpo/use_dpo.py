"""A finished dpo run: ``surefit eval`` re-scores held-out pairs as each epoch scored them, ``inspect --task dpo``
shows both sequences of each pair with their supervised spans. Loading, ``predict`` and ``export`` are SFT's (the
final folder has the same form)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, overload

from surefit.config.dpo_config import DPOConfig
from surefit.data.encode import Example, resolve_chat_template
from surefit.data.formats import FormatChoice
from surefit.data.pairs import PairCollator, PairExample, PairReport, detect_pair_format, encode_pairs, to_pairs
from surefit.data.readers import read_rows
from surefit.errors import DataError, Problem, raise_input_problems
from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
from surefit.tasks.dpo.train_dpo import REFERENCE_FILE, choose_reference, evaluate_pairs, load_pairs, stored_pairs
from surefit.tasks.sft.use_sft import finished_base_model, load, marked_text
from surefit.training.preference import PreferenceLoss, compute_reference

Say = Any


def _quiet(_: str) -> None:
    pass


def evaluate(run: Any, data: str | None, batch_size: int, max_new_tokens: int | None, fields: dict[str, str],
             say: Say = print) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
    """``surefit eval`` of a dpo run: its held-out pairs re-derived as training did (or the pairs of ``data``),
    scored by the same loss, reference and metrics as each epoch.

    Returns:
        ``(what was evaluated, pairs, metrics, per-pair records)``.
    """
    cfg = run.config_as(DPOConfig)
    if data is None:
        run.check_training_data()
        _, rows, _ = load_pairs(cfg, say=_quiet)
        described = run.validation_described()
    else:
        problems: list[Problem] = []
        raw = read_rows(data, problems)
        choice = detect_pair_format(raw, str(data)) if raw else None
        if isinstance(choice, Problem):
            problems.append(choice)
        rows = to_pairs(raw, choice, str(data), problems) if isinstance(choice, FormatChoice) and not problems else []
        raise_input_problems(problems)
        described = str(data)
    loaded = load(run, say)
    chat, _ = resolve_chat_template(loaded.tokenizer, cfg.chat_template, None)  # the saved tokenizer carries it
    examples, rep, failures, _ = encode_pairs(rows, loaded.tokenizer, chat, max_seq_length=cfg.max_seq_length,
                                              truncation=cfg.truncation, split="evaluation")
    for where, why in (rep.excluded + failures)[:10]:
        say(f"excluded {where}: {why}")
    if not examples:
        raise DataError(Problem(f"no pair of {described} can be scored ({len(rep.excluded) + len(failures)} excluded)",
                                described, "evaluate on pairs that fit max_seq_length"))
    collate = PairCollator(pad_token_id=loaded.tokenizer.pad_token_id)
    features = [e.features() for e in examples]
    reference, _ = choose_reference(cfg)
    if reference == "precomputed":
        stored_path = run.folder / REFERENCE_FILE
        stored = json.loads(stored_path.read_text(encoding="utf-8")) if stored_path.is_file() else {}
        own = stored.get("validation") if data is None and len(stored.get("validation", [])) == len(features) else None
        if own is None:  # other pairs: the reference is the model the run started from, computed now
            lora = (run.final / "adapter_config.json").is_file()
            if lora:
                own = compute_reference(loaded.model, features, collate, batch_size, loaded.accelerator, True)
            else:
                path, source = finished_base_model(run, say)
                base = load_causal_lm(path, source, cfg.trust_remote_code).to(loaded.accelerator.device)
                own = compute_reference(base, features, collate, batch_size, loaded.accelerator, False)
        for f, ref in zip(features, own, strict=True):
            f["reference_logps"] = ref
    loss_fn = PreferenceLoss(cfg.loss, cfg.beta, reference, gamma=cfg.gamma, orpo_lambda=cfg.orpo_lambda)
    metrics, records = evaluate_pairs(loaded.model, examples, features, loss_fn, collate, batch_size,
                                      loaded.accelerator)
    return described, len(examples), metrics, records


def inspect(cfg: DPOConfig, out: str | None = None, show: int = 2, color: bool | None = None,
            say: Say = print) -> dict[str, Any]:
    """``surefit inspect --task dpo``: both sequences of each pair as training would supervise them, without loading
    the model's weights. The first ``show`` pairs are printed with the supervised spans marked; ``out``: one JSON
    object per pair (``where``, ``prompt_len``, and ``input_ids`` / ``labels`` / ``text`` of each sequence)."""
    import sys

    source = resolve_model(cfg.model)
    # A training run with these settings encoded every pair of --data already (training's and validation's, when no
    # --val_data file is given): read them from the encoded-data cache instead of encoding a large file again.
    found = stored_pairs(cfg, source, say) if cfg.val_data is None else None
    examples: Sequence[PairExample]
    failures: list[tuple[str, str]] = []
    if found is not None:
        say(f"encoded data: read from the cache {found.store.folder} (no encoding; --no_cache encodes again)")
        tokenizer, fmt = found.tokenizer, found.summary.format
        chat, why = resolve_chat_template(tokenizer, cfg.chat_template, cfg.chat_format)
        examples, rep = _StoredAll(found.examples, found.val_ex), PairReport("all", excluded=[
            (e["where"], e["reason"]) for e in found.excluded])
        for split in ("train", "validation"):
            counts = (found.summary.encoding or {}).get(split, {})
            for name in ("rows", "encoded", "truncated", "tokens_cut", "tokens", "supervised_tokens", "prompt_tokens"):
                setattr(rep, name, getattr(rep, name) + int(counts.get(name, 0)))
    else:
        rows, _, report = load_pairs(replace(cfg, val_fraction=0.0), say)
        tokenizer, _ = load_tokenizer(model_folder(source, log=say), source, cfg.trust_remote_code)
        chat, why = resolve_chat_template(tokenizer, cfg.chat_template, cfg.chat_format)
        examples, rep, failures, _ = encode_pairs(rows, tokenizer, chat, max_seq_length=cfg.max_seq_length,
                                                  truncation=cfg.truncation, split="all")
        fmt = report.format
    if color is None:
        color = sys.stdout.isatty()
    on, off = ("\033[1;32m", "\033[0m") if color else ("[[", "]]")
    for ex in examples[:show]:
        say(f"--- {ex.row.where}: shared prompt {ex.prompt_len} tokens (supervised spans marked {on}like this{off}) ---")
        say("chosen:   " + marked_text(tokenizer, Example(ex.chosen_ids, ex.chosen_labels, ex.prompt_len, ex.row), on,
                                       off))
        say("rejected: " + marked_text(tokenizer, Example(ex.rejected_ids, ex.rejected_labels, ex.prompt_len, ex.row),
                                       on, off))
    for where, reason in (rep.excluded + failures)[:10]:
        say(f"  excluded {where}: {reason}")
    say(rep.summary())
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for ex in examples:
                record = {"where": ex.row.where, "prompt_len": ex.prompt_len}
                for side in ("chosen", "rejected"):
                    ids, labels = getattr(ex, f"{side}_ids"), getattr(ex, f"{side}_labels")
                    record[side] = {"input_ids": ids, "labels": labels,
                                    "text": marked_text(tokenizer, Example(ids, labels, ex.prompt_len, ex.row), "[[",
                                                        "]]")}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        say(f"wrote {len(examples)} pairs to {path}")
    return {"format": fmt, "rows": rep.rows, "encoded": rep.encoded, "tokens": rep.tokens,
            "supervised_tokens": rep.supervised_tokens, "excluded": len(rep.excluded) + len(failures),
            "template": why if chat is not None else "prompts as written"}


class _StoredAll(Sequence[PairExample]):
    """Training's pairs (read from the store), then validation's."""

    def __init__(self, train: Sequence[PairExample], val: list[PairExample]) -> None:
        self.train, self.val = train, val

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    @overload
    def __getitem__(self, i: int) -> PairExample: ...
    @overload
    def __getitem__(self, i: slice) -> list[PairExample]: ...
    def __getitem__(self, i: int | slice) -> PairExample | list[PairExample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair {i} of {len(self)}")
        i %= len(self)
        return self.train[i] if i < len(self.train) else self.val[i - len(self.train)]
