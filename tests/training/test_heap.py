"""Giving the C heap's freed pages back (training/heap.py): resident memory drops on glibc, nothing happens elsewhere."""

import ctypes
import platform
from pathlib import Path

import pytest

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

