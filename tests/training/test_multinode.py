"""Several machines: ``surefit train --nnodes 2 --node_rank 0/1 --master_addr --master_port`` on torchrun's rendezvous.

One machine plays two "nodes" of one process each over loopback (two separate ``surefit train`` commands). The tiny
custom model below writes down, per process, the example ids (an ``ids`` input column) of every training micro-batch
it runs: the forwards the loop runs inside a training step (``surefit.training.dropout.active()``), not the probes
before step 1 nor evaluation. From that record: 2 processes (one node, or two nodes) read disjoint examples and
together cover every epoch exactly once, and 2 nodes train the same weights as 2 processes on one node. Node 1 is
given an output folder of its own that must stay absent: only the global main process (node 0) writes a run folder.

A lost node: node 1's launcher and its process are killed mid-run (SIGKILL, as a machine going away); node 0 stops
with a message naming node 1 and the exact command that resumes, and that command (run on both "nodes") finishes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from surefit.config.launch_flags import LaunchFlags, expand_hosts, first_host, split_launch_flags
from surefit.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NNODES",
              "SLURM_STEP_NUM_NODES"):
    ENV.pop(_name, None)

MODEL = '''
"""A tiny classifier that writes down the example ids of each training micro-batch it runs, per process (SEEN_DIR);
with KILL_AT=K, process 1 writes its pid and its launcher's at its K-th training forward and waits to be killed."""

import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from surefit.training.dropout import active


class Tiny(nn.Module):
    def __init__(self, vocab, hidden, classes=2):
        super().__init__()
        self.projection = nn.Linear(vocab, hidden)
        self.classifier = nn.Linear(hidden, classes)
        self.calls = 0

    def forward(self, inputs_embeds, ids, labels=None):
        if self.training and active():  # a micro-batch of a training step
            self.calls += 1
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(os.environ["SEEN_DIR"], f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(ids.tolist()) + "\\n")
            if rank == "1" and self.calls == int(os.environ.get("KILL_AT", "0")):
                with open(os.path.join(os.environ["SEEN_DIR"], "victim.json"), "w") as f:
                    json.dump([os.getpid(), os.getppid()], f)
                time.sleep(600)
        logits = self.classifier(torch.tanh(self.projection(inputs_embeds)).mean(dim=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def build(vocab=7, hidden=16):
    return Tiny(vocab, hidden)
'''

N_TRAIN = 24  # 6 steps of 4 per epoch: each step's 4 examples are dealt 2 + 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    rng = np.random.default_rng(0)
    for split, n, first_id in (("train", N_TRAIN, 0), ("val", 4, 1000)):
        folder = tmp / split
        folder.mkdir()
        x = rng.standard_normal((n, 5, 7)).astype(np.float32)
        np.save(folder / "inputs_embeds.npy", x)
        np.save(folder / "labels.npy", (x[:, :, 0].sum(1) > 0).astype(np.int64))
        np.save(folder / "ids.npy", np.arange(first_id, first_id + n, dtype=np.int64))
    (tmp / "tiny.py").write_text(textwrap.dedent(MODEL), encoding="utf-8")
    args = ["--task", "custom", "--model", f"{tmp / 'tiny.py'}:build", "--model_args", '{"vocab": 7, "hidden": 16}',
            "--data", str(tmp / "train"), "--val_data", str(tmp / "val"), "--epochs", "2", "--batch_size", "4",
            "--grad_accum", "2", "--lr", "1e-2", "--log_every", "1"]
    return tmp, args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _surefit(args: list[str], seen: Path, **env: str) -> subprocess.Popen:
    seen.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "surefit", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**ENV, "SEEN_DIR": str(seen), **env})


def _nodes(args: list[str], out: Path, seen: Path, port: int, out1: Path | None = None, **env: str):
    """Node 0 and node 1 of one run, each one process, over loopback."""
    node = ["--nnodes", "2", "--num_processes", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    return (_surefit([*args, "--output_dir", str(out), *node, "--node_rank", "0"], seen, **env),
            _surefit([*args, "--output_dir", str(out1 or out), *node, "--node_rank", "1"], seen, **env))


def _seen(folder: Path) -> dict[int, list[int]]:
    """{rank: the example ids of its training micro-batches, in order}."""
    return {int(p.stem[4:]): [i for line in p.read_text().splitlines() for i in json.loads(line)]
            for p in sorted(folder.glob("rank*.jsonl"))}


def _assert_each_epoch_dealt_once(seen: dict[int, list[int]]) -> None:
    assert sorted(seen) == [0, 1], seen
    per_epoch = N_TRAIN // 2  # each rank's share of an epoch: 2 of every step's 4
    for rank, ids in seen.items():
        assert len(ids) == 2 * per_epoch, (rank, ids)
    for epoch in range(2):
        shares = [set(seen[r][epoch * per_epoch:(epoch + 1) * per_epoch]) for r in (0, 1)]
        assert all(len(s) == per_epoch for s in shares), shares  # no example twice within a process's epoch
        assert not shares[0] & shares[1], shares  # disjoint across processes
        assert shares[0] | shares[1] == set(range(N_TRAIN))  # together: the whole epoch


def test_two_nodes_train_the_same_run_as_two_processes_and_read_disjoint_examples(setup, tmp_path):
    tmp, args = setup
    one = _surefit([*args, "--output_dir", str(tmp_path / "one-node"), "--num_processes", "2"], tmp_path / "seen-1")
    said = one.communicate(timeout=600)[0]
    assert one.returncode == 0, said[-3000:]
    port = _free_port()
    node1_folder = tmp_path / "node1-run"
    node0, node1 = _nodes(args, tmp_path / "two-nodes", tmp_path / "seen-2", port, out1=node1_folder)
    said0, said1 = node0.communicate(timeout=600)[0], node1.communicate(timeout=600)[0]
    assert node0.returncode == 0 and node1.returncode == 0, (said0[-3000:], said1[-3000:])

    one_node, two_nodes = _seen(tmp_path / "seen-1"), _seen(tmp_path / "seen-2")
    _assert_each_epoch_dealt_once(one_node)
    _assert_each_epoch_dealt_once(two_nodes)
    assert two_nodes == one_node  # the same deal, step by step: it depends on the global step, not on the nodes

    # Node 0 holds rank 0: it printed the run and wrote the run folder; node 1 wrote nothing, not even its folder.
    assert said0.count("epoch 2/2  avg_train_loss=") == 1 and "epoch 2/2" not in said1
    assert not node1_folder.exists(), sorted(p.name for p in node1_folder.rglob("*"))
    got = load_file(tmp_path / "two-nodes" / "final" / "model.safetensors")
    want = load_file(tmp_path / "one-node" / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert worst <= 1e-6, worst
    steps = [json.loads(line) for line in (tmp_path / "two-nodes" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["type"] == "step"] == list(range(1, 13))
    print(f"2 nodes x 1 process vs 1 node x 2 processes: max weight difference {worst:.1e}")


def test_a_lost_node_stops_the_run_naming_it_and_the_resume_command_finishes_it(setup, tmp_path):
    tmp, args = setup
    out, seen, port = tmp_path / "run", tmp_path / "seen", _free_port()
    run_args = [*args, "--save_every", "2"]
    # Each process runs one micro-batch of 2 a step: its 3rd forward is step 3, after the checkpoint of step 2.
    node0, node1 = _nodes(run_args, out, seen, port, KILL_AT="3")
    victim = seen / "victim.json"
    deadline = time.time() + 600
    while not victim.exists() and time.time() < deadline and node0.poll() is None:
        time.sleep(0.2)
    assert victim.exists(), node0.communicate()[0][-3000:]
    time.sleep(0.5)  # the json is complete
    worker, launcher = json.loads(victim.read_text())
    for pid in (node1.pid, launcher, worker):  # every process of node 1: a machine going away
        os.kill(pid, signal.SIGKILL)
    said = node0.communicate(timeout=300)[0]
    node1.communicate(timeout=60)
    assert node0.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[max(0, said.find("Traceback") - 500):][:4000]
    checkpoint = out / "checkpoints" / "step-0000002"
    assert (f"lost node 1 (host {socket.gethostname()}, process 1): it did not answer the roll call of the "
            "surviving processes after a collective failed") in said, said[-3000:]
    assert f"process 0 of 2 on node 0 (host {socket.gethostname()}, process 0) stopped the run" in said
    assert f"the last good checkpoint is {checkpoint} (verified)" in said
    resume = (f"resume with: surefit train --resume --output_dir {out} --num_processes 1 --nnodes 2 --node_rank 0 "
              f"--master_addr 127.0.0.1 --master_port {port} (on every node, each with its own --node_rank from 0 "
              "to 1)")
    assert resume in said, said[-3000:]
    assert not (out / "final").exists()

    # The command, on both nodes (node 1 with its own --node_rank), finishes the run from the checkpoint.
    command = resume.removeprefix("resume with: surefit train ").split(" (on every node")[0].split()
    again = [_surefit(command[:-6] + ["--node_rank", str(k)] + command[-4:], seen, KILL_AT="0") for k in (0, 1)]
    said0, said1 = again[0].communicate(timeout=600)[0], again[1].communicate(timeout=600)[0]
    assert again[0].returncode == 0 and again[1].returncode == 0, (said0[-3000:], said1[-3000:])
    assert f"resumed from {checkpoint}: epoch 1, step 2" in said0
    assert (out / "final" / "model.safetensors").is_file()


def test_a_node_that_never_joins_is_named_by_node_0_and_node_0_missing_by_node_1(setup, tmp_path):
    tmp, args = setup
    port = _free_port()
    node = ["--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), "--join_timeout", "3"]
    alone = _surefit([*args, "--output_dir", str(tmp_path / "run"), *node, "--node_rank", "0"], tmp_path / "s0")
    said = alone.communicate(timeout=300)[0]
    assert alone.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert ("the nodes of the run did not meet (1 problem):\n  1. --join_timeout: node 1 never joined: node 0 "
            f"waited 3 s at 127.0.0.1:{port} and 1 of 2 nodes arrived (this one included); nothing was trained") in said
    assert not (tmp_path / "run").exists()

    lonely = _surefit([*args, "--output_dir", str(tmp_path / "run"), *node, "--node_rank", "1"], tmp_path / "s1")
    said = lonely.communicate(timeout=300)[0]
    assert lonely.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert f"node 1 could not reach node 0 at 127.0.0.1:{port} within 3 s; nothing was trained" in said
    assert "start node 0 (--node_rank 0) on 127.0.0.1" in said


# ------------------------------------------------------------------------------------------------------------ flags


def test_every_problem_with_the_node_flags_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        split_launch_flags(["--nnodes", "2", "--node_rank", "2", "--master_port", "http", "--num_processes", "0",
                            "--data", "x"], {})
    text = e.value.render()
    assert "(4 problems)" in text
    assert "--num_processes: expected a whole number >= 1, got '0'" in text
    assert "--master_port: expected a whole number from 1 to 65535, got 'http'" in text
    assert "--node_rank: node rank 2 with 2 nodes: the nodes are numbered 0 to 1" in text
    assert "--master_addr: 2 nodes and no address of node 0, where the other nodes meet" in text
    with pytest.raises(ConfigError, match=r"MASTER_PORT \(environment\): expected a whole number from 1 to 65535, "
                                          r"got '99999'(.|\n)*fix: e.g. MASTER_PORT=29500"):
        split_launch_flags(["--nnodes", "2", "--node_rank", "1", "--master_addr", "h"], {"MASTER_PORT": "99999"})
    with pytest.raises(ConfigError, match="--node_rank: node rank 1 without --nnodes"):
        split_launch_flags(["--node_rank", "1"], {})
    with pytest.raises(ConfigError, match="--master_port: no value given"):
        split_launch_flags(["--master_port", "--data", "x"], {})


def test_flags_and_the_environment_give_the_launch():
    assert split_launch_flags(["--data", "x"], {}) == (None, ["--data", "x"])
    flags, rest = split_launch_flags(["--data", "x", "--nproc_per_node=2", "--nnodes", "3", "--node-rank", "2",
                                      "--master_addr", "10.0.0.1"], {"MASTER_PORT": "1234"})
    assert rest == ["--data", "x"]
    assert flags == LaunchFlags(num_processes=2, nnodes=3, node_rank=2, master_addr="10.0.0.1", master_port=1234)
    assert list(flags.ranks_of(2)) == [4, 5] and flags.world_size() == 6
    assert flags.relaunch_flags() == (" --num_processes 2 --nnodes 3 --node_rank 2 --master_addr 10.0.0.1 "
                                      "--master_port 1234")
    # MASTER_ADDR alone (exported for another tool) starts nothing.
    assert split_launch_flags(["--data", "x"], {"MASTER_ADDR": "h", "MASTER_PORT": "1"}) == (None, ["--data", "x"])


def test_an_srun_step_over_several_nodes_gives_the_node_settings():
    slurm = {"SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242",
             "SLURM_GPUS_ON_NODE": "4"}
    flags, _ = split_launch_flags(["--data", "x"], slurm)
    assert flags == LaunchFlags(num_processes=4, nnodes=2, node_rank=1, master_addr="gpu07", master_port=29742,
                                slurm=True)
    assert flags.relaunch_flags() == ""  # srun gives each node its settings again
    flags, _ = split_launch_flags(["--num_processes", "2"], {**slurm, "MASTER_PORT": "29000"})
    assert (flags.num_processes, flags.master_port) == (2, 29000)  # a flag and MASTER_PORT win
    with pytest.raises(ConfigError, match=r"SLURM started 8 tasks on 2 nodes(.|\n)*srun --ntasks-per-node 1"):
        split_launch_flags([], {**slurm, "SLURM_STEP_NUM_TASKS": "8"})
    # One node: SLURM changes nothing (one process unless --num_processes says otherwise).
    assert split_launch_flags([], {**slurm, "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0"}) == (None, [])


def test_under_a_launcher_node_flags_are_refused_and_a_matching_count_is_accepted():
    torchrun = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError) as e:
        split_launch_flags(["--nnodes", "2", "--master_addr", "h"], torchrun)
    assert len(e.value.problems) == 2 and "given inside a launcher that started 4 processes" in e.value.render()
    assert split_launch_flags(["--num_processes", "2", "--data", "x"], torchrun) == (None, ["--data", "x"])
    with pytest.raises(ConfigError, match="--num_processes 3 given inside a launcher"):
        split_launch_flags(["--num_processes", "3"], torchrun)


def test_slurm_host_lists_expand_in_order():
    assert expand_hosts("gpu[07-09,12],cpu1") == ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1"]
    assert expand_hosts("n[1-2]-ib[3-4]") == ["n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"]
    assert first_host("node[001-128]") == "node001" and first_host("login5") == "login5"


def test_several_nodes_run_on_torchruns_static_rendezvous_keeping_the_node_rank():
    from surefit.cli.launch import command

    flags = LaunchFlags(num_processes=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400,
                        join_timeout=60)
    cmd = command(flags, ["train", "--data", "x"])
    assert cmd[1:] == ["-m", "surefit.cli.launch", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                       "--master_port", "29400", "--rdzv_backend", "static", "--rdzv_conf", "timeout=60",
                       "--max_restarts", "0", "--nproc_per_node", "2", "-m", "surefit", "train", "--data", "x"]
    from torch.distributed.run import parse_args

    parsed = parse_args(cmd[3:])  # torchrun itself reads these flags
    assert (parsed.nnodes, parsed.node_rank, parsed.master_addr, parsed.rdzv_backend) == ("2", 1, "10.0.0.1", "static")


def test_the_launcher_of_a_node_names_its_process_killed_by_a_signal(monkeypatch, tmp_path, capsys):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from surefit.cli.launch import command
    from surefit.cli.launch import main as launch_main

    def killed(args):
        raise ChildFailedError("surefit", {1: ProcessFailure(local_rank=0, pid=1, exitcode=-9,
                                                             error_file="/nonexistent")})

    monkeypatch.setattr(torchrun, "run", killed)
    flags = LaunchFlags(num_processes=1, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=29400)
    out = tmp_path / "run"
    assert launch_main(command(flags, ["train", "--output_dir", str(out)])[3:]) == 128 + 9
    err = capsys.readouterr().err
    assert (f"process 1 on node 1 (host {socket.gethostname()}): training process 1 of 2 was killed by SIGKILL"
            in err), err
    assert (f"fix: train again: surefit train ... --output_dir {out} --overwrite --num_processes 1 --nnodes 2 "
            "--node_rank 1 --master_addr 127.0.0.1 --master_port 29400 (on every node, each with its own "
            "--node_rank from 0 to 1)") in err


def test_global_and_node_local_main_processes_are_told_apart(monkeypatch):
    from surefit.training import processes

    # Rank 5 of 8 on node 2 of 4, 2 processes a node: the first of its node, not the run's main process.
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "2", "MASTER_ADDR": "gpu01", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SUREFIT_SLURM", raising=False)
    assert not processes.is_main_process() and processes.is_local_main_process()
    assert (processes.node_count(), processes.node_index(), processes.node_of(7), processes.node_of(1)) == (4, 2, 3, 0)
    flags = processes.launched_as()
    assert flags == LaunchFlags(num_processes=2, nnodes=4, node_rank=2, master_addr="gpu01", master_port=29400)
    assert flags.relaunch_note() == " (on every node, each with its own --node_rank from 0 to 3)"
    monkeypatch.setenv("SUREFIT_SLURM", "1")  # surefit's launcher under srun
    assert processes.launched_as().slurm and processes.launched_as().relaunch_flags() == ""
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not processes.is_local_main_process()


def test_srun_over_two_nodes_starts_each_nodes_processes(setup, tmp_path):
    """`srun surefit train ...` with one task per node, as SLURM sets the environment, on two loopback "nodes"."""
    tmp, args = setup
    port = _free_port()
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": str(port)}
    out = tmp_path / "run"
    runs = [_surefit([*args, "--epochs", "1", "--output_dir", str(out)], tmp_path / "seen",
                     **slurm, SLURM_PROCID=str(k), SLURM_NODEID=str(k)) for k in (0, 1)]
    said = [r.communicate(timeout=600)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [s[-3000:] for s in said]
    assert said[0].count("epoch 1/1  avg_train_loss=") == 1 and "epoch 1/1" not in said[1]
    seen = _seen(tmp_path / "seen")
    assert sorted(seen) == [0, 1] and sorted(seen[0] + seen[1]) == list(range(N_TRAIN))
    assert (out / "final" / "model.safetensors").is_file()
