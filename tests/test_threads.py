"""Thread settings: OpenMP's spinning waits with a thread count that steps aside for other processes, the user's own
settings kept."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from surefit import threads
from surefit.threads import ThreadGovernor, _Sample, available_cores, configure_threads

SRC = Path(__file__).resolve().parents[2] / "src"
OMP = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")


def test_every_core_and_openmps_own_waits_unless_the_user_fixed_the_count(monkeypatch):
    import surefit.threads as threads

    env: dict[str, str] = {}
    sleeping = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    expected = {"OMP_NUM_THREADS": str(available_cores()), **({} if threads.can_govern() else sleeping)}
    assert configure_threads(env) == expected == env
    # No governor possible (no /proc/stat to read): the threads sleep when idle rather than spin unwatched.
    monkeypatch.setattr(threads, "_read_sample", lambda cpus, tick: None)
    assert not threads.can_govern() and configure_threads(unreadable := {}) == {**sleeping, "OMP_NUM_THREADS":
                                                                                  str(available_cores())}
    assert unreadable["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.undo()
    # A count the user fixed cannot step aside for other processes: its threads sleep when idle instead.
    mine = {"OMP_NUM_THREADS": "1"}
    assert configure_threads(mine) == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert mine["OMP_NUM_THREADS"] == "1"
    theirs = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert configure_threads(theirs) == {"KMP_BLOCKTIME": "0"} and theirs["OMP_WAIT_POLICY"] == "ACTIVE"
    policy_only = {"OMP_WAIT_POLICY": "PASSIVE"}  # the user's sleeping waits: no governor, every core
    assert configure_threads(policy_only) == {"KMP_BLOCKTIME": "0", "OMP_NUM_THREADS": str(available_cores())}


def test_the_command_line_sets_them_before_torch_is_imported_and_governs_only_its_own_choice(tmp_path):
    code = ("import sys, os, json; from surefit.cli import main; main(['doctor', '--list']); import torch; "
            "from surefit.threads import governor; "
            "json.dump({'policy': os.environ.get('OMP_WAIT_POLICY'), 'threads': torch.get_num_threads(), "
            "'omp': os.environ.get('OMP_NUM_THREADS'), 'governed': governor() is not None}, open(sys.argv[1], 'w'))")
    cores = available_cores()
    from surefit.threads import can_govern

    governed = can_govern()
    for given, expected in ((None, {"policy": None if governed else "PASSIVE", "threads": cores, "omp": str(cores),
                                    "governed": governed}),
                            ("1", {"policy": "PASSIVE", "threads": 1, "omp": "1", "governed": False})):
        env = {k: v for k, v in os.environ.items() if k not in OMP}
        env["PYTHONPATH"] = str(SRC)
        if given:
            env["OMP_NUM_THREADS"] = given
        out = tmp_path / "out.json"
        subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, capture_output=True)
        assert json.loads(out.read_text()) == expected


class _Readings:
    """The cores' CPU time as /proc/stat would give it, from what each second is said to hold."""

    def __init__(self) -> None:
        self.now = _Sample(time.monotonic() - 1000.0, 0.0, 0.0, 0.0)

    def second(self, own: float, others: float, idle: float, seconds: float = 1.0) -> None:
        s = self.now
        self.now = _Sample(s.wall + seconds, s.own + own * seconds, s.busy + (own + others) * seconds,
                           s.idle + idle * seconds)

    def __call__(self) -> _Sample:
        return self.now


def test_the_count_drops_by_what_others_use_and_rises_only_after_the_cores_stay_free():
    readings, calls, said = _Readings(), [], []
    gov = ThreadGovernor(4, frozenset(range(4)), every_s=0.0, set_threads=calls.append, read=readings)
    gov.say = said.append
    readings.second(own=3.6, others=0.4, idle=0.0)  # a light neighbour: 4.4 cores' demand on 4, nothing changes
    assert gov.check() == 4 and calls == []
    readings.second(own=2.0, others=2.0, idle=0.0)  # two cores' worth taken by others: two threads step aside
    assert gov.check() == 2 and calls == [2]
    assert "using 2.0 of this machine's 4 cores" in said[0] and "2 threads instead of 4" in said[0]
    readings.second(own=1.9, others=1.2, idle=0.9)  # two threads and 1.2 cores of others' fit in four: kept
    assert gov.check() == 2
    readings.second(own=1.1, others=2.9, idle=0.0)  # crowded again: down to one (never below)
    assert gov.check() == 1
    readings.second(own=1.0, others=2.9, idle=0.1)
    assert gov.check() == 1 and calls == [2, 1]
    for _ in range(2):  # free cores for 2 s: not long enough to trust
        readings.second(own=1.0, others=0.0, idle=3.0)
        assert gov.check() == 1
    readings.second(own=1.0, others=0.2, idle=0.5)  # a busy second resets the calm
    assert gov.check() == 1
    for expected in (1, 1, 3):  # three calm seconds in a row, then up by the idle cores
        readings.second(own=1.0, others=0.0, idle=2.0)
        assert gov.check() == expected
    assert calls == [2, 1, 3] and "2.0 of this machine's cores are free again" in said[-1]
    assert [c["threads"] for c in gov.changes] == [2, 1, 3]
    assert gov.seconds_below_full() > 0


def test_the_count_changes_only_on_the_main_thread_and_not_before_a_reading_is_due():
    readings, calls = _Readings(), []
    gov = ThreadGovernor(2, frozenset({0, 1}), every_s=0.0, set_threads=calls.append, read=readings)
    readings.second(own=1.0, others=1.0, idle=0.0)
    worker = threading.Thread(target=gov.check)
    worker.start()
    worker.join()
    assert calls == []  # OpenMP's count is the calling thread's: only the training thread may set it
    slow = ThreadGovernor(2, frozenset({0, 1}), every_s=3600.0, set_threads=calls.append, read=_Readings())
    slow._last = _Sample(time.monotonic(), 0.0, 0.0, 0.0)
    assert slow.check() == 2 and calls == []  # an hour between readings: none due yet
    assert gov.check() == 1 and calls == [1]


def _burner(cpu: int) -> subprocess.Popen:
    """A real process that keeps ``cpu`` busy."""
    return subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


def test_a_real_process_busy_on_the_cores_makes_the_governor_step_aside():
    cpu = min(os.sched_getaffinity(0))
    calls: list[int] = []
    burner = _burner(cpu)
    try:
        time.sleep(0.5)  # the burner is on its core
        gov = ThreadGovernor(2, frozenset({cpu}), every_s=0.0, set_threads=calls.append)
        time.sleep(1.0)  # this process sleeps: the core's busy time is the burner's
        assert gov.check() == 1 and calls == [1]
        assert gov.changes[0]["others"] > 0.5
    finally:
        burner.kill()
        burner.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to run a two-thread training on")
def _tiny_run(model: Path, data: Path, out: Path, *, val_fraction: str) -> list[str]:
    """``surefit`` arguments of a one-epoch LoRA run of the tiny model, small enough for a test's subprocess."""
    return ["train", "--task", "sft", "--model", str(model), "--data", str(data), "--epochs", "1", "--lora_r", "4",
            "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", val_fraction, "--output_dir", str(out)]


def test_a_training_beside_processes_busy_on_its_cores_runs_fewer_threads_and_says_so(tmp_path, tiny_lm_dir):
    from conftest import qa_rows

    cpus = sorted(os.sched_getaffinity(0))[:2]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(16)), encoding="utf-8")
    out = tmp_path / "run"
    argv = _tiny_run(tiny_lm_dir, data, out, val_fraction="0.25")
    script = (f"import os, sys\nos.sched_setaffinity(0, {set(cpus)!r})\nsys.argv = ['surefit', *{argv!r}]\n"
              "from surefit.cli import run\nrun()\n")
    env = {k: v for k, v in os.environ.items() if k not in OMP}
    env.update(PYTHONPATH=str(SRC))
    burners = [_burner(c) for c in cpus]
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "of this machine's 2 cores: surefit now runs 1 thread instead of 2" in done.stdout
    threads = json.loads((out / "startup.json").read_text(encoding="utf-8"))["threads"]
    assert threads["governed"] and threads["threads"] == 2 and threads["changes"][0]["threads"] == 1
    assert "threads: fewer than 2 for" in done.stdout
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_several_processes_share_out_the_count_surefit_chose_and_keep_the_users(monkeypatch):
    import surefit.threads as threads
    from surefit.cli.launch import process_env
    from surefit.config.launch_flags import LaunchFlags

    flags = LaunchFlags(num_processes=2)
    share = str(max(1, available_cores() // 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the user's: every process gets it
    assert process_env(flags)["OMP_NUM_THREADS"] == "7"
    monkeypatch.setitem(threads._CHOSEN, "OMP_NUM_THREADS", "7")  # surefit's own pick for one process: shared out
    assert process_env(flags)["OMP_NUM_THREADS"] == share
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert process_env(flags)["OMP_NUM_THREADS"] == share
    # oneDNN's kernel cache: surefit's choice is each process's own (its startup.json says surefit's); the user's stays
    monkeypatch.setattr(threads, "_CHOSEN", {})
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    threads.cap_kernel_cache()
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in process_env(flags)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert process_env(flags)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_a_cgroup_cpu_limit_below_the_cores_sets_the_threads_and_says_so(tmp_path, tiny_lm_dir):
    """A real cgroup (v1's cpu controller, where this machine lets the test make one) limited to 1 CPU: the command
    runs 1 thread, with sleeping waits (the cores' busy time says nothing of the quota's share), and says why."""
    from conftest import qa_rows

    if available_cores() < 2:
        pytest.skip("one core: a 1-CPU limit changes nothing")
    base = Path("/sys/fs/cgroup/cpu")
    group = base / f"surefit-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_quota_us").write_text(str(int((base / "cpu.cfs_period_us").read_text())))
    except OSError as e:
        if group.is_dir():
            group.rmdir()
        pytest.skip(f"no cgroup v1 cpu controller this test may create a group in: {e}")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(8)), encoding="utf-8")
    out = tmp_path / "run"
    argv = _tiny_run(tiny_lm_dir, data, out, val_fraction="0")
    script = (f"import os, sys\nopen({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
              f"sys.argv = ['surefit', *{argv!r}]\nfrom surefit.cli import run\nrun()\n")
    env = {k: v for k, v in os.environ.items() if k not in OMP}
    env.update(PYTHONPATH=str(SRC))
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    finally:
        group.rmdir()
    assert done.returncode == 0, done.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    assert (f"threads: 1 (this process's cgroup allows 1 CPU of the {cores} cores it may run on, e.g. docker --cpus "
            "or a Kubernetes CPU limit") in done.stdout
    threads = json.loads((out / "startup.json").read_text(encoding="utf-8"))["threads"]
    assert threads == {"threads": 1, "waits": "passive", "governed": False, "cpu_limit": 1.0}
    assert (out / "final" / "adapter_model.safetensors").is_file()


# A fresh process makes bf16 matmuls at 96 token counts (3 shapes each, as a training batch of a new length brings
# them) and prints the bytes glibc's heap holds in use afterwards, with nothing of its own left alive. The primitives
# oneDNN keeps for those shapes are what is left.
_KERNELS_LEFT = r"""
import ctypes, os, sys
import torch
from surefit.startup import command
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI
torch.set_num_threads(1)
with command():
    w = torch.randn(512, 256).bfloat16()
    b = torch.randn(256, 16).bfloat16()
    torch.nn.functional.linear(torch.randn(8, 256).bfloat16(), w)
    before = libc.mallinfo2().uordblks
    for m in range(64, 64 + 96 * 8, 8):
        x = torch.randn(m, 256).bfloat16()
        y = torch.nn.functional.linear(x, w)
        z, u = y @ w, x @ b
        del x, y, z, u
    print(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), (libc.mallinfo2().uordblks - before) / 2**20)
"""


def _kernels_left(env_value: str | None) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in threads.KERNEL_CACHE_VARIABLES}
    if env_value is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env_value
    out = subprocess.run([sys.executable, "-c", _KERNELS_LEFT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    value, mb = out.stdout.split()[-2:]
    return value, float(mb)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallinfo2 counts the heap")
def test_a_command_caps_onednn_kernels_kept_per_shape_and_a_users_capacity_wins():
    """oneDNN keeps a primitive for every 16-bit matmul shape it meets (1,024 by default), a few hundred KB each, so each new
    batch length used to add to the heap while training; inside a surefit command it keeps the last 64. A capacity the
    user set is left as set (here oneDNN's default, 1,024, which keeps all 288)."""
    users, kept_all = _kernels_left("1024")
    if kept_all < 20:
        pytest.skip(f"this CPU's bf16 matmuls keep {kept_all:.1f} MB of kernels for 288 shapes: not oneDNN's cache")
    ours, kept_capped = _kernels_left(None)
    assert users == "1024" and ours == str(threads.KERNEL_CACHE_CAPACITY)
    # 152 against 91 MB on a Zen 4 EPYC: what is left grows in ideep's own cache of the same matmuls, not oneDNN's
    assert kept_all - kept_capped > 15 and kept_capped < 0.8 * kept_all, (kept_capped, kept_all)


def test_the_kernel_cache_cap_is_surefits_only_where_the_user_set_none(monkeypatch):
    for name in threads.KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_CHOSEN", {})
    ours = f"{threads.KERNEL_CACHE_CAPACITY} (surefit's; set ONEDNN_PRIMITIVE_CACHE_CAPACITY to choose another)"
    assert threads.cap_kernel_cache() == ours
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(threads.KERNEL_CACHE_CAPACITY)
    assert threads.cap_kernel_cache() == ours  # a second command in the process: still surefit's, not "set by you"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert threads.cap_kernel_cache() == "1024 (ONEDNN_PRIMITIVE_CACHE_CAPACITY set by you)"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setattr(threads, "_CHOSEN", {})
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "256")  # oneDNN's older name counts too
    assert threads.cap_kernel_cache() == "256 (DNNL_PRIMITIVE_CACHE_CAPACITY set by you)"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
