"""What the three tasks share to use a finished run (``eval``, ``predict``, ``export``): the loaded model, rows
from ``--input`` texts, batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from surefit.data.rows import Row
from surefit.errors import ConfigError, Problem, raise_if


@dataclass
class Loaded:
    """A finished run's model, ready for inference, with what its task needs to encode inputs."""

    model: Any
    tokenizer: Any
    accelerator: Any
    extra: dict[str, Any] = field(default_factory=dict)


def rows_from_texts(inputs: str | list[str] | None, text_fields: list[tuple[str, str]]) -> list[Row]:
    """Rows for ``surefit predict --input TEXT ...``; every empty input is reported at once."""
    texts = [inputs] if isinstance(inputs, str) else list(inputs or [])
    problems = []
    if len(text_fields) > 1:
        problems.append(Problem(f"the run classifies text pairs ('{text_fields[0][0]}' + '{text_fields[1][0]}'); "
                                "--input gives one text", "--input", "give rows holding both fields with --file"))
    rows = []
    for i, text in enumerate(texts):
        where = "--input" if len(texts) == 1 else f"--input #{i + 1}"
        if not isinstance(text, str) or not text.strip():
            problems.append(Problem(f"empty input ({text!r})", where, "give the text to predict on"))
        rows.append(Row({text_fields[0][0]: text}, where, i))
    if not texts:
        problems.append(Problem("no input given", "--input", "give the text to predict on"))
    raise_if(problems, ConfigError)
    return rows


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
