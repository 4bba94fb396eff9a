"""Start-up: the phase record and line, and the content-keyed cache of the doctor's and the planner's work.

Whether the work ran is counted (the doctor's ``check`` and the planner's saved-tensor measurement are wrapped), never
timed.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

import surefit.startup as startup
import surefit.startup.cache as startup_cache
import surefit.tasks.sft.train_sft as sft
import surefit.training.plan as plan_module
from conftest import qa_rows, tiny_llama
from surefit.cli import main


@pytest.fixture()
def counted(monkeypatch):
    """Counts of the doctor's runs and of the planner's measurements."""
    calls = {"doctor": 0, "planner": 0}
    check, measure = sft.run_checks, plan_module.measure_saved_bytes

    def counting_check(*a, **k):
        calls["doctor"] += 1
        return check(*a, **k)

    def counting_measure(*a, **k):
        calls["planner"] += 1
        return measure(*a, **k)

    monkeypatch.setattr(sft, "run_checks", counting_check)
    monkeypatch.setattr(plan_module, "measure_saved_bytes", counting_measure)
    return calls


def _data(path: Path, n: int = 16, extra: str = "") -> Path:
    rows = qa_rows(n)
    rows[0]["target"] += extra
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _train(model: Path, data: Path, out: Path, *extra: str) -> dict:
    argv = ["train", "--task", "sft", "--model", str(model), "--data", str(data), "--epochs", "1", "--lora_r", "4",
            "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", "0.25", "--output_dir", str(out), *extra]
    assert main(argv) == 0
    return json.loads((out / "startup.json").read_text(encoding="utf-8"))


def test_an_unchanged_setup_reuses_the_doctor_and_the_planner_in_a_new_run_folder(tmp_path, tiny_lm_dir, counted):
    data = _data(tmp_path / "train.jsonl")
    first = _train(tiny_lm_dir, data, tmp_path / "a")
    assert counted == {"doctor": 1, "planner": 1} and first["cache"] == {"doctor": "computed", "planner": "computed", "evaluation": "computed"}
    # Another folder, and settings that only steer the loop: the same content, so nothing is recomputed.
    second = _train(tiny_lm_dir, data, tmp_path / "b", "--lr", "1e-3", "--epochs", "2")
    assert counted == {"doctor": 1, "planner": 1} and second["cache"] == {"doctor": "reused", "planner": "reused", "evaluation": "reused"}
    # The doctor's seconds by check (startup.json, --profile shows the longest): each check that ran, by the codes it
    # reports; none for a reused report, which ran nothing.
    from surefit.doctor.core import DRY_RUN, REGISTRY

    assert set(first["doctor_checks"]) <= {codes for codes, _ in REGISTRY} | {DRY_RUN}
    assert len(first["doctor_checks"]) >= 20 and first["doctor_checks"][DRY_RUN] > 0
    assert 0 < sum(first["doctor_checks"].values()) <= first["phases"]["doctor"] + 1e-3
    assert second["doctor_checks"] == {}
    # oneDNN's kernel cache as the command left it (surefit's cap unless the environment set one)
    import os

    assert first["onednn_primitive_cache"].split()[0] == os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in first["onednn_primitive_cache"]
    # The reused report is the report: doctor.json and memory_plan.json are the same in both folders.
    for name in ("doctor.json", "memory_plan.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


@pytest.mark.parametrize("change", ["data", "setting", "model", "template"])
def test_a_changed_input_reruns_the_doctor_and_the_planner(tmp_path, tiny_lm_dir, counted, change):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_lm_dir, model)
    data = _data(tmp_path / "train.jsonl")
    _train(model, data, tmp_path / "a")
    extra: tuple[str, ...] = ()
    if change == "data":
        _data(data, extra=" mat")  # one target one word longer
    elif change == "setting":
        extra = ("--lora_dropout", "0.1")
    elif change == "model":
        weights = next(model.glob("*.safetensors"))  # other weights of the same size and modification time
        st = weights.stat()
        raw = bytearray(weights.read_bytes())
        raw[-4:] = bytes(b ^ 1 for b in raw[-4:])
        weights.write_bytes(bytes(raw))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        extra = ("--template", "Q: {input}\nA: ")
    second = _train(model, data, tmp_path / "b", *extra)
    assert counted == {"doctor": 2, "planner": 2}
    # The changed row is a training row: the validation examples are the same, so epoch 0 is reused
    # (tests/test_baseline_eval.py changes a validation row).
    evaluation = "reused" if change == "data" else "computed"
    assert second["cache"] == {"doctor": "computed", "planner": "computed", "evaluation": evaluation}


def test_no_cache_reruns_everything_and_stores_nothing(tmp_path, tiny_lm_dir, counted):
    data = _data(tmp_path / "train.jsonl")
    for out in ("a", "b"):
        record = _train(tiny_lm_dir, data, tmp_path / out, "--no_cache")
        assert record["cache"] == {"doctor": "off", "planner": "off", "evaluation": "off"}
    assert counted == {"doctor": 2, "planner": 2}
    assert not startup_cache.cache_dir().exists() or not any(startup_cache.cache_dir().rglob("*.json"))


@pytest.mark.parametrize("damage", ["not json", "edited value", "not a report"])
def test_a_damaged_cache_entry_is_ignored_with_a_note(tmp_path, tiny_lm_dir, counted, capsys, damage):
    data = _data(tmp_path / "train.jsonl")
    _train(tiny_lm_dir, data, tmp_path / "a")
    [entry] = (startup_cache.cache_dir() / "doctor").glob("*.json")
    stored = json.loads(entry.read_text(encoding="utf-8"))
    if damage == "not json":
        entry.write_bytes(b"\x80\x04garbage")  # e.g. a pickle someone put there: read as text, never unpickled
    elif damage == "edited value":
        # a report edited by hand (an error that would stop the run): its checksum no longer matches
        stored["value"]["findings"] = [{"code": "eos-missing", "severity": "error", "message": "x", "fix": "",
                                        "where": ""}]
        entry.write_text(json.dumps(stored), encoding="utf-8")
    else:
        stored["value"] = {"findings": [{"code": "x"}]}  # checksum recomputed, but not a report
        stored["check"] = startup_cache.digest(stored["value"])
        entry.write_text(json.dumps(stored), encoding="utf-8")
    capsys.readouterr()
    record = _train(tiny_lm_dir, data, tmp_path / "b")
    out = capsys.readouterr()
    assert "note: ignored a" in out.out and "Traceback" not in out.out + out.err
    assert counted["doctor"] == 2 and record["cache"]["doctor"] == "computed"
    # The entry was rewritten whole: the third run reuses it.
    assert _train(tiny_lm_dir, data, tmp_path / "c")["cache"]["doctor"] == "reused"


def test_the_startup_line_is_printed_over_the_threshold_and_the_record_always_written(tmp_path, tiny_lm_dir,
                                                                                     monkeypatch, capsys):
    data = _data(tmp_path / "train.jsonl")
    monkeypatch.setattr(startup, "REPORT_AFTER_S", 1e9)
    quiet = _train(tiny_lm_dir, data, tmp_path / "a")
    assert "start-up " not in capsys.readouterr().out
    monkeypatch.setattr(startup, "REPORT_AFTER_S", 0.0)
    record = _train(tiny_lm_dir, data, tmp_path / "b")
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("start-up ")]
    assert len(lines) == 1 and "doctor" in lines[0] and "(start-up cache: doctor reused, planner reused, evaluation reused)" in lines[0]
    for rec in (quiet, record):
        assert {"model load", "doctor", "memory plan", "encoding data", "imports and settings", "other"} <= set(
            rec["phases"])
        assert rec["seconds"] == pytest.approx(sum(rec["phases"].values()), abs=0.01)
        assert rec["step1_at"] > rec["started"]


def test_a_run_inside_a_longer_program_times_its_start_up_from_the_call(tmp_path, tiny_lm_dir):
    """``surefit.train`` in a notebook or script: the start-up is the call's, not the hours the program ran before
    (the test process itself started long before this test)."""
    import time

    import surefit

    before = time.time()
    surefit.train(task="sft", model=str(tiny_lm_dir), data=str(_data(tmp_path / "train.jsonl")), epochs=1, lora_r=4,
                  batch_size=4, max_seq_length=96, val_fraction=0.25, output_dir=str(tmp_path / "run"))
    record = json.loads((tmp_path / "run" / "startup.json").read_text(encoding="utf-8"))
    assert before <= record["started"] < record["step1_at"] <= time.time()
    assert record["seconds"] == pytest.approx(record["step1_at"] - record["started"], abs=1e-3)


def test_the_outermost_command_sets_the_start_and_a_clock_outside_any_starts_when_made():
    import time

    with startup.command(100.0), startup.command(200.0):  # cli.run's process start, then main's and train's calls
        assert startup.Clock().started == 100.0
    before = time.time()
    assert before <= startup.Clock().started <= time.time()


def test_the_line_names_the_phases_longest_first():
    clock = startup.Clock(started=100.0)
    clock.made, clock.total, clock.step1_at = 101.0, 14.2, 114.2
    clock.phases = {"doctor": 4.0, "model load": 6.1, "tokenizer": 0.01}
    clock.cache = {"doctor": "reused"}
    assert clock.line() == ("start-up 14.2 s: model load 6.1 s, doctor 4.0 s, other 3.1 s, imports and settings "
                            "1.0 s (start-up cache: doctor reused)")


def test_the_doctor_runs_one_forward_on_a_model_whose_dry_run_passes():
    from conftest import tiny_llama as make
    from surefit.doctor import check

    model = make()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    features = [{"input_ids": [1, 2, 3, 4, 0], "labels": [-100, -100, 3, 4, 0]} for _ in range(4)]
    from surefit.data.collate import PadCollator

    check(model, None, features, None, PadCollator(pad_token_id=0), args={"batch_size": 2}, task="sft")
    assert len(calls) == 1


def test_planner_measurements_are_reused_from_the_memo_and_the_choice_made_afresh():
    model = tiny_llama()
    work = plan_module.Workload(lengths=[40 - i % 7 for i in range(16)], supervised=[3 + i % 4 for i in range(16)],
                                forward=lambda idx: model(torch.tensor([[1] * 40])).logits.sum())
    tried = []

    def probe(micro, ckpt):
        tried.append((micro, ckpt))
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return 1000

    args = dict(request=plan_module.PlanRequest(batch_size=8, processes=1, requested_micro=8,
                                                gradient_checkpointing=False, precision="fp32", eval_batch_size=8,
                                                budget=(10.0, "test"), lora=False, device=torch.device("cpu")),
                probe=probe)
    memo: dict = {}
    first = plan_module.make_plan(copy.deepcopy(model), work, memo=memo, **args)
    stored = json.loads(json.dumps(memo))  # what the cache holds: JSON
    assert stored["probes"] == {"8,0": None, "4,0": None, "3,0": None, "2,0": 1000}
    assert stored["saved_activations"][1] == 40
    n = len(tried)
    work.forward = None  # a second measurement would fail: the memo must answer
    again = plan_module.make_plan(copy.deepcopy(model), work, memo=stored, **args)
    assert len(tried) == n  # no rung probed again
    assert (again.micro_batch_size, again.grad_accum, again.measured) == (first.micro_batch_size, first.grad_accum,
                                                                          first.measured)
    assert again.changes == first.changes



def test_on_a_cpu_the_doctors_dry_run_is_the_planners_measurement(tmp_path, tiny_lm_dir, counted):
    """A cold CPU run runs one forward before step 1 for the doctor and the planner together; the saved activations
    the plan reports are those of the doctor's longest row (right padding under causal attention reaches the model
    without a mask, so the first row would compute what it computes alone), counted exactly as a separate
    measurement of that row in training mode counts them, and the RNG is left as it was."""
    from surefit.cli import parse_train_config
    from surefit.doctor.core import Setup
    from surefit.training.work import PlanInputs

    data = _data(tmp_path / "train.jsonl")
    first = _train(tiny_lm_dir, data, tmp_path / "a")
    assert counted == {"doctor": 1, "planner": 1} and first["cache"] == {"doctor": "computed", "planner": "computed", "evaluation": "computed"}
    how = json.loads((tmp_path / "a" / "memory_plan.json").read_text())["measured"]["how"]
    assert "of the doctor's dry run (1 x " in how and "its longest row" in how and "counted, not estimated" in how

    cfg = parse_train_config(["--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--lora_r", "4",
                              "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", "0.25",
                              "--output_dir", str(tmp_path / "c"), "--no_cache"])
    p = sft.prepare(cfg, say=lambda s: None)
    assert isinstance(p.work.plan, PlanInputs) and not p.work.plan.measured
    rng = torch.get_rng_state()
    assert not p.check().has_errors
    assert torch.equal(torch.get_rng_state(), rng)
    got = p.work.plan.measured["saved_activations"]
    batch, _ = Setup(p.model, None, p.work.features, None, p.work.collate, {"batch_size": 4},
                     sample=sft.DRY_RUN_ROWS).batch()
    assert len(batch["input_ids"]) == sft.DRY_RUN_ROWS == 2  # the first row and the longest
    multiple = cfg.pad_to_multiple_of or 1  # training pads each batch's length up to it (off by default)
    assert got[1] == batch["input_ids"].shape[1] == -(-max(p.work.lengths) // multiple) * multiple
    store = p.work.activation_store if plan_module.packs_saved(
        True, plan_module.precision_name(p.accelerator), p.work.activation_store, p.accelerator.device) else None
    p.model.train()
    longest = {k: v[1:] for k, v in batch.items()}
    with p.accelerator.autocast():
        alone = plan_module.run_with_restored_rng(lambda: plan_module.measure_saved_bytes(
            p.model, lambda: p.work.plan.loss_fn(p.model, longest)[0], store(torch.bfloat16) if store else None))
    assert got[0] == alone > 0


def test_the_dry_run_runs_every_row_where_the_model_gets_a_padding_mask(tmp_path, tiny_lm_dir):
    """Right padding under causal attention: the model gets no mask, so the dry run's forward is the longest row's
    alone. Left padding needs the mask: every row runs, padded, and the measurement counts them all. The logits the
    doctor reads have the whole batch's shape either way."""
    from transformers import AutoModelForCausalLM

    from surefit.training.loss import causal_lm_loss_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    shapes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    for name, pads in (("right", slice(8, 12)), ("left", slice(0, 4))):
        m = mask.clone()
        m[0, pads] = 0
        labels = ids.masked_fill(m == 0, -100)
        into = {}
        dry = plan_module.MeasuringDryRun(causal_lm_loss_sum, True, "fp32", torch.device("cpu"), None, into)
        shapes.clear()
        out = dry(model, {"input_ids": ids, "attention_mask": m, "labels": labels})
        assert out.logits.shape == (2, 12, model.config.vocab_size), name
        ran = 1 if name == "right" else 2
        assert shapes[0] == (ran, 12) and into["saved_activations"][1] == ran * 12, name
        assert into["saved_activations"][0] > 0


def test_the_dry_runs_logits_have_the_heads_shape_and_a_label_the_head_cannot_score_still_fails_it(
        tmp_path, tiny_lm_dir, monkeypatch):
    """The measuring dry run hands the doctor logits of the head's shape and dtype without computing the head over
    every position; the run's loss in its forward still scores every supervised label, so one out of the
    vocabulary fails the dry run."""
    from surefit.cli import parse_train_config

    seen = {}
    real = sft.run_checks

    def keep(setup):
        seen["setup"] = setup
        return real(setup)

    monkeypatch.setattr(sft, "run_checks", keep)
    data = _data(tmp_path / "train.jsonl")
    cfg = parse_train_config(["--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--lora_r", "4",
                              "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", "0.25",
                              "--output_dir", str(tmp_path / "c"), "--no_cache"])
    p = sft.prepare(cfg, say=lambda s: None)
    assert isinstance(p.work.plan.measured, dict)
    assert not p.check().has_errors
    setup = seen["setup"]
    assert isinstance(setup.call, plan_module.MeasuringDryRun)
    from surefit.training.speedups import fused_head

    assert setup.call.no_backward is fused_head.gradients_unused  # handed in by the task (tests/test_layers.py)
    batch, _ = setup.batch()
    got = setup.logits()
    with torch.no_grad(), p.accelerator.autocast():
        full = p.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert got.shape == full.shape and got.dtype == full.dtype
    assert got.shape[1] == batch["input_ids"].shape[1] > 1

    bad = dict(batch)
    bad["labels"] = batch["labels"].clone()
    row, col = (bad["labels"] != -100).nonzero()[-1].tolist()
    bad["labels"][row, col] = full.shape[-1]  # one past the vocabulary
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        setup.call(p.model, bad)
