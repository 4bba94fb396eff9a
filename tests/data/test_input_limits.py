"""Input limits that hold for any input: data files are read as streams of capped lines (a file larger than memory,
or one enormous line, is a named problem, not a MemoryError), JSON nested past a depth limit is a row problem, and a
stray CSV quote is caught by the record alone, whatever the file's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from surefit.data.readers import read_rows, read_splits


def _rows(n: int, start: int = 0) -> bytes:
    return b"".join(json.dumps({"input": f"q{i}", "target": f"a{i}"}).encode() + b"\n" for i in range(start, n))


def _sparse(path: Path, head: bytes, size: int, tail: bytes = b"") -> Path:
    """``head``, then a hole of NUL bytes up to ``size`` (no disk used), then ``tail``."""
    with path.open("wb") as fh:
        fh.write(head)
        fh.truncate(size)
        fh.seek(size)
        fh.write(tail)
    return path


def test_a_file_larger_than_memory_is_refused_before_reading_and_limit_reads_its_start(tmp_path):
    # 1 TiB, sparse: 400 real rows (past the 8 KiB sniffed for binary bytes), then a hole. Reading it whole would end in a MemoryError (or the OOM killer).
    path = _sparse(tmp_path / "big.jsonl", _rows(400), 2**40)
    problems: list = []
    assert read_rows(path, problems) == []
    assert len(problems) == 1
    assert f"{path} is 1024.0 GiB, more than the" in problems[0].what
    assert "of memory free: its rows cannot all be held in memory" in problems[0].what
    assert "--limit N reads only the first N rows" in problems[0].fix

    # With --limit the start is streamed and reading stops there; the note says the rest was not read.
    notes: list[str] = []
    problems = []
    splits = read_splits(str(path), None, 5, problems, None, notes)
    assert problems == [] and [r.fields["input"] for r in splits["train"]] == [f"q{i}" for i in range(5)]
    assert notes == [f"--limit 5: using the first 5 rows of {path} (it holds more; the rest is not read)"]


def test_one_enormous_line_is_refused_by_size_in_bounded_memory(tmp_path):
    # Line 301 is 1 GiB with no line break until its end (a hole inside a JSON string); the rows around it are read.
    head = _rows(300) + b'{"input": "'
    path = _sparse(tmp_path / "d.jsonl", head, len(head) + 2**30, b'", "target": "t"}\n' + _rows(302, 300))
    script = textwrap.dedent(f"""
        import resource, sys
        from surefit.data.readers import read_rows
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rejects = []
        rows = read_rows({str(path)!r}, [], rejects=rejects)
        print(len(rows), rejects[0].where, "|", rejects[0].reason, "|", len(rejects[0].raw))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)  # the read's own peak
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    summary, peak_mib = out.stdout.splitlines()
    assert summary == f"302 {path} line 301 | line 301 is 1024.0 MiB; rows over 16 MiB are refused | 2000"
    assert int(peak_mib) < 400  # the read's growth: the line is never held whole (1 GiB), nor the file


def test_an_unclosed_quote_in_a_big_csv_stops_at_the_cell_limit(tmp_path):
    path = tmp_path / "d.csv"
    with path.open("w", encoding="utf-8") as fh:
        fh.write('text,label\nok,1\n"opens here,1\n')
        fh.write("a row that follows,0\n" * 1_000_000)  # 21 MB: the quote would gather all of it into one cell
    problems: list = []
    rows = read_rows(path, problems)
    assert [r.fields["text"] for r in rows] == ["ok"]
    assert problems[0].where == f"{path} line 3"
    assert "a cell that starts in the record at line 3 grows past 16 MiB (a quote that is never closed?)" in \
        problems[0].what


def test_under_an_address_space_limit_a_file_that_does_not_fit_is_refused_not_a_memory_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_rows(3) + b'{"input": "' + b"x" * 2**20 + b'", "target": "t"}\n' + _rows(400_000, 3) * 1)
    size = path.stat().st_size
    script = textwrap.dedent(f"""
        import os, resource
        from surefit.data.readers import read_rows
        used = int(open(f"/proc/{{os.getpid()}}/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + {size // 2}, resource.RLIM_INFINITY))  # half the file free
        problems = []
        read_rows({str(path)!r}, problems)
        print(problems[0].what)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "of memory free: its rows cannot all be held in memory" in out.stdout


def test_json_nested_past_the_data_depth_limit_is_a_row_problem_in_every_form(tmp_path):
    deep = {"input": "q", "target": "t", "meta": json.loads("[" * 70 + "]" * 70)}
    ok = {"input": "q", "target": "t", "meta": json.loads("[" * 50 + "]" * 50)}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ok) + "\n" + json.dumps(deep) + "\n", encoding="utf-8")
    rejects: list = []
    rows = read_rows(path, [], rejects=rejects)
    assert len(rows) == 1 and rejects[0].where == f"{path} line 2"
    assert rejects[0].reason == "not valid JSON: nested more than 64 levels deep"
    doc = tmp_path / "d.json"
    doc.write_text(json.dumps([ok, deep]), encoding="utf-8")
    problems: list = []
    assert read_rows(doc, problems) == []
    assert problems[0].what == f"cannot read {doc} as JSON: nested more than 66 levels deep"


def _csv(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_stray_quotes_are_caught_in_a_small_file_with_many_merges(tmp_path):
    # 48 lines, 3 stray quotes, two merges (one of two lines): the old share threshold (at most 5% of 20 or more
    # records) let this through as 42 rows and exit 0.
    lines = ["text,label"] + [f"row {i},{i % 2}" for i in range(2, 49)]
    lines[4] = '"row 5,1'  # opens
    lines[6] = 'row 7",1'  # closes: lines 5-7 merge
    lines[19] = '"row 20,0'  # opens, closed by the next line's quote at the end of its cell
    lines[20] = 'row 21 5",1'
    path = _csv(tmp_path / "d.csv", lines)
    problems: list = []
    read_rows(path, problems)
    assert [p.where for p in problems] == [f"{path} line 5", f"{path} line 20"]
    assert "lines 5-7 were read as one record, though line 6 looks like a row of its own" in problems[0].what
    assert "lines 20-21 were read as one record, though lines 20, 21 look like rows of their own" in problems[1].what
    rejects: list = []
    rows = read_rows(path, [], rejects=rejects)
    assert len(rows) == 42 and [r.where for r in rejects] == [f"{path} line 5", f"{path} line 20"]

    # A file of a header and five rows: no threshold of size.
    small = _csv(tmp_path / "s.csv", ["text,label", "a,0", '"b,1', 'c,0', 'd",1', "e,0", "f,1"])
    problems = []
    read_rows(small, problems)
    assert [p.where for p in problems] == [f"{small} line 3"]


def test_cells_that_really_span_lines_are_read_in_a_file_of_any_size(tmp_path):
    # A two-column file whose text cell spans lines, its first line holding a comma: the cells before and after a
    # break do not fit the label column, so it is a cell, not merged rows.
    lines = ["text,label", "plain,0", "more,1", '"a paragraph, then more', 'on a second line",1', "again,0", "last,1"]
    problems: list = []
    rows = read_rows(_csv(tmp_path / "one.csv", lines), problems)
    assert problems == [] and rows[2].fields == {"text": "a paragraph, then more\non a second line", "label": "1"}
    # Three columns, a cell of three lines: the lines inside hold other cell counts.
    poem = _csv(tmp_path / "poem.csv", ["id,text,label", '1,"roses are red,', "violets are blue,", 'sugar is sweet",x'])
    problems = []
    rows = read_rows(poem, problems)
    assert problems == [] and rows[0].fields["text"] == "roses are red,\nviolets are blue,\nsugar is sweet"
