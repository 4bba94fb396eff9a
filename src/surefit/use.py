"""Use a finished run: evaluate it, predict with it, export it (``surefit eval``, ``predict``, ``export``).

A run folder (``--output_dir`` of ``surefit train``) says everything needed: ``config.yaml`` names the task, the
model and every setting; ``final/`` holds the trained weights (a LoRA adapter, a full model, a backbone + head, or a
custom model's safetensors). Nothing is re-implemented here: the validation data is re-derived with the task's own
``load_data`` (same files, split, seed, limit), encoded with the task's own encoding, and scored with the same
functions that scored each epoch, so ``surefit eval`` on a run reproduces the last epoch of its ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from surefit.config import TASK_CONFIGS, build_config, load_yaml
from surefit.errors import ConfigError, DataError, ModelError, Problem, SurefitError, raise_if
from surefit.models import ModelSource

Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ------------------------------------------------------------------------------------------------------------ the run


@dataclass
class Run:
    """A finished run folder.

    Attributes:
        folder: the run folder; final: ``folder/final``; cfg: the config it was trained with.
        report: ``data_report.json`` (``{}`` if absent); last_epoch: the last epoch record of ``metrics.jsonl``.
        plan: ``memory_plan.json`` (``{}`` if absent): the evaluation batch and frozen-weight dtype training used.
    """

    folder: Path
    cfg: Any
    final: Path
    report: dict[str, Any] = field(default_factory=dict)
    last_epoch: dict[str, Any] | None = None
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def eval_batch_size(self) -> int:
        return int(self.plan.get("eval_batch_size") or self.cfg.resolved_eval_batch_size)

    @property
    def frozen_dtype(self) -> str | None:
        """``bf16``/``fp16`` when training stored the frozen (non-LoRA) weights in 16 bits under mixed precision."""
        return self.plan.get("frozen_dtype")

    @property
    def precision(self) -> str:
        """The precision training ran in (``memory_plan.json``; the config's setting for runs without a plan), so
        that ``precision: auto`` resolves for evaluation as it did for training."""
        return self.plan.get("precision") or self.cfg.precision

    @property
    def task(self) -> str:
        return self.cfg.task

    @property
    def config_path(self) -> Path:
        return self.folder / "config.yaml"

    def where(self, key: str) -> str:
        """How a setting of the run is named in messages: the file and the key."""
        return f"{self.config_path} '{key}'"


_RUN_FIX = "pass the folder given as --output_dir to `surefit train` (it holds config.yaml, metrics.jsonl and final/)"


def open_run(run: str | os.PathLike) -> Run:
    """Check and read a run folder; every problem names the folder and what to pass instead."""
    folder = Path(run)
    if not folder.exists():
        raise SurefitError(Problem(f"no such folder: {folder} (looked in {Path.cwd()})", "--run", _RUN_FIX))
    if not folder.is_dir():
        raise SurefitError(Problem(f"{folder} is a file, not a run folder", "--run", _RUN_FIX))
    config_path = folder / "config.yaml"
    if not config_path.is_file():
        if (folder.parent / "config.yaml").is_file() and folder.name in ("final", "checkpoints"):
            fix = f"pass the run folder itself: --run {folder.parent}"
        else:
            fix = _RUN_FIX
        held = sorted(p.name for p in folder.iterdir())[:8]
        raise SurefitError(Problem(f"{folder} has no config.yaml, so it is not a surefit run folder (it holds: "
                                   f"{', '.join(held) or 'nothing'})", "--run", fix))
    values = load_yaml(config_path)
    task = str(values.pop("task", "sft"))
    cls = TASK_CONFIGS.get(task)
    if cls is None:
        raise ConfigError(Problem(f"unknown task {task!r} in {config_path}", f"{config_path} 'task'",
                                  f"use one of: {', '.join(sorted(TASK_CONFIGS))}"))
    cfg = build_config(cls, values, None, yaml_name=str(config_path))
    final = folder / "final"
    if not final.is_dir():
        if (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir()):
            fix = (f"finish the training first: surefit train --config {config_path} --output_dir {folder} --resume "
                   "(it continues from the newest checkpoint and writes final/)")
        else:
            fix = "train the run to the end: final/ is written after the last epoch"
        raise SurefitError(Problem(f"{folder} has no final/ folder: the run did not finish (interrupted, failed, or "
                                   "still training)", "--run", fix))
    expected = _final_files(cfg)
    if not any(all((final / name).exists() for name in group) for group in expected):
        wanted = " or ".join(" + ".join(group) for group in expected)
        held = sorted(p.name for p in final.iterdir())[:8]
        raise SurefitError(Problem(f"{final} does not hold a trained {cfg.task} model: expected {wanted} (it holds: "
                                   f"{', '.join(held) or 'nothing'})", "--run",
                                   "the run folder is incomplete or was changed by hand; train the run again"))
    report, plan = (json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
                    for p in (folder / "data_report.json", folder / "memory_plan.json"))
    return Run(folder, cfg, final, report, _last_epoch(folder / "metrics.jsonl"), plan)


def _final_files(cfg: Any) -> list[tuple[str, ...]]:
    """The alternatives of what ``final/`` holds for the run's task."""
    if cfg.task == "custom":
        return [("model.safetensors", "surefit_model.json")]
    if cfg.task == "classify" and cfg.head:
        return [("backbone", "head.safetensors", "surefit_head.json")]
    return [("adapter_config.json",), ("config.json",)]


def _last_epoch(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash; the run's metrics are read for comparison only
        if isinstance(record, dict) and record.get("type") == "epoch":
            last = record
    return last


def _is_lora(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def _from_config(e: SurefitError, run: Run, keys: tuple[str, ...]) -> SurefitError:
    """Problems a task names by flag (``--model``, ``--head``) are about the run's config.yaml here; say so."""
    hint = (f" Relative paths in {run.config_path} are resolved from the current folder ({Path.cwd()}): run surefit "
            "from the folder the training ran in, or edit the path in config.yaml.")
    problems = []
    for p in e.problems:
        key = next((k for k in keys if p.where == f"--{k}"), None)
        if key is None:
            problems.append(p)
        else:
            problems.append(Problem(p.what, run.where(key), (p.fix.rstrip(".") + "." if p.fix else "") + hint))
    return type(e)(problems)


def _base_model(run: Run, say: Say) -> tuple[str, ModelSource]:
    """The base model the run was trained from (a LoRA adapter is applied to it), resolved as training did."""
    from surefit.models import model_folder, resolve_model

    try:
        source = resolve_model(run.cfg.model, default="encoder" if run.task == "classify" else "lm")
        return model_folder(source, log=say), source
    except ModelError as e:
        raise _from_config(e, run, ("model",)) from e


def _store_frozen_as_trained(run: Run, model: Any) -> None:
    """Frozen weights in the dtype training kept them in (the planner's choice under mixed precision with LoRA), so
    that evaluation computes what training's evaluation computed."""
    from surefit.training.lora_fast import fuse_lora

    fuse_lora(model)  # the forward training used (adapters summed in fp32)
    if run.frozen_dtype:
        import torch

        from surefit.training.plan import store_frozen_in

        store_frozen_in(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[run.frozen_dtype])


def _check_training_data(run: Run) -> None:
    """The run's own data must be reachable to re-derive its validation split."""
    problems = []
    for key in ("data", "val_data"):
        value = getattr(run.cfg, key)
        factory = run.task == "custom" and ":" in str(value)  # a dataset factory module:make, not a path
        if value and not factory and not Path(value).exists():
            problems.append(Problem(
                f"the run's {'training' if key == 'data' else 'validation'} data {value!r} is not found from "
                f"{Path.cwd()}; the validation split is re-derived from it", run.where(key),
                "run surefit from the folder the training ran in, or pass --data FILE to evaluate on other data"))
    raise_if(problems, DataError)


# ------------------------------------------------------------------------------------------------------------ loading


@dataclass
class Loaded:
    """A run's model, ready for inference, with what its task needs to encode inputs."""

    model: Any
    tokenizer: Any
    accelerator: Any
    extra: dict[str, Any] = field(default_factory=dict)


def load_sft(run: Run, say: Say = print, as_trained: bool = True) -> Loaded:
    """The causal LM (base + LoRA adapter, or the full model), its tokenizer and the run's prompt format.

    ``as_trained``: frozen weights in the dtype training computed with (``False``: fp32, e.g. to merge for export).
    """
    from surefit.data.encode import build_prompt_format
    from surefit.models import load_causal_lm, load_tokenizer
    from surefit.tasks.sft import eos_token_ids
    from surefit.training.loop import make_accelerator

    cfg = run.cfg
    final_source = ModelSource("folder", str(run.final), str(run.final))
    tokenizer, _ = load_tokenizer(str(run.final), final_source, cfg.trust_remote_code)
    if _is_lora(run.final):
        from peft import PeftModel

        path, source = _base_model(run, say)
        # Adapters marked trainable as in training: what stays frozen is what training may have stored in 16 bits.
        model = PeftModel.from_pretrained(load_causal_lm(path, source, cfg.trust_remote_code), str(run.final),
                                          is_trainable=bool(run.frozen_dtype))
        if as_trained:
            _store_frozen_as_trained(run, model)
    else:
        model = load_causal_lm(str(run.final), final_source, cfg.trust_remote_code)
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    fmt = build_prompt_format(tokenizer, cfg.template, cfg.chat_template)
    return Loaded(model, tokenizer, accelerator, {"fmt": fmt, "eos": eos_token_ids(model, tokenizer)})


def label_spec(run: Run, label_field: str | None = None) -> Any:
    """The run's labels (as training built them), from ``data_report.json`` or the saved model's config."""
    from surefit.data.labels import LabelSpec

    report = run.report
    ptype = report.get("problem_type")
    label2id = report.get("label2id")
    if ptype is None:
        saved = _saved_label_config(run)
        ptype, label2id = saved.get("problem_type"), saved.get("label2id")
    if ptype is None:
        raise SurefitError(Problem(f"cannot tell the labels of {run.folder}: data_report.json has no problem_type and "
                                   "the saved model has no label mapping", "--run",
                                   "the run folder is incomplete; train the run again"))
    names = [] if ptype == "regression" else [n for n, _ in sorted(label2id.items(), key=lambda kv: kv[1])]
    fields = report.get("fields") or {}
    label = label_field or fields.get("label") or run.cfg.label_field or "label"
    return LabelSpec(problem_type=ptype, field=label, names=names, kind="str", how=f"the labels of {run.folder}")


_HF_TO_OURS = {"single_label_classification": "single", "multi_label_classification": "multi",
               "regression": "regression"}


def _saved_label_config(run: Run) -> dict[str, Any]:
    if (run.final / "surefit_head.json").is_file():
        spec = json.loads((run.final / "surefit_head.json").read_text(encoding="utf-8"))
        id2label = {int(k): v for k, v in (spec.get("id2label") or {}).items()}
        return {"problem_type": spec.get("problem_type"), "label2id": {v: k for k, v in id2label.items()}}
    if (run.final / "config.json").is_file():
        config = json.loads((run.final / "config.json").read_text(encoding="utf-8"))
        return {"problem_type": _HF_TO_OURS.get(config.get("problem_type")), "label2id": config.get("label2id")}
    return {}


def load_classify(run: Run, spec: Any, say: Say = print, as_trained: bool = True) -> Loaded:
    """The classifier as it was trained: a transformers classifier (full or base + adapter) or backbone + head."""
    from transformers import AutoTokenizer

    from surefit.tasks.classify import build_model, model_inputs
    from surefit.training.loop import make_accelerator

    cfg = run.cfg
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(run.final), trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(Problem(f"cannot load the tokenizer saved in {run.final}: {type(e).__name__}: {e}", "--run",
                                 "the run folder is incomplete; train the run again")) from e
    lora = cfg.lora_r > 0
    if cfg.head:
        path = _base_model(run, say)[0] if lora else str(run.final / "backbone")
    else:
        path = _base_model(run, say)[0] if lora else str(run.final)
    try:
        model = build_model(cfg, path, spec, say=_quiet)  # its head is replaced by the trained one below
    except ConfigError as e:
        raise _from_config(e, run, ("head", "head_args")) from e
    max_len, tokenizer_keys, accepted = model_inputs(cfg, model, tokenizer, say=_quiet)
    if cfg.head:
        from safetensors.torch import load_file

        if lora:
            from peft import PeftModel

            model.backbone = PeftModel.from_pretrained(model.backbone, str(run.final / "backbone"),
                                                       is_trainable=bool(run.frozen_dtype))
        model.head.load_state_dict(load_file(str(run.final / "head.safetensors")))
    elif lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(run.final), is_trainable=bool(run.frozen_dtype))
    if lora and as_trained:
        _store_frozen_as_trained(run, model)
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    keys = [k for k in tokenizer_keys if k in accepted]
    return Loaded(model, tokenizer, accelerator, {"max_len": max_len, "keys": keys})


def load_custom(run: Run, keys: list[str]) -> Loaded:
    """The factory's model with the trained weights, and how surefit calls it (``keys``: the data's arrays)."""
    from safetensors.torch import load_model

    from surefit.heads import load_factory
    from surefit.tasks.custom import Caller, forward_protocol
    from surefit.training.loop import make_accelerator

    spec_path = run.final / "surefit_model.json"
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    try:
        factory = load_factory(spec["factory"], flag="--model")
    except ConfigError as e:
        raise _from_config(e, run, ("model",)) from e
    model = factory(**spec.get("model_args", {}))
    missing, unexpected = load_model(model, str(run.final / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise ModelError(Problem(
            f"{run.final / 'model.safetensors'} does not fit the model {spec['factory']} builds: missing "
            f"{', '.join(missing[:5]) or 'none'}; unexpected {', '.join(unexpected[:5]) or 'none'}",
            f"{spec_path} 'factory'", "the factory changed since training; restore it or train again"))
    mode, passed, problems = forward_protocol(model, keys)
    raise_if(problems, DataError)
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    return Loaded(model, None, accelerator, {"caller": Caller(run.cfg, mode, passed)})


# ------------------------------------------------------------------------------------------------------------ eval


def evaluate(run: str | os.PathLike, data: str | None = None, *, batch_size: int | None = None,
             max_new_tokens: int | None = None, predictions: str | os.PathLike | None = None,
             fields: dict[str, str | None] | None = None, say: Say = print) -> dict[str, Any]:
    """Evaluate a finished run on its own validation split (re-derived as training did) or on ``data``.

    Args:
        run: the run folder. data: another file (sft, classify) or tensor folder (custom) to evaluate on.
        batch_size: evaluation batch (default: the run's, so that the numbers match its last epoch exactly).
        max_new_tokens: sft generation length (default: the run's).
        predictions: write one JSON line per example (input, gold, prediction) to this file.
        fields: column overrides for ``data``: ``input_field``/``target_field`` (sft), ``text_field``,
            ``text_pair_field``, ``label_field`` (classify).

    Returns:
        ``{"run", "task", "data", "rows", "metrics", "training"}``; ``training`` holds the last epoch's values of the
        same metrics from ``metrics.jsonl`` when the run's own validation split was evaluated (else ``None``).
    """
    from surefit.training.run import quiet_libraries

    quiet_libraries()
    _check_counts(batch_size=batch_size, max_new_tokens=max_new_tokens)
    r = open_run(run)
    _check_fields(r, fields or {})
    given = [k for k, v in (fields or {}).items() if v is not None]
    if data is None and given:
        raise ConfigError([Problem(f"--{k} names a column of --data, and no --data was given (the run's own validation "
                                   "data is read with the run's fields)", f"--{k}", "pass --data FILE, or drop it")
                           for k in given])
    bs = batch_size or r.eval_batch_size
    evaluator = {"sft": _eval_sft, "classify": _eval_classify, "custom": _eval_custom}[r.task]
    described, n, metrics, records = evaluator(r, data, bs, max_new_tokens, fields or {}, say)
    if predictions is not None:
        path = Path(predictions)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    training = None
    if data is None and r.last_epoch is not None:
        training = {"epoch": r.last_epoch.get("epoch")}
        training.update({k: r.last_epoch[k] for k in metrics if k in r.last_epoch})
    return {"run": str(r.folder), "task": r.task, "data": described, "rows": n, "metrics": metrics,
            "training": training}


def _validation_described(cfg: Any) -> str:
    if cfg.val_data:
        return f"validation data {cfg.val_data} (read as in training)"
    return f"validation split of {cfg.data} (re-derived as in training)"


def _check_counts(**values: int | None) -> None:
    raise_if([Problem(f"must be >= 1 (got {v})", f"--{k}") for k, v in values.items() if v is not None and v < 1],
             ConfigError)


_FIELD_FLAGS = {"sft": ("input_field", "target_field"), "classify": ("text_field", "text_pair_field", "label_field"),
                "custom": ()}


def _check_fields(run: Run, fields: dict[str, str | None]) -> None:
    wrong = [k for k, v in fields.items() if v is not None and k not in _FIELD_FLAGS[run.task]]
    if wrong:
        allowed = ", ".join(f"--{k}" for k in _FIELD_FLAGS[run.task]) or "none"
        raise ConfigError([Problem(f"--{k} does not apply to a {run.task} run ({run.folder})", f"--{k}",
                                   f"drop it (field flags of {run.task} runs: {allowed})") for k in wrong])


def _read(path: str, text_fields: list[tuple[str, str]]) -> list[Any]:
    """Rows of ``path`` with every text field checked; problems name the file and line."""
    from surefit.data.sources import _SKIP_HINT, check_text_fields, read_rows
    from surefit.errors import raise_input_problems

    problems: list[Problem] = []
    rows = read_rows(path, problems)
    if rows:
        rows, _ = check_text_fields(rows, text_fields, problems, str(path))
    # The readers suggest --on_bad_rows skip, a training flag: here every row gets a result, so none is dropped.
    raise_input_problems([dataclasses.replace(p, fix=p.fix.replace(f"; {_SKIP_HINT}", "").replace(_SKIP_HINT, ""))
                          for p in problems])
    return rows


def _eval_sft(run: Run, data: str | None, bs: int, max_new: int | None, fields: dict, say: Say):
    from surefit.data.encode import encode_rows
    from surefit.tasks.sft import evaluate_examples, load_data, prediction_records

    cfg = run.cfg
    input_field = fields.get("input_field") or cfg.input_field
    target_field = fields.get("target_field") or cfg.target_field
    train_rows = None
    if data is None:
        _check_training_data(run)
        with tempfile.TemporaryDirectory(prefix="surefit-eval-") as tmp:  # load_data may write rejected_rows.jsonl
            train_rows, rows, _ = load_data(dataclasses.replace(cfg, output_dir=tmp), say=_quiet)
        described = _validation_described(cfg)
    else:
        rows = _read(data, [(input_field, "--input_field"), (target_field, "--target_field")])
        described = str(data)
    loaded = load_sft(run, say)
    enc = dict(max_seq_length=cfg.max_seq_length, input_field=input_field, target_field=target_field,
               truncation_side=cfg.truncation_side)
    examples, rep = encode_rows(rows, loaded.tokenizer, loaded.extra["fmt"], split="evaluation", **enc)
    for where, why in rep.excluded[:10]:
        say(f"excluded {where}: {why}")
    if not examples:
        raise DataError(Problem(f"no rows of {described} fit: all {rep.rows} targets are longer than "
                                f"max_seq_length {cfg.max_seq_length} allows", run.where("max_seq_length"),
                                "evaluate on rows with shorter targets"))
    max_new = _max_new_tokens(run, max_new, loaded, train_rows, enc)
    metrics, preds, golds = evaluate_examples(loaded.model, examples, loaded.tokenizer, target_field=target_field,
                                              eos_token_ids=loaded.extra["eos"], max_new_tokens=max_new,
                                              batch_size=bs, accelerator=loaded.accelerator, say=say)
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
        from surefit.data.encode import encode_rows

        longest = encode_rows(train_rows, loaded.tokenizer, loaded.extra["fmt"], split="train", **enc)[1].longest_target
    if not longest:
        raise ConfigError(Problem(f"cannot tell how many tokens to generate: {run.folder / 'data_report.json'} does not "
                                  "give the longest training target", "--max_new_tokens", "pass --max_new_tokens N"))
    return longest + 4


def _classify_fields(run: Run, fields: dict, texts_given: bool = False) -> Any:
    """The columns the run was trained on (flags override): data_report.json, else the run's columns.json."""
    from surefit.data.labels import Fields

    saved = run.report.get("fields") or _fields_from_columns(run.folder / "columns.json")
    text = fields.get("text_field") or saved.get("text") or run.cfg.text_field
    pair = fields.get("text_pair_field") or saved.get("pair") or run.cfg.text_pair_field
    label = fields.get("label_field") or saved.get("label") or run.cfg.label_field
    if text is None and texts_given:
        text = "text"  # --input texts are not read from a column: any name will do
    if text is None:
        raise SurefitError(Problem(f"cannot tell which field the run {run.folder} read its text from "
                                   "(neither data_report.json nor columns.json says)", "--text_field",
                                   "pass --text_field NAME (and --text_pair_field NAME for pairs)"))
    return Fields(text=text, pair=pair, label=label or "label")


def _fields_from_columns(path: Path) -> dict[str, str]:
    """Runs trained before data_report.json recorded the fields: the kept / dropped table names them."""
    if not path.is_file():
        return {}
    roles = {"text:": "text", "second text of the pair": "pair", "label:": "label"}
    found: dict[str, str] = {}
    for entry in json.loads(path.read_text(encoding="utf-8")):
        for prefix, role in roles.items():
            if entry.get("status") == "kept" and str(entry.get("why", "")).startswith(prefix):
                found.setdefault(role, entry["column"])
    return found


def _eval_classify(run: Run, data: str | None, bs: int, max_new: int | None, fields: dict, say: Say):
    from surefit.data.collate import PadCollator
    from surefit.tasks.classify import _text_of, encode, load_data, predict_logits, scores
    from surefit.training.memory import shrink_on_oom

    cfg = run.cfg
    if data is None:
        _check_training_data(run)
        with tempfile.TemporaryDirectory(prefix="surefit-eval-") as tmp:
            _, rows, flds, spec, _ = load_data(dataclasses.replace(cfg, output_dir=tmp), say=_quiet)
        described = _validation_described(cfg)
    else:
        flds = _classify_fields(run, fields)
        spec = label_spec(run, flds.label)
        text_fields = [(flds.text, "--text_field")] + ([(flds.pair, "--text_pair_field")] if flds.pair else [])
        rows = _read(data, text_fields)
        _check_labels(rows, spec, data)
        described = str(data)
    loaded = load_classify(run, spec, say)
    feats, rep = encode(rows, loaded.tokenizer, flds, spec, loaded.extra["max_len"], loaded.extra["keys"], "evaluation")
    if rep["truncated"]:
        say(f"{rep['truncated']} of {rep['rows']} texts truncated to {loaded.extra['max_len']} tokens "
            f"(e.g. {', '.join(rep['truncated_rows'][:3])})")
    collate = PadCollator(pad_token_id=loaded.tokenizer.pad_token_id,
                          stack_keys=("labels",) if spec.problem_type == "multi" else ())
    logits, loss = shrink_on_oom(
        lambda b: predict_logits(loaded.model, feats, collate, b, loaded.accelerator, spec.problem_type),
        bs, "evaluation", say)
    metrics, preds = scores(logits, feats, spec)
    records = [{"where": row.where, "text": _text_of(row, flds), "gold": row.fields[spec.field], "prediction": pred}
               for row, pred in zip(rows, preds, strict=True)]
    return described, len(rows), {"eval_loss": loss, **metrics}, records


def _check_labels(rows: list[Any], spec: Any, source: str) -> None:
    """Every row's label must be one the run was trained on; one problem lists every bad row."""
    from surefit.data.sources import _field_not_found

    present = sorted({name for row in rows for name in row.fields})
    if spec.field not in present:
        raise DataError(_field_not_found(spec.field, "--label_field", present, source))
    bad: list[str] = []
    for row in rows:
        try:
            spec.encode(row.fields.get(spec.field))
        except ValueError:
            loc = row.where[len(source) + 1 :] if row.where.startswith(f"{source} ") else row.where
            bad.append(f"{loc} ({row.fields.get(spec.field)!r})")
    if bad:
        known = "numbers" if spec.problem_type == "regression" else ", ".join(repr(n) for n in spec.names)
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise DataError(Problem(f"{len(bad)} of {len(rows)} rows have a label '{spec.field}' the run was not trained "
                                f"on: {', '.join(bad[:10])}{more}", source,
                                f"the run's labels are {known}; fix or remove these rows"))


def _eval_custom(run: Run, data: str | None, bs: int, max_new: int | None, fields: dict, say: Say):
    from surefit.data.tensors import load_tensor_data
    from surefit.tasks.custom import mean_loss, split_indices

    cfg = run.cfg
    if data is None:
        _check_training_data(run)
        if cfg.val_data:
            source = load_tensor_data(cfg.val_data, cfg.max_memory_gb)
            indices = list(range(len(source)))
        else:
            source = load_tensor_data(cfg.data, cfg.max_memory_gb)
            indices = split_indices(len(source), cfg.val_fraction, cfg.seed)[1]
        described = _validation_described(cfg)
    else:
        source = load_tensor_data(data, cfg.max_memory_gb)
        indices = list(range(len(source)))
        described = str(data)
    loaded = load_custom(run, list(source.arrays))
    caller = loaded.extra["caller"]
    if cfg.loss != "auto" and cfg.labels_key not in source.arrays:
        raise DataError(Problem(f"{described} has no '{cfg.labels_key}' array (it has {', '.join(source.arrays)}); "
                                f"the run's loss {cfg.loss} needs it", "--data", f"add a '{cfg.labels_key}' array"))
    avg = mean_loss(loaded.model, caller, source, indices, bs, loaded.accelerator)
    return described, len(indices), {"eval_loss": avg, "avg_valid_loss": avg}, []


def render_eval(result: dict[str, Any]) -> str:
    """The evaluation as a table (and, for a classifier, per-class F1 and the confusion matrix)."""
    metrics, training = result["metrics"], result["training"]
    lines = [f"{result['task']} run {result['run']} on {result['data']}: {result['rows']} rows"]
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    width = max(len(k) for k in scalars) if scalars else 6
    head = f"  {'metric'.ljust(width)}  {'now':>8}"
    if training:
        head += f"  {'metrics.jsonl, epoch ' + str(training.get('epoch')):>25}"
    lines.append(head)
    for k, v in scalars.items():
        line = f"  {k.ljust(width)}  {_num(v):>8}"
        if training and k in training:
            line += f"  {_num(training[k]):>25}"
        lines.append(line)
    per_class = metrics.get("eval_per_class_f1")
    if per_class:
        lines.append("  per-class F1: " + ", ".join(f"{name} {_num(v)}" for name, v in per_class.items()))
    cm = metrics.get("eval_confusion_matrix")
    if cm:
        names = [str(n) for n in metrics.get("labels", range(len(cm)))]
        w = max(max(len(n) for n in names), max(len(str(x)) for row in cm for x in row), 4)
        lines.append("  confusion (rows: gold, columns: predicted)")
        lines.append("    " + " " * w + "  " + "  ".join(n.rjust(w) for n in names))
        for name, row in zip(names, cm, strict=True):
            lines.append("    " + name.rjust(w) + "  " + "  ".join(str(x).rjust(w) for x in row))
    return "\n".join(lines)


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else "nan" if math.isnan(v) else f"{v:.4f}"


# ------------------------------------------------------------------------------------------------------------ predict


def predict(run: str | os.PathLike, inputs: str | list[str] | None = None, file: str | os.PathLike | None = None, *,
            out: str | os.PathLike | None = None, stream: TextIO | None = None, collect: bool = True,
            batch_size: int | None = None, max_new_tokens: int | None = None,
            fields: dict[str, str | None] | None = None, say: Say = print) -> list[dict[str, Any]]:
    """Predict with a finished sft or classify run: one record per input, in input order.

    sft records hold the generated ``prediction`` (the run's prompt format, greedy, stopped at EOS); classify records
    the ``label`` (``labels`` for multi-label, ``value`` for regression) and ``probabilities`` per label.

    Args:
        run: the run folder. inputs: one text or a list of texts. file: rows (JSONL, JSON, CSV, TSV, Parquet) holding
            the run's input field (sft) or text field(s) (classify); every bad row is reported, with its line, before
            anything is predicted.
        out: write the records as JSON lines to this file. stream: write each record to this text stream (e.g.
            ``sys.stdout``) as soon as its batch is done. collect: also return the records (``False`` for files too
            large to hold).
        batch_size: rows per batch (default: the run's evaluation batch). max_new_tokens: sft generation length.
        fields: ``input_field`` (sft) or ``text_field``/``text_pair_field`` (classify) to read from ``file``.
    """
    from surefit.training.run import quiet_libraries

    quiet_libraries()
    _check_counts(batch_size=batch_size, max_new_tokens=max_new_tokens)
    r = open_run(run)
    fields = {k: v for k, v in (fields or {}).items() if v is not None}
    _check_fields(r, fields)
    if r.task == "custom":
        raise ConfigError(Problem(f"{r.folder} is a custom-task run: predict works on text runs (sft, classify)",
                                  "--run", "load final/model.safetensors with your factory (see final/surefit_model.json), "
                                  "or use `surefit eval --run ... --data FOLDER` for its loss"))
    if (inputs is None) == (file is None):
        raise ConfigError(Problem("give either --input TEXT or --file ROWS" if inputs is None else
                                  "both --input and --file given", "--input", "use one of them"))
    bs = batch_size or r.eval_batch_size
    records: list[dict[str, Any]] = []
    count = 0
    if out is not None:
        if Path(out).is_dir():
            raise ConfigError(Problem(f"{out} is a folder", "--out", "pass a file path, e.g. predictions.jsonl"))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    fh = Path(out).open("w", encoding="utf-8") if out is not None else None
    try:
        gen = _predict_sft if r.task == "sft" else _predict_classify
        for batch in gen(r, _input_rows(r, inputs, file, fields), bs, max_new_tokens, say):
            for rec in batch:
                line = json.dumps(rec, ensure_ascii=False) + "\n"
                for sink in (fh, stream):
                    if sink is not None:
                        sink.write(line)
            for sink in (fh, stream):
                if sink is not None:
                    sink.flush()
            count += len(batch)
            if collect:
                records += batch
    finally:
        if fh is not None:
            fh.close()
    if out is not None:
        say(f"wrote {count} prediction{'s' if count != 1 else ''} to {out}")
    return records


def _input_rows(run: Run, inputs: str | list[str] | None, file: Any, fields: dict) -> tuple[list[Any], Any]:
    """(rows, fields) to predict on: the texts given, or the file's rows with every problem reported at once."""
    from surefit.data.rows import Row

    if run.task == "sft":
        flds = fields.get("input_field") or run.cfg.input_field
        text_fields = [(flds, "--input_field")]
    else:
        flds = _classify_fields(run, fields, texts_given=file is None)
        text_fields = [(flds.text, "--text_field")] + ([(flds.pair, "--text_pair_field")] if flds.pair else [])
    if file is not None:
        return _read(str(file), text_fields), flds
    texts = [inputs] if isinstance(inputs, str) else list(inputs or [])
    problems = []
    if len(text_fields) > 1:
        problems.append(Problem(f"the run classifies text pairs ('{text_fields[0][0]}' + '{text_fields[1][0]}'); "
                                "--input gives one text", "--input", "give rows holding both fields with --file"))
    rows = []
    for i, text in enumerate(texts):
        where = "--input" if len(texts) == 1 else f"--input #{i + 1}"
        if not isinstance(text, str) or not text.strip():
            problems.append(Problem(f"empty input ({text!r})", where, "give the text to predict on"))
        rows.append(Row({text_fields[0][0]: text}, where, i))
    if not texts:
        problems.append(Problem("no input given", "--input", "give the text to predict on"))
    raise_if(problems, ConfigError)
    return rows, flds


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _predict_sft(run: Run, rows_fields: tuple, bs: int, max_new: int | None, say: Say) -> Iterator[list[dict]]:
    from surefit.data.encode import encode_prompts
    from surefit.tasks.sft import generate_texts

    rows, input_field = rows_fields
    cfg = run.cfg
    loaded = load_sft(run, say)
    enc = dict(max_seq_length=cfg.max_seq_length, input_field=cfg.input_field, target_field=cfg.target_field,
               truncation_side=cfg.truncation_side)
    max_new = _max_new_tokens(run, max_new, loaded, None, enc)
    # Like training, prompt + answer fit in max_seq_length: the input is cut (and counted) so that they do.
    room = max(cfg.max_seq_length - max_new, 1)
    for part in _chunks(rows, bs):
        texts = [str(r.fields[input_field]) for r in part]
        prompts, cut = encode_prompts(texts, loaded.tokenizer, loaded.extra["fmt"], max_prompt_length=room,
                                      truncation_side=cfg.truncation_side)
        preds = generate_texts(loaded.model, prompts, loaded.tokenizer, eos_token_ids=loaded.extra["eos"],
                               max_new_tokens=max_new, batch_size=bs, accelerator=loaded.accelerator, say=say)
        batch = []
        for row, text, pred, n_cut in zip(part, texts, preds, cut, strict=True):
            rec = {"where": row.where, "input": text, "prediction": pred}
            if n_cut:
                rec["input_tokens_cut"] = n_cut
                say(f"{row.where}: {n_cut} input tokens cut from the {cfg.truncation_side} so that prompt + answer "
                    f"fit max_seq_length {cfg.max_seq_length}")
            batch.append(rec)
        yield batch


def _predict_classify(run: Run, rows_fields: tuple, bs: int, max_new: int | None, say: Say) -> Iterator[list[dict]]:
    from surefit.data.collate import PadCollator
    from surefit.tasks.classify import predict_logits, tokenize
    from surefit.training.memory import shrink_on_oom

    rows, flds = rows_fields
    spec = label_spec(run, flds.label)
    loaded = load_classify(run, spec, say)
    max_len = loaded.extra["max_len"]
    collate = PadCollator(pad_token_id=loaded.tokenizer.pad_token_id)
    for part in _chunks(rows, bs):
        feats, rep = tokenize(part, loaded.tokenizer, flds, max_len, loaded.extra["keys"], "predict")
        if rep["truncated"]:
            say(f"{rep['truncated']} of {rep['rows']} texts truncated to {max_len} tokens "
                f"(e.g. {', '.join(rep['truncated_rows'][:3])})")
        logits, _ = shrink_on_oom(
            lambda b, feats=feats: predict_logits(loaded.model, feats, collate, b, loaded.accelerator,
                                                  spec.problem_type),
            bs, "prediction", say)
        batch = []
        for row, lg in zip(part, logits, strict=True):
            rec: dict[str, Any] = {"where": row.where, "text": str(row.fields[flds.text])}
            if flds.pair:
                rec["text_pair"] = str(row.fields[flds.pair])
            if spec.problem_type == "single":
                probs = lg.softmax(-1).tolist()
                rec["label"] = spec.names[int(lg.argmax())]
                rec["probabilities"] = {n: round(p, 6) for n, p in zip(spec.names, probs, strict=True)}
            elif spec.problem_type == "multi":
                probs = lg.sigmoid().tolist()
                rec["labels"] = [n for n, p in zip(spec.names, probs, strict=True) if p > 0.5]
                rec["probabilities"] = {n: round(p, 6) for n, p in zip(spec.names, probs, strict=True)}
            else:
                rec["value"] = float(lg.reshape(-1)[0])
            batch.append(rec)
        yield batch


# ------------------------------------------------------------------------------------------------------------ export


def export(run: str | os.PathLike, to: str | os.PathLike, *, merge: bool = False, overwrite: bool = False,
           say: Say = print) -> Path:
    """Copy a run's final model to ``to``; with ``merge``, fold a LoRA adapter into the base weights first.

    A merged sft run is a plain causal LM (loads with ``AutoModelForCausalLM``, no peft), a merged or fully trained
    classifier a plain sequence classifier with ``label2id``/``id2label`` in its config; a backbone + custom head
    keeps that layout (``backbone/``, ``head.safetensors``, ``surefit_head.json``), with the backbone merged.

    Raises:
        SurefitError: ``to`` is not empty (without ``overwrite``), is a file, or holds the run itself.
    """
    from surefit.training.run import quiet_libraries

    quiet_libraries()
    r = open_run(run)
    dest = Path(to)
    _check_destination(r, dest, overwrite)
    lora_dir = r.final / "backbone" if r.task == "classify" and r.cfg.head else r.final
    lora = r.task != "custom" and _is_lora(lora_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if merge and lora:
            _write_merged(r, tmp, say)
            what = "merged model (adapter folded into the base weights)"
        else:
            shutil.copytree(r.final, tmp)
            if merge:
                say(f"--merge: {r.folder} was trained in full (no LoRA adapter); copied the model as it is")
            what = "LoRA adapter (load with peft; its base model is named in adapter_config.json)" if lora else "model"
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"exported the {what} of {r.folder} to {dest}")
    return dest


def _check_destination(run: Run, dest: Path, overwrite: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise SurefitError(Problem(f"{dest} is a file", "--to", "pass a folder path (new or empty)"))
    resolved, folder = dest.resolve(), run.folder.resolve()
    if resolved == folder or folder.is_relative_to(resolved) or resolved.is_relative_to(folder / "final"):
        raise SurefitError(Problem(f"{dest} holds the run {run.folder} (or is inside its final/); exporting there "
                                   "would replace the run", "--to", "pass a folder outside the run"))
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        held = sorted(p.name for p in dest.iterdir())
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise SurefitError(Problem(f"{dest} is not empty (it holds {shown}); exporting would replace it", "--to",
                                   "pass a new or empty folder, or --overwrite to replace its contents"))


def _write_merged(run: Run, folder: Path, say: Say) -> None:
    """Base + adapter -> one model with the adapter folded into its weights, in safetensors, plus the tokenizer."""
    folder.mkdir(parents=True)
    if run.task == "sft":
        loaded = load_sft(run, say, as_trained=False)
        merged = loaded.model.merge_and_unload()
        merged.save_pretrained(folder, safe_serialization=True)
        loaded.tokenizer.save_pretrained(folder)
        return
    loaded = load_classify(run, label_spec(run), say, as_trained=False)
    model = loaded.model
    if run.cfg.head:
        from safetensors.torch import save_file

        model.backbone.merge_and_unload().save_pretrained(folder / "backbone", safe_serialization=True)
        save_file({k: v.contiguous() for k, v in model.head.state_dict().items()}, folder / "head.safetensors")
        shutil.copy2(run.final / "surefit_head.json", folder / "surefit_head.json")
    else:
        model.merge_and_unload().save_pretrained(folder, safe_serialization=True)
    loaded.tokenizer.save_pretrained(folder)
