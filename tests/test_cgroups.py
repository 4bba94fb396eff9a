"""A container's CPU and memory limits, which the CPU affinity and ``/proc/meminfo`` do not show: the CPU limit
(cgroup v2 ``cpu.max``, v1 CFS quota) read from both hierarchies (what it does to the threads: tests/test_threads.py),
and the memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) that the file readers and the generation
planner count as free memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from surefit.cgroups import cpu_limit, memory_left

SRC = Path(__file__).resolve().parents[1] / "src"
GIB = 2**30
V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNT = ("35 25 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            "36 25 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
V1_CPU_MOUNT = ("35 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                "36 25 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")


def _tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "root"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


@pytest.mark.parametrize("cgroup, mountinfo, files, expected", [
    # v2: the container has 4 GiB and uses 1 GiB (half of it reclaimable file cache); its pod above has 0.5 GiB left
    ("0::/pod/c\n", V2_MOUNT, {"sys/fs/cgroup/pod/c/memory.max": f"{4 * GIB}\n",
                              "sys/fs/cgroup/pod/c/memory.current": f"{GIB}\n",
                              "sys/fs/cgroup/pod/c/memory.stat": f"anon 1\ninactive_file {GIB // 2}\nactive_file 0\n",
                              "sys/fs/cgroup/pod/memory.max": f"{3 * GIB}\n",
                              "sys/fs/cgroup/pod/memory.current": f"{5 * GIB // 2}\n"}, GIB // 2),
    ("0::/pod/c\n", V2_MOUNT, {"sys/fs/cgroup/pod/c/memory.max": f"{4 * GIB}\n",
                              "sys/fs/cgroup/pod/c/memory.current": f"{GIB}\n",
                              "sys/fs/cgroup/pod/c/memory.stat": f"inactive_file {GIB // 2}\n",
                              "sys/fs/cgroup/pod/memory.max": "max\n"}, 4 * GIB - GIB // 2),
    ("0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": "5\n"}, None),
    # v1, with "no limit" written as v1 writes it; then a limit the usage is already over
    ("4:memory:/x\n1:cpu:/\n", V1_MOUNT, {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": "9223372036854771712\n",
                                          "sys/fs/cgroup/memory/x/memory.usage_in_bytes": "100\n"}, None),
    ("4:memory:/x\n", V1_MOUNT, {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": f"{GIB}\n",
                                 "sys/fs/cgroup/memory/x/memory.usage_in_bytes": f"{2 * GIB}\n",
                                 "sys/fs/cgroup/memory/x/memory.stat": "total_inactive_file 0\n"}, 0),
])
def test_the_memory_a_cgroup_leaves_is_read_from_v2_and_v1_hierarchies(tmp_path, cgroup, mountinfo, files,
                                                                       expected):
    proc, root = _tree(tmp_path, cgroup, mountinfo, files)
    assert memory_left(proc, root) == expected


@pytest.mark.parametrize("cgroup, mountinfo, files, expected", [
    # cgroup v2: the lowest limit on the way up from the process's cgroup (a pod's limit above its container's)
    ("0::/kubepods/pod1/c1\n", V2_MOUNT, {"sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000\n",
                                         "sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
                                         "sys/fs/cgroup/kubepods/cpu.max": "800000 100000\n"}, 1.5),
    ("0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "max 100000\n"}, None),  # no limit
    # a container whose cgroup namespace hides the host's path: its mount is its own cgroup (docker --cpus 2)
    ("0::/../../docker/abc\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "200000 100000\n"}, 2.0),
    # cgroup v1, cpu and cpuacct mounted together; -1 is no limit
    ("4:memory:/x\n3:cpu,cpuacct:/x\n", V1_CPU_MOUNT, {"sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_quota_us": "300000\n",
                                                       "sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("3:cpu,cpuacct:/x\n", V1_CPU_MOUNT, {"sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n",
                                          "sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", "", {}, None),  # no cgroup file system mounted
])
def test_the_cgroup_cpu_limit_is_read_from_v2_and_v1_hierarchies(tmp_path, cgroup, mountinfo, files, expected):
    proc, root = _tree(tmp_path, cgroup, mountinfo, files)
    assert cpu_limit(proc, root) == expected
    assert cpu_limit(tmp_path / "no-proc", root) is None


def test_in_a_memory_limited_cgroup_the_readers_and_the_planner_count_the_limit_not_the_hosts_memory():
    """A real cgroup (v1's memory controller, where this machine lets the test make one) of 3 GiB: the free memory
    the file readers check a file's size against, and the generation planner's room, are what the limit leaves."""
    base = Path("/sys/fs/cgroup/memory")
    group = base / f"surefit-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(3 * GIB))
    except OSError as e:
        if group.is_dir():
            group.rmdir()
        pytest.skip(f"no cgroup v1 memory controller this test may create a group in: {e}")
    code = (f"import os, json\nopen({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from surefit.cgroups import memory_left\nfrom surefit.data.readers.limits import available_memory\n"
            "from surefit.training.plan import _available_bytes\n"
            "print(json.dumps([memory_left(), available_memory(), list(_available_bytes())]))\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(SRC)})
    finally:
        group.rmdir()
    assert done.returncode == 0, done.stderr[-3000:]
    left, free, (room, which) = json.loads(done.stdout.strip().splitlines()[-1])
    assert 2 * GIB < left <= 3 * GIB  # the interpreter and torch's import use some of it
    assert free <= left + 2**26 and room <= left + 2**26  # read one after another: usage moves a little
    assert which == "left under this process's cgroup memory limit"
