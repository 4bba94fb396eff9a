"""The limits a container or a service manager sets on this process through its cgroup: CPU time (``docker --cpus``,
a Kubernetes CPU limit, systemd's ``CPUQuota``) and memory (``docker --memory``, a Kubernetes memory limit).

Inside a container ``/proc/cpuinfo``, the CPU affinity and ``/proc/meminfo`` still show the host's cores and memory;
a process that sizes its threads or its buffers by them runs past the limit, and is throttled (CPU) or killed by the
kernel (memory). Both cgroup versions are read: v2's ``cpu.max`` and ``memory.max``, v1's CFS quota and
``memory.limit_in_bytes``; a limit set on a cgroup above the process's (a pod's, above its container's) counts too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value (and some kernels a bit less)
_V1_UNLIMITED = 2**62


def cpu_limit(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> float | None:
    """The CPU limit of this process's cgroup in CPUs (quota / period, the lowest of its cgroup and those above it),
    or None where none is set or none can be read. ``proc`` and ``root`` are for tests (``/proc/self`` and ``/``)."""
    limits = [c for folder, v2 in _folders("cpu", proc, root) if (c := _cpus(folder, v2)) is not None]
    return min(limits) if limits else None


def memory_left(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> int | None:
    """Bytes this process's cgroup may still grow by before its memory limit (the least over its cgroup and those
    above it: limit less usage, the inactive file cache counted as free since the kernel reclaims it first), or None
    where no limit is set or none can be read."""
    left = [b for folder, v2 in _folders("memory", proc, root) if (b := _memory_left(folder, v2)) is not None]
    return max(0, min(left)) if left else None


def _folders(controller: str, proc: Path, root: Path) -> Iterator[tuple[Path, bool]]:
    """``(folder, is v2)`` of the process's cgroup for ``controller`` and of every cgroup above it, as mounted."""
    try:
        groups = (proc / "cgroup").read_text(encoding="utf-8").splitlines()
        mounts = (proc / "mountinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    for line in groups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        v2 = controllers == ""
        if not v2 and controller not in controllers.split(","):
            continue
        for mount_root, mount_point in _mounts(mounts, controller, v2):
            top = root / mount_point.lstrip("/")
            # The process's cgroup path is given from the hierarchy's root; the mount shows it from mount_root.
            rel = path[len(mount_root):] if path.startswith(mount_root) else ""
            folder = top / rel.strip("/")
            if not folder.is_dir():
                folder = top  # a container whose cgroup namespace hides the path: its mount is its own cgroup
            while True:
                yield folder, v2
                if folder == top or top not in folder.parents:
                    break
                folder = folder.parent


def _mounts(mountinfo: list[str], controller: str, v2: bool) -> list[tuple[str, str]]:
    """``(root of the hierarchy shown, mount point)`` of each cgroup v2 mount, or each v1 mount of ``controller``,
    from ``/proc/self/mountinfo``."""
    found = []
    for line in mountinfo:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if (v2 and tail[0] == "cgroup2") or (not v2 and tail[0] == "cgroup" and controller in tail[2].split(",")):
            found.append((fields[3], fields[4]))
    return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _cpus(folder: Path, v2: bool) -> float | None:
    """The CPU limit one cgroup folder sets, in CPUs (None: no limit there, or nothing readable)."""
    if v2:
        quota, _, period = (_read(folder / "cpu.max") or "").partition(" ")
    else:
        quota, period = _read(folder / "cpu.cfs_quota_us") or "", _read(folder / "cpu.cfs_period_us") or ""
    try:
        q, t = int(quota), int(period)
    except ValueError:  # "max", or a file that is not there
        return None
    return q / t if q > 0 and t > 0 else None


def _memory_left(folder: Path, v2: bool) -> int | None:
    """Limit less usage of one cgroup folder in bytes (None: no limit there, or nothing readable)."""
    names = ("memory.max", "memory.current", "inactive_file") if v2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    try:
        limit, usage = int(_read(folder / names[0]) or ""), int(_read(folder / names[1]) or "")
    except ValueError:  # "max", or a file that is not there
        return None
    if limit <= 0 or limit >= _V1_UNLIMITED:
        return None
    inactive = 0
    for line in (_read(folder / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == names[2] and value.isdigit():
            inactive = int(value)
            break
    return limit - max(0, usage - inactive)
