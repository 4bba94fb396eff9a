"""Giving the C heap's freed pages back (training/heap.py): resident memory drops on glibc, nothing happens elsewhere."""

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from surefit import threads
from surefit.training import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").exists(),
                           reason="glibc on Linux only")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@glibc
def test_free_pages_between_live_blocks_are_given_back():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 << 10, 2048  # below glibc's mmap threshold: these live in the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touched: resident
    for b in blocks[::2]:
        libc.free(b)  # every other one: free chunks between live ones, which glibc keeps resident
    before = _rss_mb()
    assert heap.release_free_memory() is True
    after = _rss_mb()
    for b in blocks[1::2]:
        libc.free(b)
    # about half of 128 MB was free; the free chunks' whole pages go back (a chunk's first page holds its header)
    assert before - after > 0.7 * n / 2 * size / 2**20 * (15 / 16)


def test_without_glibc_it_does_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))
    heap._glibc.cache_clear()
    try:
        assert heap.release_free_memory() is False
    finally:
        heap._glibc.cache_clear()


def test_saved_activations_can_hand_the_heap_back_every_n_bytes_packed(monkeypatch):
    import torch

    from surefit.training.speedups import lora_fast
    from surefit.training.speedups.lora_fast import SavedActivationsIn

    calls = []
    monkeypatch.setattr(lora_fast, "release_free_memory", lambda: calls.append(1) or True)
    x = torch.randn(64, 256, requires_grad=True)

    def forward_backward(store):
        with store:
            y = x
            for _ in range(8):
                y = torch.tanh(y * 1.01)  # tanh saves its fp32 output: 32 KB packed in bf16
        y.sum().backward()

    forward_backward(SavedActivationsIn())
    assert calls == []  # off by default
    monkeypatch.setattr(SavedActivationsIn, "release_every", 3 * 64 * 256 * 2)
    forward_backward(SavedActivationsIn())
    assert len(calls) == 2  # 8 packed tensors of 32 KB: after the third and the sixth


def test_the_loop_gives_the_heap_back_around_evaluations_once_a_step_has_run(tmp_path, tiny_lm_dir, monkeypatch):
    """What the set-up and the evaluation before training free is what step 1 reuses: the loop gives nothing back
    before the first step (doing so only made step 1 fault those pages in again), and gives back before and after
    each evaluation from then on (the evaluation's peak must not carry the training's leftovers, nor the other way)."""
    import json

    import surefit.training.loop as loop
    from conftest import qa_rows
    from surefit.cli import main

    events: list[str] = []
    step, evaluate = loop._Fit.optimizer_step, loop._Fit.evaluate

    def counted_step(self, *a, **k):
        events.append("step")
        return step(self, *a, **k)

    def counted_eval(self, *a, **k):  # the loop's evaluate, which gives the heap back (or not) around the task's
        events.append("evaluate(")
        try:
            return evaluate(self, *a, **k)
        finally:
            events.append(")")

    monkeypatch.setattr(loop, "release_free_memory", lambda: events.append("release") or True)
    monkeypatch.setattr(loop._Fit, "optimizer_step", counted_step)
    monkeypatch.setattr(loop._Fit, "evaluate", counted_eval)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(16)), encoding="utf-8")
    assert main(["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2",
                 "--lora_r", "4", "--batch_size", "6", "--max_seq_length", "96", "--val_fraction", "0.25",
                 "--max_new_tokens", "2", "--output_dir", str(tmp_path / "run")]) == 0
    assert events == ["evaluate(", ")", "step", "step", "evaluate(", "release", "release", ")", "step", "step",
                      "evaluate(", "release", "release", ")"]


def _train_args(tiny_lm_dir, tmp_path, data_rows: int = 24) -> list[str]:
    import json

    from conftest import qa_rows

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(data_rows)), encoding="utf-8")
    return ["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1",
            "--lora_r", "4", "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", "0.2",
            "--eval_generate", "false", "--no_cache", "--output_dir", str(tmp_path / "run")]


def test_the_train_command_holds_the_collector_off_until_training_then_freezes_the_set_up(tiny_lm_dir, tmp_path,
                                                                                           monkeypatch):
    import gc

    import surefit.tasks.sft.train_sft as train_sft
    import surefit.training.loop as loop
    from surefit.cli import main

    seen: dict[str, tuple[bool, int]] = {}
    real_load, real_settings = train_sft.load_model, loop.device_settings

    def at_load(*a, **k):
        seen["model load"] = (gc.isenabled(), gc.get_freeze_count())
        return real_load(*a, **k)

    def at_loop(*a, **k):
        seen["training loop"] = (gc.isenabled(), gc.get_freeze_count())
        return real_settings(*a, **k)

    monkeypatch.setattr(train_sft, "load_model", at_load)
    monkeypatch.setattr(loop, "device_settings", at_loop)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(_train_args(tiny_lm_dir, tmp_path)) == 0
    enabled, imported = seen["model load"]
    assert not enabled and imported > 10_000  # set-up: no collections; the imported modules' objects frozen
    enabled, frozen = seen["training loop"]
    assert enabled and frozen > imported  # the set-up's objects (the model among them) out of the collector's walks
    assert gc.isenabled() and gc.get_freeze_count() == 0  # as found, for the rest of this Python session


def test_a_train_command_that_stops_before_training_leaves_the_collector_as_found(tiny_lm_dir, tmp_path, capsys):
    import gc

    from surefit.cli import main

    args = _train_args(tiny_lm_dir, tmp_path)
    args[args.index("--data") + 1] = str(tmp_path / "missing.jsonl")
    assert main(args) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # a session that turned the collector off keeps it off
    try:
        assert main(args) == 2
        assert not gc.isenabled()
    finally:
        gc.enable()


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


@glibc
def test_a_command_caps_onednn_kernels_kept_per_shape_and_a_users_capacity_wins():
    """oneDNN keeps a primitive for every 16-bit matmul shape it meets (1,024 by default), about a MB each, so each new
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
    monkeypatch.setattr(threads, "_KERNEL_CACHE_SET", [])
    ours = f"{threads.KERNEL_CACHE_CAPACITY} (surefit's; set ONEDNN_PRIMITIVE_CACHE_CAPACITY to choose another)"
    assert threads.cap_kernel_cache() == ours
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(threads.KERNEL_CACHE_CAPACITY)
    assert threads.cap_kernel_cache() == ours  # a second command in the process: still surefit's, not "set by you"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert threads.cap_kernel_cache() == "1024 (ONEDNN_PRIMITIVE_CACHE_CAPACITY set by you)"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setattr(threads, "_KERNEL_CACHE_SET", [])
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "256")  # oneDNN's older name counts too
    assert threads.cap_kernel_cache() == "256 (DNNL_PRIMITIVE_CACHE_CAPACITY set by you)"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
