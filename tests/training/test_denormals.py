"""Denormal floats are flushed to zero on a CPU while training (a speed fix), and only then."""

import pytest
import torch

from surefit.training.precision import flush_denormals

TINY = 1e-39  # below the smallest normal float32 (1.18e-38): a denormal


def _survives() -> bool:
    return float(torch.tensor([TINY], dtype=torch.float32) * 1.0) != 0.0


def test_denormals_flush_inside_training_on_cpu_and_come_back_after():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero control (not x86 with SSE3)")
    assert _survives()
    with flush_denormals(torch.device("cpu")):
        assert not _survives()
    assert _survives()
    with flush_denormals(torch.device("meta")):  # any other device: untouched
        assert _survives()
