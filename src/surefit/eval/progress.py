"""Progress of a long phase: a bar (with the time left) or a spinner (with the time spent) on a terminal, and one
plain line per phase when the output is a file or CI, so that a log holds no bar characters and no glued lines.

One module for every phase (evaluation, generation, data encoding, the doctor, the memory plan, model conversion,
``eval``, ``predict``). It draws on stderr; on a terminal a thread redraws every 0.2 s, so a phase that blocks (a
forward pass, a conversion) still shows its clock moving. Nested phases draw the innermost only.

    with Progress("generating", total=20, unit="answer") as bar:
        for batch in batches:
            ...
            bar.update(len(batch))
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, Any

import surefit.startup.walltime as walltime
from surefit.threads import check_threads

SHOW_AFTER_S = 1.0  # a terminal draws a phase only once it has run this long (short phases stay silent)
LINE_AFTER_S = 2.0  # a log file gets a phase's line only when it took at least this long
_SPIN = "|/-\\"
_active: list[Progress] = []
_lock = threading.Lock()


def is_terminal(stream: IO[str]) -> bool:
    """A terminal (bars redraw in place) rather than a file, a pipe or CI (one line per phase)."""
    if os.environ.get("SUREFIT_PROGRESS") in ("plain", "tty"):
        return os.environ["SUREFIT_PROGRESS"] == "tty"
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb" and not os.environ.get("CI")
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Progress:
    """A phase's progress. ``total`` known: a bar with done/total, rate and the time left; unknown: a spinner with
    the time spent. In a file: one line when the phase ends (``what: 20/20 answer in 00:41``), nothing drawn.

    Args:
        what: the phase, as the user reads it ("generating", "doctor").
        total: the amount of work, when known.
        unit: what ``total`` counts ("answer", "row", "step").
        stream: where to write (stderr by default).
        enabled: ``False`` draws and writes nothing (other processes than the main one).
    """

    def __init__(self, what: str, total: int | None = None, unit: str = "", stream: IO[str] | None = None,
                 enabled: bool = True) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and is_terminal(self.stream)
        self.done = 0
        self.note = ""
        self.started = time.perf_counter()
        self._drawn = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._part: list[Any] | None = None

    # ------------------------------------------------------------------------------------------------ the context

    def __enter__(self) -> Progress:
        self.started = time.perf_counter()
        # --profile: generation and the evaluation loss are parts of the run's wall time (startup/walltime.py)
        self._part = walltime.enter(walltime.PROGRESS_PARTS[self.what]) if self.what in walltime.PROGRESS_PARTS \
            else None
        if self.enabled:
            with _lock:
                if _active and _active[-1].tty:
                    _active[-1]._clear()
                _active.append(self)
            if self.tty:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(failed=exc[0] is not None)

    def close(self, failed: bool = False) -> None:
        """End the phase: clear the bar (terminal) or write its one line (file), unless it was short."""
        walltime.leave(self._part)
        self._part = None
        if not self.enabled or self not in _active:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with _lock:
            _active.remove(self)
            spent = time.perf_counter() - self.started
            if self.tty:
                self._clear()
            elif spent >= LINE_AFTER_S or failed:
                self.stream.write(self.line(spent, failed) + "\n")
                self.stream.flush()

    # ------------------------------------------------------------------------------------------------ updates

    def update(self, n: int = 1, note: str | None = None) -> None:
        """``n`` more units done; ``note`` (e.g. ``loss=0.93``) is shown after the counts."""
        self.done += n
        check_threads()  # between two pieces of work: the thread count follows the machine's load
        if note is not None:
            self.note = note

    def set(self, done: int, note: str | None = None) -> None:
        self.update(done - self.done, note)

    def pause(self) -> Any:
        """A context in which other output may be printed: the bar is cleared first and redrawn after."""
        outer = self

        class _Paused:
            def __enter__(self) -> None:
                with _lock:
                    if outer.tty:
                        outer._clear()
                    _active.append(_Silent)

            def __exit__(self, *exc: Any) -> None:
                with _lock:
                    _active.remove(_Silent)

        return _Paused()

    # ------------------------------------------------------------------------------------------------ text

    def line(self, spent: float, failed: bool = False) -> str:
        """The phase's one line in a log file."""
        counts = f" {self.done}/{self.total} {self.unit}".rstrip() if self.total is not None else \
            (f" {self.done} {self.unit}" if self.done else "")
        note = f", {self.note}" if self.note else ""
        return f"{self.what}:{counts}{' (stopped by an error)' if failed else ''} in {_clock(spent)}{note}"

    def bar(self, spent: float, width: int = 24) -> str:
        """The terminal's line: a bar with the time left when the total is known, else a spinner and the time spent."""
        note = f"  {self.note}" if self.note else ""
        if self.total:
            frac = min(self.done / self.total, 1.0)
            fill = int(frac * width)
            rate = self.done / spent if spent > 0 else 0.0
            left = f"<{_clock((self.total - self.done) / rate)}" if rate > 0 and self.done < self.total else ""
            return (f"{self.what}: {frac:4.0%} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                    f"{self.unit} [{_clock(spent)}{left}]{note}")
        spin = _SPIN[int(spent * 5) % len(_SPIN)]
        done = f" {self.done} {self.unit}" if self.done else ""
        return f"{self.what}: {spin}{done} {_clock(spent)} elapsed{note}"

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            spent = time.perf_counter() - self.started
            with _lock:
                if spent < SHOW_AFTER_S or not _active or _active[-1] is not self:
                    continue
                text = self.bar(spent)
                try:
                    columns = os.get_terminal_size(self.stream.fileno()).columns
                except (OSError, AttributeError, ValueError):
                    columns = 0
                columns = columns if columns > 20 else 120  # a pty may report 0 columns
                self.stream.write("\r" + text[: columns - 1] + "\x1b[K")
                self.stream.flush()
                self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


class _SilentPhase:
    """Top of the stack while output is printed between redraws (nothing draws)."""

    tty = False

    def _clear(self) -> None:
        pass


_Silent: Any = _SilentPhase()


def phase(what: str, enabled: bool = True) -> Progress:
    """A spinner with the time spent for a phase whose amount of work is unknown (the doctor, a conversion)."""
    return Progress(what, enabled=enabled)
