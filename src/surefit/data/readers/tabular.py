"""Parquet files and folders written by ``datasets.save_to_disk``."""

from __future__ import annotations

from pathlib import Path

from surefit.data.rows import Row
from surefit.errors import Problem

# --- Parquet and datasets folders ---------------------------------------------------------------------------------


def read_parquet(source: str, problems: list[Problem]) -> list[Row] | None:
    import pyarrow.parquet as pq  # deferred: pyarrow is only needed for this format

    try:
        records = pq.read_table(source).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several unrelated types for a damaged file
        problems.append(
            Problem(
                f"cannot read {source} as Parquet: {e}", fix="check the file is a complete Parquet file (re-export it)"
            )
        )
        return []  # the problem says why; read_rows returns a list either way
    return [Row(fields=r, where=f"{source} row {i}", index=i - 1) for i, r in enumerate(records, 1)]


def read_dataset_folder(source: str, problems: list[Problem]) -> list[Row]:
    import datasets  # deferred: importing datasets costs about a second

    try:
        ds = datasets.load_from_disk(source)
    except Exception as e:  # noqa: BLE001 - load_from_disk surfaces arrow, json and file errors alike
        problems.append(
            Problem(
                f"cannot load the saved `datasets` folder {source}: {e}",
                fix="re-save it with Dataset.save_to_disk, or export it to JSONL/Parquet",
            )
        )
        return []  # the problem says why; read_rows returns a list either way
    if isinstance(ds, datasets.DatasetDict):
        problems.append(
            Problem(
                f"{source} holds several splits ({', '.join(ds)}); say which one to read",
                fix=f"point --data at one split, e.g. {Path(source) / next(iter(ds), 'train')}",
            )
        )
        return []  # the problem says why; read_rows returns a list either way
    return [Row(fields=r, where=f"{source} row {i}", index=i - 1) for i, r in enumerate(ds.to_list(), 1)]
