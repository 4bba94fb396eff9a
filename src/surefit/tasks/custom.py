"""Any ``nn.Module`` on named tensors: setup -> shape check -> fit -> evaluate -> save, top to bottom.

The model comes from a factory (``--model file.py:build --model_args '{"vocab": 271}'``). Its forward is called as
``forward(**batch)`` with the keys it accepts (or ``forward(batch)`` when it takes one argument) and returns a loss
(a tensor, a dict or object with ``loss``, or a tuple whose first item is the loss) or logits, with ``--loss``
naming the loss to apply to ``labels``. Before step 1, one forward pass on a real batch runs under hooks: a shape
mismatch stops the run naming the input, the layer, what it expects, what arrived and the likely cause.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from surefit.config import CustomConfig
from surefit.data.tensors import TensorData, load_tensor_data
from surefit.doctor import check
from surefit.doctor.gate import gate, run_doctor
from surefit.doctor.shapes import diagnose, trace
from surefit.errors import ConfigError, DataError, Problem, SurefitError, raise_input_problems
from surefit.heads import load_factory
from surefit.tasks.classify import _render_table
from surefit.training.distributed import is_main_process, on_main
from surefit.training.loop import Checkpointing, LoopSettings, fit, make_accelerator
from surefit.training.plan import plan_run, precision_name
from surefit.training.run import (
    check_output_dir,
    open_metrics_log,
    quiet_libraries,
    resume_command,
    resume_point,
    save_final,
    start_output_dir,
    write_run_report,
)

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


def loss_sum_from_logits(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Sum over examples of each example's mean loss (the loop divides by the example count of the step)."""
    logits = logits.float()
    if kind == "cross_entropy":
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), reduction="none")
        return per.reshape(labels.shape[0], -1).mean(1).sum()
    if logits.shape != labels.shape and logits.shape[-1] == 1:
        logits = logits.squeeze(-1)
    fn = F.mse_loss if kind == "mse" else F.binary_cross_entropy_with_logits
    per = fn(logits, labels.float().reshape(logits.shape), reduction="none")
    return per.reshape(labels.shape[0], -1).mean(1).sum()


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
        return loss_sum_from_logits(logits, batch[self.cfg.labels_key], self.cfg.loss), n  # type: ignore[arg-type]


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train_idx, val_idx)``: a seeded split by index (tensor rows are independent examples)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction))
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
    batch = data.batch(list(range(min(2, len(data)))))
    model.eval()
    tr = trace(model, batch, lambda: caller.forward(model, batch))
    model.train()
    message = diagnose(tr, batch, model_args)
    if message:
        return [Problem(message, "--data", "fix the data or the model as the likely cause says; "
                        "`surefit inspect --data DIR --model ...` shows every input's first layer")]
    rows = [f"  {u.input} {list(u.shape)} {u.dtype} -> {u.module} ({u.layer})"
            + ("" if u.agrees is None else "  ok" if u.agrees else f"  MISMATCH: expects {u.expects}")
            for u in tr.uses.values()]
    if rows:
        say("first layer of each input (one forward on 2 real examples):\n" + "\n".join(rows))
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


# ------------------------------------------------------------------------------------------------------------ run


def run(cfg: CustomConfig, say=print, doctor_only: bool = False) -> dict[str, Any]:
    """Train the factory's model on tensor shards; report avg_train_loss, avg_valid_loss, time_per_epoch."""
    from accelerate.utils import set_seed
    from safetensors.torch import save_model

    say = on_main(say)  # several processes: the main one reports and writes files, the others wait where needed
    quiet_libraries()
    set_seed(cfg.seed)
    early: list[Problem] = []
    factory = None
    try:
        factory = load_factory(cfg.model, flag="--model")
    except ConfigError as e:
        early += e.problems
    previous = check_output_dir(cfg, early)
    resume_from = resume_point(cfg, early, say)
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

    model_args = json.loads(cfg.model_args or "{}")
    try:
        model = factory(**model_args)
    except Exception as e:  # noqa: BLE001 - the user's factory; show its error in our terms
        raise ConfigError(Problem(f"{cfg.model}(**{model_args}) failed: {type(e).__name__}: {e}", "--model_args",
                                  "check the factory's arguments")) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(Problem(f"{cfg.model} returned {type(model).__name__}, not a torch.nn.Module", "--model"))
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
    say("columns:\n" + _render_table(table))
    if not problems:
        problems = check_before_step_1(model, caller, data, cfg, model_args, say)
    if problems:
        raise DataError(problems)
    # The doctor sees what reaches the forward: with --loss the labels go to surefit's loss instead, unless the
    # forward takes them too.
    takes_labels = cfg.labels_key in forward_protocol(model, [cfg.labels_key])[1]
    rows = _Rows(data, [k for k in keys if k in caller.passed or (k == cfg.labels_key and takes_labels)])
    checked = _AsCalled(model, caller) if mode == "single" else model
    doctor_report = run_doctor(lambda: check(checked, None, rows, None, None, args={"batch_size": cfg.micro_batch_size},
                                             task="custom"))
    gate(doctor_report, cfg, say, None, doctor_only)

    # Split by index when there is no validation folder: tensor rows are independent examples.
    n = len(data)
    if val is None:
        train_idx, val_idx = split_indices(n, cfg.val_fraction, cfg.seed)
        val_source = data
        say(f"split {n} examples -> {len(train_idx)} train / {len(val_idx)} validation (val_fraction "
            f"{cfg.val_fraction}, seed {cfg.seed})")
    else:
        train_idx, val_idx, val_source = list(range(n)), list(range(len(val))), val
    out = start_output_dir(cfg, previous, say)
    if is_main_process():
        (out / "columns.json").write_text(json.dumps(table, indent=2), encoding="utf-8")
        if doctor_report is not None:  # gate() could not save it: the run folder did not exist yet
            (out / "doctor.json").write_text(doctor_report.to_json(), encoding="utf-8")

    accelerator = make_accelerator(cfg.precision, report_to=cfg.trackers, project_dir=out)
    say(f"model {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters); precision "
        f"{precision_name(accelerator)}; device {accelerator.device}")

    def to_batch(indices: list[int], source: TensorData) -> dict[str, torch.Tensor]:
        return model_batch(source, indices, caller)

    def evaluate(m: Any, epoch: int) -> dict[str, Any]:
        avg = mean_loss(m, caller, val_source, val_idx, plan.eval_batch_size, accelerator)
        if epoch == 0:
            say(f"epoch 0/{cfg.epochs}  avg_valid_loss={avg:.4f}")
        return {"eval_loss": avg, "avg_valid_loss": avg}

    def on_epoch(record: dict[str, Any]) -> None:
        record["avg_train_loss"] = record["train_loss"]
        say(f"epoch {record['epoch']}/{cfg.epochs}  avg_train_loss={record['avg_train_loss']:.4f}  "
            f"avg_valid_loss={record['avg_valid_loss']:.4f}  time_per_epoch={record['time_per_epoch']:.1f}s")

    def export(m: Any, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_model(accelerator.unwrap_model(m), str(folder / "model.safetensors"))
        (folder / "surefit_model.json").write_text(json.dumps({"factory": cfg.model, "model_args": model_args},
                                                              indent=2), encoding="utf-8")

    log = open_metrics_log(cfg, out, accelerator)
    plan = plan_run(cfg, model, accelerator, features=train_idx, lengths=[1] * len(train_idx),
                    counts=[1] * len(train_idx), collate=lambda idx: to_batch(list(idx), data), loss_fn=caller,
                    say=say, out=out)
    settings = LoopSettings(epochs=cfg.epochs, batch_size=cfg.batch_size, micro_batch_size=plan.micro_batch_size,
                            lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_ratio=cfg.warmup_ratio,
                            max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, log_every=cfg.log_every)
    checkpointing = Checkpointing(folder=out / "checkpoints", save_every=cfg.save_every, keep=cfg.keep_checkpoints,
                                  export=export, resume_from=resume_from, resume_command=resume_command(cfg))
    try:
        history = fit(model, train_idx, [1] * len(train_idx), [1] * len(train_idx), loss_fn=caller,
                      collate=lambda idx: to_batch(list(idx), data), settings=settings, accelerator=accelerator,
                      evaluate=evaluate, checkpointing=checkpointing, log=log, say=say, on_epoch=on_epoch)
    finally:
        log.close()
    final = save_final(out, lambda d: export(model, d))
    say(f"saved the model (safetensors) and its factory spec to {final}")
    write_run_report(out, accelerator, say)
    return {"output_dir": out, "final_dir": final, "history": history, "data_report": {"train_rows": len(train_idx),
            "val_rows": len(val_idx), "arrays": {k: list(v.shape) for k, v in data.arrays.items()}}}
