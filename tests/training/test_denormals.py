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
    with flush_denormals(torch.device("cpu")):  # nested (the runner's around fit's): on until the outer one ends
        with flush_denormals(torch.device("cpu")):
            assert not _survives()
        assert not _survives()
    assert _survives()


def test_a_training_run_flushes_denormals_in_its_steps_and_restores_the_setting(tmp_path):
    # The run's own forwards see the flag: fit once took it from a keyword argument it no longer had, and never set it.
    import subprocess
    import sys
    from pathlib import Path

    import surefit

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero control (not x86 with SSE3)")
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(repo / "examples/custom/make_shards.py"), "--out", str(tmp_path / "s"),
                    "--vocab", "17", "--train", "32", "--val", "8", "--shard_rows", "64", "--seed", "0"],
                   check=True, capture_output=True)
    seen = tmp_path / "seen.txt"
    (tmp_path / "m.py").write_text(f'''import torch
from torch import nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(17, 4)
    def forward(self, batch):
        if self.training:
            kept = float(torch.tensor([{TINY!r}], dtype=torch.float32) * 1.0) != 0.0
            with open({str(seen)!r}, "a") as fh:
                fh.write("survived\\n" if kept else "flushed\\n")
        return (self.lin(batch["inputs_embeds"].mean(1)),)
def build():
    return M()
''')
    surefit.train(task="custom", model=f"{tmp_path / 'm.py'}:build", data=str(tmp_path / "s" / "train"),
                  loss="cross_entropy", epochs=1, batch_size=16, output_dir=str(tmp_path / "o"))
    seen_in = seen.read_text().split()
    # the two training steps, and before them the doctor's dry run and the planner's probe (the custom task's own
    # shape check, while preparing, comes before the device is settled)
    assert set(seen_in[-2:]) == {"flushed"} and seen_in.count("flushed") >= 3
    assert _survives()  # torch's default again after the run
