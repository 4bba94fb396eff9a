"""Several processes (DDP, gloo on the CPU): the same global batch gives the same run as one process.

The end-to-end test trains a tiny custom-task model three times: in one process (the reference), as two processes
under plain torchrun stopped by SIGINT mid-epoch, and resumed as two processes with ``surefit train
--num_processes 2``. The per-step losses (log_every 1) and the final weights must match the reference. The data is
chosen so that every step's 5 examples do not divide over 2 processes (3 + 2, so the processes run different numbers
of micro-batches) and the last step of each epoch has a single example (the other process runs a zero-weight pass).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file

from surefit.cli import main

REPO = Path(__file__).resolve().parents[2]

MODEL = '''
"""A tiny classifier with a buffer (DDP broadcasts buffers in a step's first forward, a collective that must stay
in step across processes running different numbers of micro-batches); with MP_TEST_SIGNAL_AT=K, process 1 sends
SIGINT to its launcher (torchrun) at its K-th forward, as Ctrl-C in a terminal would."""

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):
    def __init__(self, vocab, hidden, classes=4):
        super().__init__()
        self.projection = nn.Linear(vocab, hidden)
        self.classifier = nn.Linear(hidden, classes)
        self.register_buffer("scale", torch.full((hidden,), 0.5))
        self.calls = 0

    def forward(self, inputs_embeds, labels=None):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == int(os.environ.get("MP_TEST_SIGNAL_AT", "0")):
            os.kill(os.getppid(), signal.SIGINT)
        logits = self.classifier(self.scale * torch.tanh(self.projection(inputs_embeds)).mean(dim=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def build(vocab=7, hidden=16):
    return Tiny(vocab, hidden)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    rng = np.random.default_rng(0)
    for split, n in (("train", 21), ("val", 8)):  # 21 = 4 steps of 5 + a last step of 1, each epoch
        folder = tmp / split
        folder.mkdir()
        x = rng.standard_normal((n, 5, 7)).astype(np.float32)
        y = (x[:, :, 0].sum(1) > 0).astype(np.int64) + 2 * (x[:, :, 1].sum(1) > 0).astype(np.int64)
        np.save(folder / "inputs_embeds.npy", x)
        np.save(folder / "labels.npy", y)
    (tmp / "tiny.py").write_text(textwrap.dedent(MODEL), encoding="utf-8")
    args = ["--task", "custom", "--model", f"{tmp / 'tiny.py'}:build", "--model_args", '{"vocab": 7, "hidden": 16}',
            "--data", str(tmp / "train"), "--val_data", str(tmp / "val"), "--epochs", "2", "--batch_size", "5",
            "--grad_accum", "5", "--lr", "1e-2", "--log_every", "1"]
    return tmp, args


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_stopped_and_resumed_train_the_same_run_as_one(setup, capfd):
    tmp, args = setup
    reference = tmp / "one"
    assert main(["train", *args, "--output_dir", str(reference)]) == 0

    # Two processes under plain torchrun; process 1 sends SIGINT to torchrun in the first epoch.
    out = tmp / "two"
    env = {**os.environ, "MP_TEST_SIGNAL_AT": "8", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "surefit", "train", *args, "--output_dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    assert "stopped by SIGINT after epoch 1, step " in proc.stderr, proc.stderr[-3000:]
    assert f"resume with: surefit train --config {out / 'config.yaml'} --resume --num_processes 2" in proc.stderr
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    state = json.loads((out / "checkpoints" / saved[0] / "trainer_state.json").read_text())
    assert state["plan"]["processes"] == 2 and state["plan"]["micro_batch_size"] == 1
    assert not (out / "final").exists()
    # Only the main process printed the run's report.
    assert proc.stdout.count("epoch 0/2  avg_valid_loss=") == 1, proc.stdout
    assert "batch 5 is not micro-batch x accumulation x processes exactly; it stays 5" in proc.stdout

    # Resumed as two processes that surefit starts itself; every process loads the checkpoint.
    capfd.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out), "--num_processes", "2"]) == 0
    said = capfd.readouterr().out
    assert said.count(f"resumed from {out / 'checkpoints' / saved[0]}") == 1, said
    assert said.count("epoch 2/2  avg_train_loss=") == 1

    # The same loss at every step, the same evaluations, the same final weights.
    ref, two = _records(reference), _records(out)
    assert [(r["type"], r.get("step")) for r in two] == [(r["type"], r.get("step")) for r in ref]
    steps = [(a["loss"], b["loss"]) for a, b in zip(ref, two, strict=True) if a["type"] == "step"]
    assert len(steps) == 10
    worst_loss = max(abs(a - b) for a, b in steps)
    assert worst_loss <= 1e-4, steps
    for a, b in zip(ref, two, strict=True):
        if a["type"] == "epoch":
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4
            assert a.get("examples_seen") == b.get("examples_seen")
    got, want = load_file(out / "final/model.safetensors"), load_file(reference / "final/model.safetensors")
    assert got.keys() == want.keys()
    worst_weight = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert worst_weight <= 1e-5
    print(f"1 vs 2 processes: max step-loss difference {worst_loss:.2e}, max weight difference {worst_weight:.2e}")


# ------------------------------------------------------------------------------------------------------------ launcher


def test_num_processes_flag_is_taken_out_of_the_arguments():
    from surefit.cli.launch import command
    from surefit.config.launch_flags import LaunchFlags, split_launch_flags
    from surefit.errors import ConfigError

    def split(argv):
        flags, rest = split_launch_flags(argv, {})
        return (None if flags is None else flags.num_processes), rest

    assert split(["--data", "x", "--num_processes", "2", "--epochs", "1"]) == (2, ["--data", "x", "--epochs", "1"])
    assert split(["--num-processes=4"]) == (4, [])
    assert split(["--data", "x"]) == (None, ["--data", "x"])
    for bad in (["--num_processes", "0"], ["--num_processes", "two"], ["--num_processes"]):
        with pytest.raises(ConfigError, match="--num_processes"):
            split(bad)
    cmd = command(LaunchFlags(num_processes=2), ["train", "--data", "x"])
    assert cmd[1:] == ["-m", "surefit.cli.launch", "--standalone", "--nproc_per_node", "2", "-m", "surefit", "train",
                       "--data", "x"]


def test_launcher_passes_a_signal_on_to_its_child_and_returns_the_child_exit_code(tmp_path, monkeypatch):
    import surefit.cli.launch as launch
    from surefit.config.launch_flags import LaunchFlags

    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
        pathlib.Path({str(ready)!r}).write_text("ready")
        time.sleep(60)
        sys.exit(3)
    """)
    monkeypatch.setattr(launch, "command", lambda n, argv: [sys.executable, "-c", child])

    def interrupt():
        deadline = time.time() + 60
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaching `surefit train --num_processes N`

    thread = threading.Thread(target=interrupt)
    thread.start()
    started = time.time()
    two = LaunchFlags(num_processes=2)
    assert launch.launch(two, ["train"]) == 130
    thread.join()
    assert time.time() - started < 30
    monkeypatch.setattr(launch, "command", lambda n, argv: [sys.executable, "-c", "import sys; sys.exit(2)"])
    assert launch.launch(two, ["train"]) == 2


def test_launcher_exits_with_the_training_processes_exit_code(monkeypatch):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from surefit.cli.launch import main as launch_main

    def failing(code_by_rank):
        def run(args):
            raise ChildFailedError("surefit", {rank: ProcessFailure(local_rank=rank, pid=1, exitcode=code,
                                                                     error_file="/nonexistent") for rank, code in
                                               code_by_rank.items()})
        return run

    monkeypatch.setattr(torchrun, "run", failing({1: -9, 0: 2}))
    assert launch_main(["--nproc_per_node", "2", "-m", "surefit"]) == 2  # the main process's code
    monkeypatch.setattr(torchrun, "run", failing({1: -9}))
    assert launch_main(["--nproc_per_node", "2", "-m", "surefit"]) == 128 + 9
    monkeypatch.setattr(torchrun, "run", lambda args: None)
    assert launch_main(["--nproc_per_node", "2", "-m", "surefit"]) == 0


# ------------------------------------------------------------------------------------------------------------ plan


def test_the_global_batch_is_kept_and_an_uneven_split_is_described():
    from surefit.training.distributed import describe_processes, process_micro_batches

    assert process_micro_batches(8, 8, 1) == (8, 1)
    assert process_micro_batches(8, 2, 1) == (2, 4)
    assert process_micro_batches(8, 8, 2) == (4, 1)  # each process's share is 4
    assert process_micro_batches(8, 2, 2) == (2, 2)
    assert process_micro_batches(5, 1, 2) == (1, 3)  # shares 3 + 2
    assert "batch 8 = micro-batch 2 x accumulation 2 x 2 processes" in describe_processes(8, 2, 2)
    text = describe_processes(5, 1, 2)
    assert "it stays 5" in text and "3 to one process, 2 to the other" in text and "1 + 1 + 1" in text
    assert "4 to each process" in describe_processes(8, 3, 2) and "3 + 1" in describe_processes(8, 3, 2)


def test_fsdp_and_deepspeed_are_refused_with_the_reason():
    from accelerate.utils import DistributedType

    from surefit.errors import ConfigError
    from surefit.training.distributed import refuse_sharded as _refuse_sharded

    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(ConfigError, match="each process holds only a shard"):
            _refuse_sharded(type("Acc", (), {"distributed_type": kind})())
    for kind in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        _refuse_sharded(type("Acc", (), {"distributed_type": kind})())


# ------------------------------------------------------------------------------------------------------------ configs

REQUIRED = ("compute_environment", "distributed_type", "num_machines", "machine_rank", "num_processes",
            "mixed_precision", "use_cpu")
CONFIGS = {"multi-gpu.yaml": "MULTI_GPU", "multi-node.yaml": "MULTI_GPU", "fsdp.yaml": "FSDP",
           "deepspeed-zero2.yaml": "DEEPSPEED", "deepspeed-zero3.yaml": "DEEPSPEED"}


def test_every_example_accelerate_config_parses_with_the_required_keys():
    from accelerate.commands.config.config_args import ClusterConfig

    folder = REPO / "examples" / "accelerate"
    found = sorted(p.name for p in folder.glob("*.yaml"))
    assert found == sorted(CONFIGS), found  # a new config must be added here, so none goes unchecked
    checked = 0
    for name, kind in CONFIGS.items():
        data = yaml.safe_load((folder / name).read_text(encoding="utf-8"))
        assert isinstance(data, dict), name
        missing = [k for k in REQUIRED if k not in data]
        assert not missing, (name, missing)
        assert data["distributed_type"] == kind and data["num_processes"] >= 2, name
        assert data["num_processes"] % data["num_machines"] == 0, name
        if kind == "FSDP":
            assert data["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        if kind == "DEEPSPEED":
            assert data["deepspeed_config"]["zero_stage"] == int(name[len("deepspeed-zero")])
        if data["num_machines"] > 1:
            assert data["main_process_ip"] and data["main_process_port"], name
        assert str(ClusterConfig.from_yaml_file(str(folder / name)).distributed_type).endswith(kind)
        checked += 1
    assert checked == 5


def test_the_launcher_names_a_process_killed_by_a_signal_and_keeps_the_exit_code(monkeypatch, tmp_path, capsys):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from surefit.cli.launch import main as launch_main

    def failing(code_by_rank):
        def run(args):
            raise ChildFailedError("surefit", {rank: ProcessFailure(local_rank=rank, pid=1, exitcode=code,
                                                                     error_file="/nonexistent") for rank, code in
                                               code_by_rank.items()})
        return run

    argv = ["--nproc_per_node", "2", "-m", "surefit", "train", "--output_dir", str(tmp_path / "run")]
    monkeypatch.setattr(torchrun, "run", failing({1: -9, 0: -15}))
    assert launch_main(argv) == 128 + 15
    err = capsys.readouterr().err
    assert "training process 1 of 2 was killed by SIGKILL" in err
    assert "no checkpoint had been saved yet, so there is nothing to resume" in err
    monkeypatch.setattr(torchrun, "run", failing({0: -15, 1: -15}))  # a stop the user asked for: no lost process
    assert launch_main(argv) == 128 + 15 and "was killed" not in capsys.readouterr().err
