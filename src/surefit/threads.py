"""CPU thread settings that are fast on a machine of one's own and survive a shared one.

OpenMP's default wait policy lets an idle worker thread spin for a while before it sleeps. Alone on a machine that
is the fast choice: a training step runs tens of thousands of small parallel regions, and a spinning thread joins
each at once where a sleeping one has to be woken. Beside other work it is the slow one: the spinning threads take
the cores the others need, and every parallel region waits for a thread that is not scheduled (docs/performance.md,
"Threads on a shared machine", has the measurements).

So surefit keeps the spinning waits and changes the thread count instead, which torch can do at any time: a
:class:`ThreadGovernor` watches how much of this process's cores other processes use (``/proc/stat``, less this
process's own CPU time), drops to fewer threads when its threads and their use exceed the cores by more than half a
core (one thread never waits for another), and goes back up once the cores have stayed free for a few seconds. The
training loop, the fused LoRA layers, the evaluations and the start-up phases call :func:`check_threads` between
pieces of work. A user who sets ``OMP_NUM_THREADS`` gets that count, fixed, and sleeping waits unless they chose a
policy too (a fixed count cannot step aside).

The wait policy is read when torch loads its OpenMP runtime, so :func:`configure_threads` runs before torch is
imported (``surefit`` on the command line, ``surefit.train`` in Python); a value the user set is never changed.

oneDNN, which runs torch's 16-bit matmuls on a CPU, keeps a primitive for every matmul shape it meets, so each
training batch of a new length used to add its set to the heap for good: :func:`cap_kernel_cache` caps the cache at a
command's start (docs/performance.md, "A chat step: casts and memory").
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from surefit.cgroups import cpu_limit

# oneDNN's primitive cache capacity while surefit runs a command: over three times the 18 distinct 16-bit matmuls of
# a LoRA training step of a Llama-shaped model (its seven layers' forward, input gradients and rank-r products, and
# the head), so a step finds its own in the cache and generation's prompt and decode shapes mostly do too (32 made
# SQuAD's evaluations 14% slower); a new batch length then replaces the oldest lengths' instead of adding to them.
# A primitive made again costs up to about half a millisecond; each one kept holds a few hundred KB.
KERNEL_CACHE_CAPACITY = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def cap_kernel_cache() -> str:
    """Set oneDNN's primitive cache capacity to :data:`KERNEL_CACHE_CAPACITY` unless the user set it; returns the
    capacity in force and who chose it (``startup.json`` keeps it). oneDNN reads the variable when it makes its first
    primitive, so this has to run before the process's first 16-bit matmul on a CPU (a command's start); after that
    it changes nothing."""
    for name in KERNEL_CACHE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value and not chosen_here(name):
            return f"{value} ({name} set by you)"
    name = KERNEL_CACHE_VARIABLES[0]
    os.environ[name] = _CHOSEN[name] = str(KERNEL_CACHE_CAPACITY)
    return f"{KERNEL_CACHE_CAPACITY} (surefit's; set {name} to choose another)"


def available_cores() -> int:
    """The cores this process may use, at least 1: its CPU affinity (``taskset``, a container's cpuset), or fewer
    where a cgroup CPU limit allows less (``docker --cpus``, a Kubernetes CPU limit): the whole CPUs of that limit."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = max(1, os.cpu_count() or 1)
    limit = cpu_limit()
    # Floor, not round: spinning threads past the limit use up each period's quota early, and then every thread of
    # the process is stopped until the next period.
    return min(cores, max(1, math.floor(limit))) if limit is not None else cores


def configure_threads(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Choose the OpenMP wait policy and thread count where the user has not: returns what was set.

    Nothing set by the user: ``OMP_NUM_THREADS`` = the available cores, OpenMP's own spinning waits, and (for this
    process, ``environ`` None) a :class:`ThreadGovernor` that lowers the count while other processes use the cores;
    where no governor can run (:func:`can_govern`: one core, or no ``/proc/stat`` to read) sleeping waits instead.
    ``OMP_NUM_THREADS`` set: that count, fixed, with ``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0`` (threads
    sleep when idle) unless the user chose a policy. When torch is already imported, its thread count is set too
    (the wait policy then stays what the runtime read).
    """
    import sys

    global _GOVERNOR
    env = os.environ if environ is None else environ
    chosen: dict[str, str] = {}
    fixed = bool(env.get("OMP_NUM_THREADS"))
    governed = False
    if not fixed and env.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        if environ is None:
            if _GOVERNOR is None:
                _GOVERNOR = ThreadGovernor.for_this_process(available_cores())
            governed = _GOVERNOR is not None
        else:
            governed = can_govern()
    # Spinning waits only with a governor to step aside: a fixed count, one core or no /proc/stat to read sleep.
    defaults = () if governed else (("OMP_WAIT_POLICY", "PASSIVE"), ("KMP_BLOCKTIME", "0"))
    for name, value in (*defaults, ("OMP_NUM_THREADS", str(available_cores()))):
        if not env.get(name):
            env[name] = value
            chosen[name] = value
    if environ is not None:
        return chosen
    _CHOSEN.update(chosen)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in chosen:
        torch.set_num_threads(int(chosen["OMP_NUM_THREADS"]))
    return chosen


def can_govern() -> bool:
    """Whether a governor can run here: more than one core, their CPU time readable in ``/proc/stat``, and no cgroup
    CPU limit below them (the cores' busy time then says nothing of the share the limit leaves this process)."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return False
    limit = cpu_limit()
    if len(cpus) <= 1 or (limit is not None and limit < len(cpus)):
        return False
    return _read_sample(cpus, 1.0 / os.sysconf("SC_CLK_TCK")) is not None


def limited_by_cgroup() -> str | None:
    """A line for the run's output where surefit chose fewer threads than the process's cores because of a cgroup CPU
    limit, else None."""
    if not chosen_here("OMP_NUM_THREADS"):
        return None
    limit = cpu_limit()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if limit is None or limit >= cores:
        return None
    n = available_cores()
    return (f"threads: {n} (this process's cgroup allows {limit:g} CPU{'s' * (limit != 1)} of the {cores} cores it may run on, e.g. "
            f"docker --cpus or a Kubernetes CPU limit; more threads would use up each period's quota early and all "
            f"wait for the next; OMP_NUM_THREADS fixes the count)")


def chosen_here(name: str) -> bool:
    """Whether ``name`` in this process's environment is surefit's choice rather than the user's (the launcher then
    shares the cores out among its processes instead of handing each all of them)."""
    return name in _CHOSEN and os.environ.get(name) == _CHOSEN[name]


def check_threads() -> None:
    """Between two pieces of work on the main thread: let the governor (if any) adjust the thread count."""
    if _GOVERNOR is not None:
        _GOVERNOR.check()


def governor() -> ThreadGovernor | None:
    """This process's governor: None where the user fixed the thread count (or no ``/proc/stat`` to read)."""
    return _GOVERNOR


def thread_changes() -> int:
    """How many times the governor has changed the thread count: work whose result is stored for reuse (the start-up
    cache) is stored only when this did not move while it ran, since the last bits of a sum follow the count."""
    return len(_GOVERNOR.changes) if _GOVERNOR is not None else 0


def describe_threads() -> dict[str, Any]:
    """For ``startup.json`` and the run's last words: the count, the waits and what the governor did."""
    import torch

    if _GOVERNOR is None:
        limit = cpu_limit()
        return {"threads": torch.get_num_threads(), "waits": os.environ.get("OMP_WAIT_POLICY", "").lower() or "spin",
                "governed": False, **({"cpu_limit": round(limit, 3)} if limit is not None else {})}
    g = _GOVERNOR
    return {"threads": g.full, "now": g.threads, "waits": "spin", "governed": True, "changes": list(g.changes),
            "seconds_below_full": round(g.seconds_below_full(), 1)}


@dataclass
class _Sample:
    wall: float  # time.monotonic()
    own: float  # this process's CPU seconds, every thread
    busy: float  # CPU seconds of this process's cores, anyone's
    idle: float  # idle seconds of this process's cores


def _read_sample(cpus: frozenset[int], tick: float) -> _Sample | None:
    """One reading of the cores in ``cpus`` from ``/proc/stat`` (None where it cannot be read)."""
    busy = idle = 0.0
    seen = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu") or line[3:4] == b" ":
                    if seen and not line.startswith(b"cpu"):
                        break
                    continue
                fields = line.split()
                if int(fields[0][3:]) not in cpus:
                    continue
                values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
                idle += values[3] + values[4]
                busy += values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
                seen += 1
    except (OSError, ValueError, IndexError):
        return None
    if seen != len(cpus):
        return None
    t = os.times()
    return _Sample(time.monotonic(), t.user + t.system, busy * tick, idle * tick)


class ThreadGovernor:
    """Lowers torch's thread count while other processes use this process's cores, and raises it back.

    Every :meth:`check` at least ``every_s`` after the last one reads the cores' CPU time: others' use is the cores'
    busy time less this process's own, per second of wall time. When this process's threads and the others' use
    exceed the cores by more than ``crowded`` (cores' worth), the count drops to the cores the others leave (by one
    at least, never below 1); after ``calm_s`` seconds in a row with more than ``free`` cores idle it rises by the
    idle cores (never above ``full``). Spinning threads count as busy, so while this process spins on every core
    the others' share shows as its own threads being descheduled: their time is the cores' time it did not get.
    """

    def __init__(self, full: int, cpus: frozenset[int], *, every_s: float = 1.0, crowded: float = 0.5,
                 free: float = 0.75, calm_s: float = 3.0, set_threads: Callable[[int], None] | None = None,
                 read: Callable[[], _Sample | None] | None = None) -> None:
        self.full = self.threads = full
        self.cpus = cpus
        self.every_s, self.crowded, self.free, self.calm_s = every_s, crowded, free, calm_s
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        self._read = read if read is not None else lambda: _read_sample(cpus, tick)
        self._set = set_threads
        self.say: Callable[[str], None] | None = None  # the run's reporter, once there is a run
        self.changes: list[dict[str, float]] = []  # {"at_s", "threads", "others"}: what was done and why
        self._start = time.monotonic()
        self._calm = 0.0
        self._last = self._read()

    @classmethod
    def for_this_process(cls, full: int) -> ThreadGovernor | None:
        try:
            cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        return cls(full, cpus) if full > 1 and can_govern() else None

    def check(self) -> int:
        """Adjust the thread count if the cores' use since the last reading calls for it; returns the count."""
        last = self._last
        if last is None or time.monotonic() - last.wall < self.every_s:
            return self.threads
        if threading.current_thread() is not threading.main_thread():
            return self.threads  # OpenMP's thread count belongs to the thread that sets it
        now = self._read()
        if now is None or now.wall <= last.wall:
            return self.threads
        self._last = now
        dt = now.wall - last.wall
        others = max(0.0, ((now.busy - last.busy) - (now.own - last.own)) / dt)
        idle = (now.idle - last.idle) / dt
        self._calm = self._calm + dt if idle > self.free else 0.0
        target = self.threads
        cores = len(self.cpus)
        if self.threads > 1 and self.threads + others > cores + self.crowded:
            target = max(1, min(self.threads - 1, cores - math.ceil(others - 0.25)))
        elif self.threads < self.full and self._calm >= self.calm_s:
            target = min(self.full, self.threads + max(1, math.floor(idle + 0.25)))
            self._calm = 0.0
        if target != self.threads:
            self._apply(target, others, idle)
        return self.threads

    def seconds_below_full(self) -> float:
        """Wall seconds spent on fewer threads than ``full`` so far."""
        spent, since = 0.0, None
        for change in self.changes:
            if change["threads"] < self.full and since is None:
                since = change["at_s"]
            elif change["threads"] >= self.full and since is not None:
                spent, since = spent + change["at_s"] - since, None
        if since is not None:
            spent += time.monotonic() - self._start - since
        return spent

    def _apply(self, target: int, others: float, idle: float) -> None:
        if self._set is not None:
            self._set(target)
        else:
            import torch

            torch.set_num_threads(target)
        before, self.threads = self.threads, target
        self.changes.append({"at_s": round(time.monotonic() - self._start, 1), "threads": target,
                             "others": round(others, 2), "idle": round(idle, 2)})
        if self.say is not None:
            if target < before:
                self.say(f"other processes are using {others:.1f} of this machine's {len(self.cpus)} cores: "
                         f"surefit now runs {target} thread{'s' * (target > 1)} instead of {before}, so that "
                         "neither waits on the other's cores (it goes back up when they are free; OMP_NUM_THREADS "
                         "fixes the count)")
            else:
                self.say(f"{idle:.1f} of this machine's cores are free again: surefit runs {target} threads")


_GOVERNOR: ThreadGovernor | None = None
_CHOSEN: dict[str, str] = {}
