"""Where a whole run's wall time went, from the command to the end of ``surefit train``: ``--profile``.

The start-up (command to step 1) is the :class:`~surefit.startup.Clock`'s, split by its phases. After step 1,
:func:`part` times the work the loop does besides training steps (evaluation loss, generation, checkpoints) and
what follows the last step (the final save, the report); the training steps are the rest of the loop's time. The
record (``OUTPUT/profile.json``) adds up to the run's wall time by construction: what no part covers is ``other``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

# Progress phases (eval/progress.py) that are parts of the profile, under the profile's own names.
# "evaluating": the loss computed in the prompts' forward, then the answers (--eval_loss_in_prefill, the default).
PROGRESS_PARTS = {"generating": "generation", "evaluation loss": "evaluation loss",
                  "evaluating": "evaluation loss and generation"}
# The parts in the order a run goes through them (the record lists them so).
ORDER = ("start-up", "training steps", "evaluation loss", "generation", "evaluation loss and generation",
         "evaluation (other)", "checkpoints", "final save", "report", "other")


class WallTimes:
    """Exclusive wall-clock seconds per part of a run after step 1 (a part inside another counts in the inner one)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.recording = False  # parts count from step 1 on (before it, the start-up clock has them)
        self._open: list[list[Any]] = []

    def enter(self, name: str) -> list[Any] | None:
        """Open part ``name``; ``None`` while not recording. Close it with :meth:`leave`."""
        if not self.recording:
            return None
        entry = [name, time.perf_counter(), 0.0]  # name, start, seconds of the parts nested in it
        self._open.append(entry)
        return entry

    def leave(self, entry: list[Any] | None) -> None:
        """Close a part :meth:`enter` opened (``None`` and parts already closed are ignored)."""
        if entry is None or entry not in self._open:
            return
        self._open.remove(entry)
        spent = time.perf_counter() - entry[1]
        self.parts[entry[0]] = self.parts.get(entry[0], 0.0) + spent - entry[2]
        if self._open:
            self._open[-1][2] += spent

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time a block as part ``name``."""
        entry = self.enter(name)
        try:
            yield
        finally:
            self.leave(entry)


_current: list[WallTimes] = []


@contextmanager
def recording(times: WallTimes) -> Iterator[WallTimes]:
    """Make ``times`` the one :func:`part` adds to, for the duration of the block."""
    _current.append(times)
    try:
        yield times
    finally:
        _current.remove(times)


def part(name: str) -> Any:
    """Time a block as part ``name`` of the running profile (nothing when no run records one, or before step 1)."""
    return _current[-1].part(name) if _current and _current[-1].recording else nullcontext()


def enter(name: str) -> list[Any] | None:
    """:meth:`WallTimes.enter` on the running profile, for code that cannot use a ``with`` block (progress bars)."""
    return _current[-1].enter(name) if _current else None


def leave(entry: list[Any] | None) -> None:
    """:meth:`WallTimes.leave` on the running profile."""
    if _current:
        _current[-1].leave(entry)


@dataclass
class Profile:
    """``OUTPUT/profile.json``: where the run's wall time went.

    Attributes:
        seconds: from the command's start (``startup.command``) to the end of the run (the profile itself is the
            last work).
        parts: seconds per part, in :data:`ORDER`; they add up to ``seconds`` (``other`` is the rest).
        startup: the start-up's phases (``startup.json``), which add up to ``parts["start-up"]``.
        doctor: the doctor's phase split by check (by the codes each reports), longest first; empty when the doctor's
            report came from the start-up cache.
    """

    seconds: float
    parts: dict[str, float]
    startup: dict[str, float] = field(default_factory=dict)
    doctor: dict[str, float] = field(default_factory=dict)

    @classmethod
    def build(cls, total: float, startup_seconds: float, startup_phases: dict[str, float], loop_seconds: float,
              times: WallTimes, doctor: dict[str, float] | None = None) -> Profile:
        """Put the parts together. ``loop_seconds``: from step 1 to the loop's return; the parts recorded inside it
        come out of it, and what is left is the training steps."""
        after = dict(times.parts)
        in_loop = sum(v for k, v in after.items() if k not in ("final save", "report"))
        parts = {"start-up": startup_seconds, "training steps": max(0.0, loop_seconds - in_loop), **after}
        # to the record's 1 ms, so that the printout shows what profile.json holds (728.5496 s would print as
        # 728.5 and be recorded as 728.55)
        total, parts = round(total, 3), {k: round(v, 3) for k, v in parts.items()}
        parts["other"] = round(max(0.0, total - sum(parts.values())), 3)
        ordered = {k: parts[k] for k in ORDER if k in parts} | {k: v for k, v in parts.items() if k not in ORDER}
        return cls(total, ordered, {k: round(v, 3) for k, v in startup_phases.items()},
                   {k: round(v, 3) for k, v in sorted((doctor or {}).items(), key=lambda kv: -kv[1])})

    def to_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "parts": {k: round(v, 3) for k, v in self.parts.items()},
                "startup": {k: round(v, 3) for k, v in self.startup.items()},
                "doctor": {k: round(v, 3) for k, v in self.doctor.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """The record :meth:`to_json` wrote (raises ``KeyError``/``TypeError``/``ValueError`` on another shape)."""
        return cls(float(data["seconds"]), {str(k): float(v) for k, v in dict(data["parts"]).items()},
                   {str(k): float(v) for k, v in dict(data.get("startup", {})).items()},
                   {str(k): float(v) for k, v in dict(data.get("doctor", {})).items()})

    def table(self) -> str:
        """The printout: one line per part with seconds and share, the start-up's phases under it, and under the
        doctor its longest checks (the three longest of 0.05 s or more: a user asking why the doctor is slow)."""
        shown = {k: v for k, v in self.startup.items() if v >= 0.05}
        checks = {k: v for k, v in list(self.doctor.items())[:3] if v >= 0.05} if "doctor" in shown else {}
        width = max([len(k) for k in self.parts] + [len(k) + 2 for k in shown] + [len(k) + 4 for k in checks]) + 2
        lines = [f"where the run's {self.seconds:.1f} s went (--profile; OUTPUT/profile.json):"]
        for name, seconds in self.parts.items():
            share = 100.0 * seconds / self.seconds if self.seconds > 0 else 0.0
            lines.append(f"  {name.ljust(width)}{seconds:8.1f} s {share:5.1f}%")
            if name != "start-up":
                continue
            for k, v in shown.items():  # its phases, indented, the longest first (phases under 0.05 s left out)
                lines.append(f"    {k.ljust(width - 2)}{v:8.1f} s")
                if k == "doctor":
                    lines += [f"      {c.ljust(width - 4)}{s:8.1f} s" for c, s in checks.items()]
        return "\n".join(lines)
