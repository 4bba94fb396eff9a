"""Which evaluation ``final/`` holds: the best by one metric (``--keep_best``), and when to stop because the metric
has stopped improving (``--early_stopping``). The loop judges each evaluation; checkpoints carry the state."""

from __future__ import annotations

from typing import Any

from surefit.errors import Problem


class Selection:
    """The best evaluation so far by one metric, and how many evaluations in a row have not beaten it (the
    early-stopping count). Checkpoints carry its state, so a resumed run continues the count.

    The evaluation before training (epoch 0) only checks that the metric exists: no checkpoint holds that state.
    """

    def __init__(self, keep_best: str | None, early_stopping: str | None) -> None:
        from surefit.config.checks import parse_metric_goal

        self.goal = None
        if early_stopping:
            self.goal = parse_metric_goal(early_stopping, "--early_stopping", with_patience=True)[0]
        elif keep_best:
            self.goal = parse_metric_goal(keep_best, "--keep_best", with_patience=False)[0]
        self.best: dict[str, Any] | None = None
        self.bad = 0

    @property
    def patience(self) -> int:
        return self.goal.patience if self.goal is not None else 0

    def describe(self) -> str:
        """What final/ will hold, said once before training."""
        if self.goal is None:
            return ("final/: the last state (training runs every epoch; --keep_best METRIC or --early_stopping "
                    "METRIC:PATIENCE select the best evaluation instead)")
        better = "lower" if self.goal.mode == "min" else "higher"
        text = f"final/: the best evaluation by {self.goal.metric} ({better} is better), its checkpoint kept"
        if self.patience:
            text += f"; training stops after {self.patience} evaluations in a row without improvement"
        return text

    def value(self, record: dict[str, Any]) -> float:
        """The goal's metric in an evaluation record; a metric the task does not report is a configuration error."""
        from surefit.errors import ConfigError

        assert self.goal is not None
        value = record.get(self.goal.metric)
        if isinstance(value, bool) or not isinstance(value, int | float):
            found = sorted(k for k, v in record.items() if k.startswith("eval_") and isinstance(v, int | float)
                           and k != "eval_seconds")
            flag = "--early_stopping" if self.patience else "--keep_best"
            raise ConfigError(Problem(f"the evaluation reports no number named {self.goal.metric!r}", flag,
                                      f"use one of: {', '.join(found) or 'none (no evaluation metric)'}"))
        return float(value)

    def judge(self, record: dict[str, Any], checkpoint: str) -> None:
        """Count an evaluation (saved as ``checkpoint``) and write the best so far into its record."""
        assert self.goal is not None
        value = self.value(record)
        best = self.best
        if best is None or (value < best["value"] if self.goal.mode == "min" else value > best["value"]):
            best = self.best = {"metric": self.goal.metric, "value": value, "step": record.get("step", 0),
                         "epoch": record.get("epoch"), "checkpoint": checkpoint}
            self.bad = 0
        else:
            self.bad += 1
        record.update(best_metric=self.goal.metric, best_value=best["value"], best_step=best["step"],
                      best_checkpoint=best["checkpoint"])

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.bad >= self.patience

    def stopped_at(self, step: int) -> str:
        """The line saying why training stopped early."""
        best = self.best or {}
        return (f"early stopping at step {step}: {best.get('metric')} has not improved for {self.bad} evaluations in a "
                f"row (best {best.get('value', float('nan')):.4f} at step {best.get('step')})")

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "bad": self.bad}

    def load(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.best, self.bad = state.get("best"), int(state.get("bad", 0))
