"""Odd inputs end in a named problem, never a hang or a silent change: a stray CSV quote that merges lines, an
unclosed quote (named where it opened), named pipes and devices given as data or config, YAML alias bombs and deep
nesting."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from surefit.config.yaml_files import load_yaml
from surefit.data.readers import read_rows
from surefit.errors import ConfigError


def _read(path: Path, skip: bool = False):
    problems: list = []
    rejects = [] if skip else None
    rows = read_rows(path, problems, rejects=rejects)
    return rows, problems, rejects


def _within(seconds: float, fn):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return in time."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _csv_with_stray_quote(path: Path) -> Path:
    # 47 rows; line 10 opens a quote that only line 14 closes: lines 10-14 would be read as one record of 2 cells.
    lines = ["text,label"] + [f"row number {i},{i % 3}" for i in range(2, 49)]
    lines[9] = '"row number 10,1'
    lines[13] = 'row number 14",2'
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_stray_quote_merging_lines_is_reported_where_it_opened(tmp_path):
    rows, problems, _ = _read(_csv_with_stray_quote(tmp_path / "d.csv"))
    assert len(problems) == 1
    assert problems[0].where == f"{tmp_path / 'd.csv'} line 10"
    assert "a quote opened at line 10 closes only at line 14: lines 10-14 were read as one record" in problems[0].what
    assert "lines 11, 12, 13 look like rows of their own" in problems[0].what


def test_a_stray_quote_under_skip_rejects_the_merged_record_counted(tmp_path):
    rows, problems, rejects = _read(_csv_with_stray_quote(tmp_path / "d.csv"), skip=True)
    assert problems == []
    assert [r.where for r in rejects] == [f"{tmp_path / 'd.csv'} line 10"]
    assert len(rows) == 42 and [r.index for r in rows] == list(range(42))  # 47 lines - the 5 merged ones


def test_multiline_cells_in_a_file_that_has_them_throughout_are_read(tmp_path):
    path = tmp_path / "d.csv"
    body = "".join(f'"paragraph {i}\nsecond line, with a comma",{i % 2}\n' for i in range(30))
    path.write_text("text,label\n" + body, encoding="utf-8")
    rows, problems, _ = _read(path)
    assert problems == [] and len(rows) == 30


def test_an_unclosed_quote_is_reported_at_the_line_it_opened(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text,label\na,1\nb,2\n\"c,3\nd,4\ne,5\n", encoding="utf-8")
    _, problems, _ = _read(path)
    assert problems[0].where == f"{path} line 4"
    assert "the quote that opened at line 4 is never closed (reading stopped at line 6)" in problems[0].what


def test_a_named_pipe_as_data_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    rows, problems, _ = _within(20, lambda: _read(fifo))
    assert rows == [] and f"{fifo} is a named pipe (FIFO), not a regular file" in problems[0].what


def test_dev_zero_behind_a_symlink_is_refused_not_read_whole(tmp_path):
    link = tmp_path / "train.jsonl"
    link.symlink_to("/dev/zero")
    rows, problems, _ = _within(20, lambda: _read(link))
    assert rows == []
    assert f"{link} is a character device (a link to /dev/zero), not a regular file" in problems[0].what


@pytest.mark.parametrize("text,expected", [
    ("lr: " + "[" * 20000 + "]" * 20000, "nested more than 32 levels deep"),
    ("a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)),
     "its aliases expand to more than 100,000 values (an alias bomb?)"),
])
def test_hostile_yaml_is_refused_quickly(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cannot parse .*c\.yaml") as e:
        _within(30, lambda: load_yaml(path))
    assert expected in str(e.value)


def test_a_huge_or_piped_config_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("notes: " + "x" * (2 << 20), encoding="utf-8")
    with pytest.raises(ConfigError, match="is larger than 1024 KiB; a config holds settings"):
        load_yaml(big)
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a named pipe"):
        _within(20, lambda: load_yaml(fifo))
