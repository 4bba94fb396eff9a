"""Thread settings chosen for a shared machine, the user's own kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from surefit.training.threads import available_cores, configure_threads


def test_sleeping_waits_and_the_available_cores_unless_the_user_set_them():
    env: dict[str, str] = {}
    chosen = configure_threads(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "OMP_NUM_THREADS": str(available_cores())}
    assert chosen == env
    mine = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}
    assert configure_threads(mine) == {"KMP_BLOCKTIME": "0"}
    assert mine["OMP_NUM_THREADS"] == "1" and mine["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_command_line_sets_them_before_torch_is_imported(tmp_path):
    src = Path(__file__).resolve().parents[2] / "src"
    code = ("import sys, os, json; from surefit.cli import main; main(['doctor', '--list']); import torch; "
            "json.dump({'policy': os.environ.get('OMP_WAIT_POLICY'), 'threads': torch.get_num_threads(), "
            "'omp': os.environ.get('OMP_NUM_THREADS')}, open(sys.argv[1], 'w'))")
    for given, expected in ((None, available_cores()), ("1", 1)):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
        env["PYTHONPATH"] = str(src)
        if given:
            env["OMP_NUM_THREADS"] = given
        out = tmp_path / "out.json"
        subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, capture_output=True)
        got = json.loads(out.read_text())
        assert got == {"policy": "PASSIVE", "threads": expected, "omp": str(expected)}, got
