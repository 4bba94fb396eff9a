"""The suite's own scheduler (tests/conftest.py: ``pytest_xdist_make_scheduler``): under ``--dist loadgroup`` each file
runs on one worker, so its module fixtures (trained runs, some of them minutes long) are built once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

HERE = Path(__file__).resolve().parent

# Loads the suite's conftest under another name and takes its scheduler hook alone (not its configure hook, which
# prepares the embedded model).
CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {str(HERE / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
"""

# Each test records its worker and whether its module's fixture was built in that worker.
MODULE = """
import json, os, pytest
from pathlib import Path

@pytest.fixture(scope="module")
def built():
    with open(Path(__file__).with_name("built.jsonl"), "a") as f:
        f.write(json.dumps([__name__, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")

@pytest.mark.parametrize("i", range({n}))
def test_one(built, i):
    with open(Path(__file__).with_name("ran.jsonl"), "a") as f:
        f.write(json.dumps([__name__, i, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_each_file_runs_on_one_worker_and_builds_its_module_fixture_once(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    # Files of different sizes, so that handing the biggest out first differs from the collection's order.
    sizes = {"test_a": 1, "test_b": 5, "test_c": 3, "test_d": 4, "test_e": 2}
    for name, n in sizes.items():
        (tmp_path / f"{name}.py").write_text(MODULE.format(n=n), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [json.loads(line) for line in (tmp_path / "ran.jsonl").read_text().splitlines()]
    built = [json.loads(line) for line in (tmp_path / "built.jsonl").read_text().splitlines()]
    assert sorted((m, i) for m, i, _ in ran) == sorted((m, i) for m, n in sizes.items() for i in range(n))
    workers = {m: {w for mm, _, w in ran if mm == m} for m in sizes}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert sorted(m for m, _ in built) == sorted(sizes), built  # each module fixture once
    assert len({w for ws in workers.values() for w in ws}) == 2  # and both workers had work
