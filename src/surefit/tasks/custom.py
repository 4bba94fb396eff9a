"""Any ``nn.Module`` on named tensors: data -> model -> shape check -> loop -> final/, top to bottom.

The model comes from a factory (``--model file.py:build --model_args '{"vocab": 271}'``). Its forward is called as
``forward(**batch)`` with the keys it accepts (or ``forward(batch)`` when it takes one argument) and returns a loss
(a tensor, a dict or object with ``loss``, or a tuple whose first item is the loss) or logits, with ``--loss``
naming the loss to apply to ``labels``. Before step 1, one forward pass on a real batch runs under hooks: a shape
mismatch stops the run naming the input, the layer, what it expects, what arrived and the likely cause.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surefit.config.task_configs import CustomConfig
from surefit.config.yaml_files import load_json
from surefit.data.readers.common import short
from surefit.data.shards import TensorData, load_tensor_data
from surefit.data.summary import ArrayFacts, DataSummary
from surefit.doctor import check
from surefit.doctor.shapes import diagnose, first_layers, trace
from surefit.errors import ConfigError, DataError, ModelError, Problem, SurefitError, raise_if, raise_input_problems
from surefit.models import load_factory
from surefit.run_folder import COLUMNS, Found
from surefit.run_folder.open_run import Run
from surefit.tasks.finished_common import Loaded
from surefit.tasks.runner import Evaluation, Prepared, RunResult, render_columns, train
from surefit.training.loss import classification_loss_sum
from surefit.training.precision import make_accelerator, precision_name
from surefit.training.work import TrainingWork

# A custom run has no column flags for other data (its tensors are named by the shards).
FIELDS: tuple[str, ...] = ()

Say = Callable[[str], None]


def final_files(cfg: CustomConfig) -> list[tuple[str, ...]]:
    """What ``final/`` holds: the model's weights and the factory that builds it."""
    return [("model.safetensors", "surefit_model.json")]


# ------------------------------------------------------------------------------------------------------------ protocol


def forward_protocol(model: nn.Module, keys: list[str]) -> tuple[str, list[str], list[Problem]]:
    """How to call the forward: ``("kwargs", keys_passed)`` or ``("single", keys_passed)``, plus problems."""
    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return "kwargs", list(keys), []
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    passed = [k for k in keys if k in named]
    if passed:
        required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.name not in keys]
        if required:
            return "kwargs", passed, [Problem(
                f"{type(model).__name__}.forward requires {', '.join(required)}, which the data does not have "
                f"(arrays: {', '.join(keys)})", "--data", "add these arrays to the shards, or give them defaults")]
        return "kwargs", passed, []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) == 1:
        return "single", list(keys), []
    return "kwargs", [], [Problem(
        f"{type(model).__name__}.forward({', '.join(p.name for p in params)}) takes none of the data's arrays "
        f"({', '.join(keys)})", "--data", "name the arrays after the forward's arguments, or accept forward(batch)")]


def split_output(out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss, logits) from whatever the forward returned."""
    if isinstance(out, torch.Tensor):
        return (out, None) if out.dim() == 0 else (None, out)
    if isinstance(out, Mapping):
        return out.get("loss"), out.get("logits")
    if isinstance(out, (tuple, list)) and out:
        first = out[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            second = out[1] if len(out) > 1 and isinstance(out[1], torch.Tensor) else None
            return first, second
        return None, first if isinstance(first, torch.Tensor) else None
    return getattr(out, "loss", None), getattr(out, "logits", None)


class Caller:
    """Calls the user's model per its protocol and turns the output into ``(loss_sum, n_examples)``."""

    def __init__(self, cfg: CustomConfig, mode: str, passed: list[str]):
        self.cfg, self.mode = cfg, mode
        # With --loss, surefit computes the loss from logits: labels are not handed to the forward.
        self.passed = [k for k in passed if cfg.loss == "auto" or k != cfg.labels_key]

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        inputs = {k: batch[k] for k in self.passed}
        return model(inputs) if self.mode == "single" else model(**inputs)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        n = next(iter(batch.values())).shape[0]
        loss, logits = split_output(self.forward(model, batch))
        if self.cfg.loss == "auto":
            # A model's own loss is taken as the mean over its batch; times n makes it a sum over examples.
            return loss.float() * n, n  # type: ignore[union-attr]
        return classification_loss_sum(logits, batch[self.cfg.labels_key], self.cfg.loss), n  # type: ignore[arg-type]


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train_idx, val_idx)``: a seeded split by index (tensor rows are independent examples)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0  # 0: training without validation
    return sorted(order[n_val:]), sorted(order[:n_val])


def model_batch(source: TensorData, indices: list[int], caller: Caller) -> dict[str, torch.Tensor]:
    """The rows' arrays that the forward (or surefit's loss) uses; the others never leave the data."""
    batch = source.batch(indices)
    return {k: v for k, v in batch.items() if k in caller.passed or k == caller.cfg.labels_key}


@torch.no_grad()
def mean_loss(model: nn.Module, caller: Caller, source: TensorData, indices: list[int], batch_size: int,
              accelerator: Any) -> float:
    """Mean loss per example over ``indices`` of ``source`` (after each epoch, and by ``surefit eval``)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(indices), batch_size):
        part = indices[start : start + batch_size]
        batch = {k: v.to(accelerator.device) for k, v in model_batch(source, part, caller).items()}
        with accelerator.autocast():
            loss_sum, k = caller(model, batch)
        total += loss_sum.item()
        count += k
    model.train(was)
    return total / max(count, 1)


# ------------------------------------------------------------------------------------------------------------ checks


def check_before_step_1(model: nn.Module, caller: Caller, data: TensorData, cfg: CustomConfig,
                        model_args: dict[str, Any], say=print) -> list[Problem]:
    """One forward on a real batch under hooks, then the output, label and value checks."""
    problems: list[Problem] = []
    tr, batch, message = first_forward(model, caller, data, model_args)
    if message:
        return [Problem(message, "--data", "fix the data or the model as the likely cause says; "
                        "`surefit inspect --data DIR --model ...` shows every input's first layer")]
    if tr.uses:
        say("first layer of each input (one forward on 2 real examples):\n"
            + "\n".join(first_layers(tr, list(tr.uses), caller.passed)))
    for u in tr.uses.values():
        if u.agrees is False:
            problems.append(Problem(f"'{u.input}' arrives at {u.module} ({u.layer}) as {list(u.shape)} {u.dtype}, "
                                    f"which expects {u.expects}", "--data", "store the array as the layer expects"))
    with torch.no_grad():
        loss, logits = split_output(caller.forward(model, batch))
    labels_info = data.arrays.get(cfg.labels_key)
    if cfg.loss == "auto":
        if loss is None:
            got = f"a tensor of shape {list(logits.shape)}" if logits is not None else "no tensor"
            problems.append(Problem(
                f"the model returned no loss ({got}); with --loss auto the forward must return one",
                "--loss", "pass --loss cross_entropy|mse|bce to compute it from the returned logits"
                + ("" if labels_info else f", and provide a '{cfg.labels_key}' array")))
    else:
        if logits is None:
            problems.append(Problem("the model returned no logits for --loss to use", "--loss",
                                    "return logits (a tensor [batch, ...]) or drop --loss and return a loss"))
        if labels_info is None:
            problems.append(Problem(f"--loss {cfg.loss} needs a '{cfg.labels_key}' array; the data has "
                                    f"{', '.join(data.arrays)}", "--labels_key", "name the targets array"))
        elif logits is not None and cfg.loss == "cross_entropy":
            if labels_info.dtype.startswith("float"):
                problems.append(Problem(f"'{cfg.labels_key}' is {labels_info.dtype}; cross-entropy needs class ids",
                                        "--data", "store integer class ids, or use --loss mse/bce for float targets"))
            else:
                classes = logits.shape[-1]
                st = data.stats(cfg.labels_key)
                if st["min"] < 0 or st["max"] >= classes:
                    problems.append(Problem(
                        f"'{cfg.labels_key}' holds values from {st['min']:g} to {st['max']:g}, but the model's logits "
                        f"have {classes} classes (valid ids 0..{classes - 1})", "--data",
                        "fix the labels, or build the model with as many outputs as classes"))
    for name, info in data.arrays.items():
        if info.dtype.startswith(("float", "bfloat")):
            st = data.stats(name)
            if st["nan"] or st["inf"]:
                problems.append(Problem(
                    f"'{name}' has {st['nan']} NaN and {st['inf']} inf values (first at row {st['first_bad_row']}); "
                    "one of them makes every loss NaN", "--data", "clean or drop these rows before training"))
    return problems


def first_forward(model: nn.Module, caller: Caller, data: TensorData, model_args: dict[str, Any]) -> tuple[Any, Any, str | None]:
    """One forward on the first two examples with hooks on every layer: ``(trace, batch, mismatch message or None)``.

    Training runs it before step 1 and ``surefit inspect`` shows it, so both name the same layer and cause."""
    batch = data.batch(list(range(min(2, len(data)))))
    was = model.training
    model.eval()
    try:
        tr = trace(model, batch, lambda: caller.forward(model, batch))
    finally:
        model.train(was)
    return tr, batch, diagnose(tr, batch, model_args)


def inspect_inputs(data: str, model: str | None = None, model_args: str | None = None,
                   max_memory_gb: float | None = None) -> str:
    """Every array of a tensor dataset; with a model factory, each input's first layer and any mismatch."""
    tensors = load_tensor_data(data, max_memory_gb)
    lines = [tensors.describe()]
    if model:
        try:
            args = load_json(model_args or "{}")
        except ValueError as e:
            raise ConfigError(Problem(f"not a JSON object ({e}): {short(model_args or '')!r}", "--model_args",
                                      "e.g. '{\"vocab\": 271}'")) from None
        if not isinstance(args, dict):
            raise ConfigError(Problem(f"not a JSON object: {short(model_args or '')!r}", "--model_args",
                                      "e.g. '{\"vocab\": 271}'"))
        net = load_factory(model, flag="--model")(**args)
        mode, passed, problems = forward_protocol(net, list(tensors.arrays))
        lines += [f"problem: {p.what}" for p in problems]
        caller = Caller(CustomConfig(data=data, model=model, loss="cross_entropy"), mode, passed)
        tr, _, message = first_forward(net, caller, tensors, args)
        lines.append(f"model {type(net).__name__}: forward({'batch' if mode == 'single' else ', '.join(passed)})")
        lines += first_layers(tr, list(tensors.arrays), passed)
        if message:
            lines.append(message)
    return "\n".join(lines)


class _AsCalled(nn.Module):
    """The model as surefit calls it (``forward(batch)`` protocol), for the doctor, which calls ``forward(**batch)``."""

    def __init__(self, model: nn.Module, caller: Caller):
        super().__init__()
        self.model = model
        self._caller = caller

    def forward(self, **batch: torch.Tensor) -> Any:
        return self._caller.forward(self.model, batch)


class _Rows:
    """Single examples of a TensorData (the doctor reads items one by one, like a torch Dataset)."""

    def __init__(self, data: TensorData, keys: list[str]):
        self.data, self.keys = data, keys

    def __len__(self) -> int:
        return min(len(self.data), 64)  # the doctor samples a few items; 64 bounds any scan it makes

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.data.batch([i]).items() if k in self.keys}


# ------------------------------------------------------------------------------------------------------------ prepare


def _build(cfg: CustomConfig, factory: Any) -> tuple[nn.Module, dict[str, Any]]:
    model_args = json.loads(cfg.model_args or "{}")
    try:
        model = factory(**model_args)
    except Exception as e:  # noqa: BLE001 - the user's factory; show its error in our terms
        raise ConfigError(Problem(f"{cfg.model}(**{model_args}) failed: {type(e).__name__}: {e}", "--model_args",
                                  "check the factory's arguments")) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(Problem(f"{cfg.model} returned {type(model).__name__}, not a torch.nn.Module", "--model"))
    return model, model_args


def prepare(cfg: CustomConfig, say: Say = print, problems: list[Problem] | None = None) -> Prepared:
    """Everything the loop needs: the shards, the factory's model, how to call it, a real forward under hooks
    before step 1 (a shape mismatch stops here, naming the input and the layer), the split and the loss."""
    early = list(problems or [])
    assert cfg.model is not None and cfg.data is not None  # required: the config's checks say so first
    factory = None
    try:
        factory = load_factory(cfg.model, flag="--model")
    except ConfigError as e:
        early += e.problems
    data = val = None
    try:
        data = load_tensor_data(cfg.data, cfg.max_memory_gb)
    except SurefitError as e:
        early += e.problems
    if cfg.val_data:
        try:
            val = load_tensor_data(cfg.val_data, cfg.max_memory_gb)
        except SurefitError as e:
            early += e.problems
    raise_input_problems(early)
    assert data is not None and factory is not None
    say(data.describe())
    if val is not None:
        missing = sorted(set(data.arrays) - set(val.arrays))
        if missing:
            raise DataError(Problem(f"validation data lacks {', '.join(missing)} (training has {', '.join(data.arrays)})",
                                    "--val_data", "give both the same arrays"))

    model, model_args = _build(cfg, factory)
    keys = list(data.arrays)
    mode, passed, problems = forward_protocol(model, keys)
    caller = Caller(cfg, mode, passed)
    table = []
    for k in keys:
        if k in caller.passed:
            table.append({"column": k, "status": "kept", "why": f"an argument of {type(model).__name__}.forward"
                          if mode == "kwargs" else "passed in the batch dict to forward(batch)"})
        elif k == cfg.labels_key and cfg.loss != "auto":
            table.append({"column": k, "status": "kept", "why": f"targets for --loss {cfg.loss} (not passed to forward)"})
        else:
            table.append({"column": k, "status": "dropped", "why": f"not an argument of {type(model).__name__}.forward"})
    say("columns:\n" + render_columns(table))
    if not problems:
        problems = check_before_step_1(model, caller, data, cfg, model_args, say)
    if problems:
        raise DataError(problems)
    # The doctor sees what reaches the forward: with --loss the labels go to surefit's loss instead, unless the
    # forward takes them too.
    # A forward(x) probed with the labels alone looks like forward(batch) (one positional argument): only a forward
    # that names the labels key (or takes **kwargs) takes them.
    label_mode, label_passed, _ = forward_protocol(model, [cfg.labels_key])
    takes_labels = label_mode == "kwargs" and cfg.labels_key in label_passed
    rows = _Rows(data, [k for k in keys if k in caller.passed or (k == cfg.labels_key and takes_labels)])
    checked = _AsCalled(model, caller) if mode == "single" else model

    # Split by index when there is no validation folder: tensor rows are independent examples.
    n = len(data)
    if val is None:
        train_idx, val_idx = split_indices(n, cfg.val_fraction, cfg.seed)
        val_source = data
        say(f"split {n} examples -> {len(train_idx)} train / {len(val_idx)} validation (val_fraction "
            f"{cfg.val_fraction}, seed {cfg.seed})")
    else:
        train_idx, val_idx, val_source = list(range(n)), list(range(len(val))), val

    accelerator = make_accelerator(cfg.precision, report_to=cfg.trackers, project_dir=cfg.output_dir)
    say(f"model {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters); precision "
        f"{precision_name(accelerator)}; device {accelerator.device}")

    def collate(idx: Any) -> dict[str, torch.Tensor]:
        return model_batch(data, list(idx), caller)

    def evaluate(m: Any, epoch: int | float, batch_size: int) -> Evaluation:
        avg = mean_loss(m, caller, val_source, val_idx, batch_size, accelerator)
        if epoch == 0 or not float(epoch).is_integer():  # before training, and --eval_every's mid-epoch ones
            say(f"epoch {epoch}/{cfg.epochs}  avg_valid_loss={avg:.4f}")
        return Evaluation({"eval_loss": avg, "avg_valid_loss": avg})

    def on_epoch(record: dict[str, Any]) -> None:
        record["avg_train_loss"] = record["train_loss"]
        valid = f"avg_valid_loss={record['avg_valid_loss']:.4f}  " if "avg_valid_loss" in record else ""
        say(f"epoch {record['epoch']}/{cfg.epochs}  avg_train_loss={record['avg_train_loss']:.4f}  "
            f"{valid}time_per_epoch={record['time_per_epoch']:.1f}s")

    epoch_batches = None
    if data.loads_whole_shards:
        # Random batches would reload a cached .npz/.pt shard batch after batch; this order reads each once an epoch.
        position = {example: i for i, example in enumerate(train_idx)}

        def epoch_batches(epoch: int) -> list[list[int]]:
            order = [position[e] for e in data.epoch_order([cfg.seed, epoch], among=train_idx)]
            return [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]

    ones = [1] * len(train_idx)
    work = TrainingWork(features=train_idx, lengths=ones, counts=ones, collate=collate, loss_fn=caller,
                        evaluate=evaluate, on_epoch=on_epoch, epoch_batches=epoch_batches,
                        where=lambda i: f"{cfg.data} row {train_idx[i]}")
    summary = DataSummary(train_rows=len(train_idx), val_rows=len(val_idx),
                          facts=ArrayFacts({k: list(v.shape) for k, v in data.arrays.items()}))
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, work=work, save=lambda m, folder: save(m, cfg, model_args, folder),
        check=lambda: check(checked, None, rows, None, None, args={"batch_size": cfg.micro_batch_size}, task="custom"),
        found=Found(summary, files={COLUMNS: table}), saved="the model (safetensors) and its factory spec")


def run(cfg: CustomConfig, say: Say = print) -> RunResult:
    """Train the factory's model on tensor shards; report avg_train_loss, avg_valid_loss, time_per_epoch."""
    return train(cfg, prepare, say)


def save(model: nn.Module, cfg: CustomConfig, model_args: dict[str, Any], folder: Path) -> None:
    """``final/``: ``model.safetensors`` and ``surefit_model.json`` (the factory and its arguments)."""
    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, str(folder / "model.safetensors"))
    (folder / "surefit_model.json").write_text(json.dumps({"factory": cfg.model, "model_args": model_args}, indent=2),
                                               encoding="utf-8")


# ------------------------------------------------------------------------------------------------------------ a finished run


def load(run: Run, keys: list[str]) -> Loaded:
    """The factory's model with the trained weights, and how surefit calls it (``keys``: the data's arrays)."""
    from safetensors.torch import load_model

    run.require(*final_files(run.config_as(CustomConfig)))
    spec_path = run.final / "surefit_model.json"
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    try:
        factory = load_factory(spec["factory"], flag="--model")
    except ConfigError as e:
        raise run.config_problem(e, ("model",)) from e
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
    return Loaded(model, None, accelerator, {"caller": Caller(run.config_as(CustomConfig), mode, passed)})


def evaluate(run: Run, data: str | None, batch_size: int, max_new_tokens: int | None, fields: dict[str, str],
             say=print) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
    """``surefit eval`` of a custom run: the mean loss on its validation split (re-derived) or on ``data``."""
    cfg = run.config_as(CustomConfig)
    if data is None:
        run.check_training_data()
        if cfg.val_data:
            source = load_tensor_data(cfg.val_data, cfg.max_memory_gb)
            indices = list(range(len(source)))
        elif cfg.data is None:
            raise ConfigError(Problem(f"{run.config_path} names no training data, so there is no validation split to "
                                      "re-derive", run.where("data"), "pass --data FOLDER to evaluate on other data"))
        else:
            source = load_tensor_data(cfg.data, cfg.max_memory_gb)
            indices = split_indices(len(source), cfg.val_fraction, cfg.seed)[1]
        described = run.validation_described()
    else:
        source = load_tensor_data(data, cfg.max_memory_gb)
        indices = list(range(len(source)))
        described = str(data)
    loaded = load(run, list(source.arrays))
    caller = loaded.extra["caller"]
    if cfg.loss != "auto" and cfg.labels_key not in source.arrays:
        raise DataError(Problem(f"{described} has no '{cfg.labels_key}' array (it has {', '.join(source.arrays)}); "
                                f"the run's loss {cfg.loss} needs it", "--data", f"add a '{cfg.labels_key}' array"))
    avg = mean_loss(loaded.model, caller, source, indices, batch_size, loaded.accelerator)
    return described, len(indices), {"eval_loss": avg, "avg_valid_loss": avg}, []


def predict(run: Run, inputs: str | list[str] | None, file: str | None, batch_size: int,
            max_new_tokens: int | None, fields: dict[str, str], say: Say = print) -> Iterator[list[dict[str, Any]]]:
    """Custom models have no text inputs to predict on."""
    raise ConfigError(Problem(f"{run.folder} is a custom-task run: predict works on text runs (sft, classify)",
                              "--run", "load final/model.safetensors with your factory (see final/surefit_model.json), "
                              "or use `surefit eval --run ... --data FOLDER` for its loss"))


def export(run: Run, folder: Path, merge: bool, say: Say = print) -> str:
    """A copy of ``final/`` (custom models have no adapter to merge)."""
    import shutil

    run.require(*final_files(run.config_as(CustomConfig)))
    shutil.copytree(run.final, folder)
    if merge:
        say(f"--merge: {run.folder} was trained in full (no LoRA adapter); copied the model as it is")
    return "model"
