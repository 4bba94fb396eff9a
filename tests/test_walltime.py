"""Where a whole run's time goes (``--profile``), and what the end and start of a run do once: the final model is
serialised once, the doctor runs before step 1, and a run imports only what it uses.

Nothing here is timed: the profile's numbers are checked against each other (they add up to the run's wall time),
and work is counted by wrapping the functions that do it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import surefit.tasks.runner as runner
import surefit.tasks.sft.train_sft as sft
from conftest import qa_rows
from surefit.cli import main
from surefit.startup.walltime import ORDER, Profile, WallTimes

SRC = Path(__file__).resolve().parents[1] / "src"


def _data(path: Path, n: int = 16) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(n)), encoding="utf-8")
    return path


def _argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--task", "sft", "--model", str(model), "--data", str(data), "--epochs", "2", "--lora_r", "4",
            "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", "0.25", "--output_dir", str(out), *extra]


def test_profile_prints_and_writes_where_the_run_went_and_the_parts_add_up(tmp_path, tiny_lm_dir, capsys):
    out = tmp_path / "run"
    before = time.time()
    assert main(_argv(tiny_lm_dir, _data(tmp_path / "train.jsonl"), out, "--profile")) == 0
    took = time.time() - before
    printed = capsys.readouterr().out
    record = json.loads((out / "profile.json").read_text(encoding="utf-8"))
    profile = Profile.from_json(record)
    parts = profile.parts
    # Every part of a run with evaluations, in the run's order, and nothing else: the evaluations compute their loss
    # in the prompts' forward (the default), so loss and generation are one part.
    assert list(parts) == [p for p in ORDER if p not in ("evaluation loss", "generation")]
    assert all(v >= 0 for v in parts.values())
    # Two evaluations after step 1 (epochs 1 and 2), and two epoch checkpoints, took time.
    assert parts["evaluation loss and generation"] > 0 and parts["checkpoints"] > 0
    assert parts["training steps"] > 0 and parts["final save"] > 0
    # The parts add up to the run's seconds (each is rounded to 1 ms; "other" is the rest).
    assert sum(parts.values()) == pytest.approx(profile.seconds, abs=0.01 + 0.001 * profile.seconds)
    # The start-up is startup.json's, phase by phase, and its phases add up to it.
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    assert parts["start-up"] == pytest.approx(startup["seconds"], abs=1e-3)
    assert profile.startup == pytest.approx(startup["phases"], abs=1e-3)
    assert sum(profile.startup.values()) == pytest.approx(parts["start-up"], abs=0.02)
    # epoch 0's evaluation is a start-up phase (before step 1), not also an evaluation part
    assert profile.startup["evaluation before training"] > 0
    # the doctor's phase by check, longest first, within the phase
    assert list(profile.doctor.values()) == sorted(profile.doctor.values(), reverse=True)
    assert 0 < sum(profile.doctor.values()) <= profile.startup["doctor"] + 1e-3
    assert profile.doctor == startup["doctor_checks"]
    # main() called inside a program (this test process, running for minutes) counts from the call.
    assert 0 < profile.seconds <= took
    # The printout is the record's table; the page shows it too.
    assert f"where the run's {profile.seconds:.1f} s went" in printed
    for name in parts:
        assert f"  {name} " in printed
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "Where the time went" in page and "from profile.json (--profile)" in page and "generation" in page


def test_profile_times_the_loss_and_the_answers_apart_when_they_run_apart(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    assert main(_argv(tiny_lm_dir, _data(tmp_path / "train.jsonl"), out, "--profile",
                      "--eval_loss_in_prefill", "false")) == 0
    parts = Profile.from_json(json.loads((out / "profile.json").read_text(encoding="utf-8"))).parts
    assert list(parts) == [p for p in ORDER if p != "evaluation loss and generation"]
    assert parts["evaluation loss"] > 0 and parts["generation"] > 0


def test_without_profile_no_profile_file_and_the_page_shows_the_start_up(tmp_path, tiny_lm_dir, capsys):
    out = tmp_path / "run"
    assert main(_argv(tiny_lm_dir, _data(tmp_path / "train.jsonl"), out, "--epochs", "1")) == 0
    assert "went (--profile" not in capsys.readouterr().out
    assert not (out / "profile.json").exists()
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "from startup.json" in page and "model load" in page
    # `surefit report` rebuilds the page from the folder alone, and reads profile.json when a run wrote one.
    record = Profile(10.0, {"start-up": 4.0, "training steps": 6.0, "other": 0.0}, {"model load": 4.0})
    (out / "profile.json").write_text(json.dumps(record.to_json()), encoding="utf-8")
    assert main(["report", "--run", str(out)]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "from profile.json (--profile): 10.0 s" in page and "60.0%" in page


def test_the_table_shows_the_doctors_three_longest_checks_under_its_phase():
    profile = Profile(20.0, {"start-up": 12.0, "training steps": 8.0}, {"doctor": 9.0, "model load": 3.0},
                      {"forward-failed": 6.2, "memory-over-budget": 1.5, "eos-missing": 0.9, "labels-preshifted": 0.2,
                       "double-bos": 0.01})
    lines = profile.table().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split() == ["doctor", "9.0", "s"])
    assert [line.split() for line in lines[at + 1:at + 4]] == [
        ["forward-failed", "6.2", "s"], ["memory-over-budget", "1.5", "s"], ["eos-missing", "0.9", "s"]]
    assert lines[at + 1].startswith("      forward-failed") and lines[at + 4].split()[0] == "model"
    assert "labels-preshifted" not in profile.table()
    # read back from profile.json as written
    assert Profile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_nested_parts_count_in_the_inner_one_and_nothing_before_recording():
    times = WallTimes()
    with times.part("evaluation (other)"):
        pass
    assert times.parts == {}  # before step 1: the start-up clock has that time
    times.recording = True
    with times.part("evaluation (other)"):
        with times.part("generation"):
            torch.ones(200, 200) @ torch.ones(200, 200)
    assert set(times.parts) == {"evaluation (other)", "generation"} and times.parts["generation"] > 0
    built = Profile.build(100.0, 10.0, {"model load": 10.0}, 50.0, times)
    # the loop's 50 s less what was recorded inside it are the training steps; the rest of the 100 s is "other"
    # (each part to the record's 1 ms)
    assert built.parts["training steps"] == pytest.approx(50.0 - sum(times.parts.values()), abs=1e-3)
    assert sum(built.parts.values()) == pytest.approx(100.0)


def test_final_is_serialised_once_a_copy_of_the_last_checkpoints_export(tmp_path, tiny_lm_dir, monkeypatch):
    saves: list[Path] = []
    real = sft.save

    def counting(model, tokenizer, folder):
        saves.append(Path(folder))
        return real(model, tokenizer, folder)

    monkeypatch.setattr(sft, "save", counting)
    out = tmp_path / "run"
    assert main(_argv(tiny_lm_dir, _data(tmp_path / "train.jsonl"), out)) == 0
    # one export per epoch checkpoint, none for final/
    assert [p.parent.name for p in saves] == ["epoch-1.tmp", "epoch-2.tmp"]
    final, last = out / "final", out / "checkpoints" / "epoch-2"
    manifest = json.loads((final / "manifest.json").read_text())
    ck = json.loads((last / "manifest.json").read_text())
    assert manifest["files"] == {k.removeprefix("model/"): v for k, v in ck["files"].items() if k.startswith("model/")}
    for name in manifest["files"]:
        assert (final / name).read_bytes() == (last / "model" / name).read_bytes()
    # plain peft loads it, with the trained (not the initial) adapter weights
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), final)
    trained = load_file(final / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in trained.items())
    assert model.peft_config["default"].r == 4


def test_final_is_exported_afresh_when_the_weights_changed_after_the_last_export(tmp_path):
    model = torch.nn.Linear(3, 3)
    exported = runner.ExportedModel()
    folder = tmp_path / "checkpoints" / "epoch-1.tmp" / "model"
    exported.note(model, folder)
    assert exported.folder == tmp_path / "checkpoints" / "epoch-1" / "model"
    written: list[Path] = []
    with torch.no_grad():
        model.weight.add_(1.0)  # an in-place change after the export (an optimizer step)
    exported.final(model, written.append)(tmp_path / "final.tmp")
    assert written == [tmp_path / "final.tmp"]
    # an export outside a checkpoint (not NAME.tmp/model) is never copied from
    exported.note(model, tmp_path / "elsewhere" / "model")
    exported.final(model, written.append)(tmp_path / "final2.tmp")
    assert written[-1] == tmp_path / "final2.tmp"


def test_the_doctor_runs_before_step_1(tmp_path, tiny_lm_dir, monkeypatch):
    order: list[str] = []
    check, end = sft.run_checks, runner.end_startup

    def doctor(*a, **k):
        order.append("doctor")
        return check(*a, **k)

    def step1(*a, **k):
        order.append("step 1")
        return end(*a, **k)

    monkeypatch.setattr(sft, "run_checks", doctor)
    monkeypatch.setattr(runner, "end_startup", step1)
    assert main(_argv(tiny_lm_dir, _data(tmp_path / "train.jsonl"), tmp_path / "run", "--epochs", "1",
                      "--no_cache")) == 0
    assert order == ["doctor", "step 1"]


def test_a_lora_run_imports_neither_bitsandbytes_nor_trl_nor_datasets(tmp_path, tiny_lm_dir):
    """``import surefit.cli`` loads no ML library; a whole LoRA run loads no bitsandbytes (peft would import it,
    about a second), and nothing of TRL or datasets."""
    data = _data(tmp_path / "train.jsonl")
    argv = _argv(tiny_lm_dir, data, tmp_path / "run", "--epochs", "1")
    script = textwrap.dedent(f"""
        import json, sys
        import surefit.cli
        after_cli = sorted(m for m in ("torch", "transformers", "peft", "matplotlib", "trl", "datasets")
                           if m in sys.modules)
        code = surefit.cli.main({argv!r})
        loaded = lambda m: sys.modules.get(m) is not None
        print(json.dumps({{"code": code, "after_cli": after_cli,
                          "after_run": sorted(m for m in ("bitsandbytes", "trl", "datasets", "peft") if loaded(m))}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "SUREFIT_STARTUP_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"code": 0, "after_cli": [], "after_run": ["peft"]}


def _surefit_process(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """``surefit ARGV`` as the command runs it (``cli.run``), with an exit handler of its own registered first."""
    script = textwrap.dedent(f"""
        import atexit, sys, psutil
        print("process started", psutil.Process().create_time())
        atexit.register(lambda: print("exit handler ran", flush=True))
        sys.argv = ["surefit", *{argv!r}]
        from surefit.cli import run
        run()
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "SUREFIT_STARTUP_CACHE": str(tmp_path / "cache")})


def test_the_command_ends_with_its_exit_code_output_and_exit_handlers(tmp_path, tiny_lm_dir):
    """``cli.run`` ends the process without the interpreter's teardown: the exit handlers still run, everything
    printed arrives (stdout is a pipe here, so it is buffered), and the exit code is the command's."""
    out = tmp_path / "run"
    done = _surefit_process(tmp_path, _argv(tiny_lm_dir, _data(tmp_path / "train.jsonl"), out, "--epochs", "1"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "exit handler ran" and lines[-2] == f"wrote {out / 'curves.svg'} and {out / 'report.html'}"
    assert (out / "final" / "adapter_model.safetensors").is_file()
    # The command's start-up counts from its process start: the interpreter's and the imports' seconds are the user's.
    [started] = [float(x.split()[-1]) for x in lines if x.startswith("process started ")]
    assert json.loads((out / "startup.json").read_text(encoding="utf-8"))["started"] == pytest.approx(started, abs=1e-3)
    refused = _surefit_process(tmp_path, ["train", "--data", str(tmp_path / "missing.jsonl"), "--output_dir",
                                          str(tmp_path / "r2")])
    assert refused.returncode not in (0, None) and "missing.jsonl" in refused.stderr
    assert "Traceback" not in refused.stderr and refused.stdout.splitlines()[-1] == "exit handler ran"


def test_a_last_checkpoint_that_no_longer_verifies_is_not_copied_and_the_run_says_so(tmp_path):
    from surefit.run_folder import integrity

    model = torch.nn.Linear(3, 3)
    checkpoint = tmp_path / "checkpoints" / "epoch-1"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "adapter_model.safetensors").write_bytes(b"exported weights")
    integrity.write_manifest(checkpoint)
    exported = runner.ExportedModel()
    exported.note(model, tmp_path / "checkpoints" / "epoch-1.tmp" / "model")
    (checkpoint / "model" / "adapter_model.safetensors").write_bytes(b"changed weights!")  # same size, other bytes
    said: list[str] = []
    written: list[Path] = []
    exported.final(model, written.append, said.append)(tmp_path / "final.tmp")
    assert written == [tmp_path / "final.tmp"] and not (tmp_path / "final.tmp").exists()
    assert len(said) == 1 and said[0].startswith("note: final/ written afresh") and "adapter_model" in said[0]
    # unchanged, it is the copy that is written, and nothing is said
    (checkpoint / "model" / "adapter_model.safetensors").write_bytes(b"exported weights")
    exported.final(model, written.append, said.append)(tmp_path / "final2.tmp")
    assert len(written) == 1 and len(said) == 1
    assert (tmp_path / "final2.tmp" / "adapter_model.safetensors").read_bytes() == b"exported weights"
