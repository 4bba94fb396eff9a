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
