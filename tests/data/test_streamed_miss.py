"""A miss of the encoded-data store reads a JSONL file in passes (train_sft.stream_data): the store it writes, the
lines it prints and the data it returns are those of reading every row in memory, byte for byte; where it cannot
give that (a problem, a field a whole chunk lacks, another format) it reads in memory; augmentation and notes
counted over the file stream."""

import json

import pytest

from conftest import build_tiny_lm, chat_tokenizer, qa_rows
from surefit.config import SFTConfig
from surefit.data.readers.streamed import RowsOnDisk
from surefit.errors import DataError
from surefit.models import resolve_model
from surefit.tasks.sft import train_sft

STREAM = train_sft.stream_data


def _lines(path, lines):
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _chat_model(tmp_path):
    folder = tmp_path / "chat_lm"
    tok = chat_tokenizer("chatml")
    build_tiny_lm(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _alpaca(n):
    return [{"instruction": f"name the colour number {i}", "input": "" if i % 3 else f"hint {i % 7}",
             "output": f"colour {i % 11}", **({"system": "be brief"} if i % 5 == 0 else {})} for i in range(n)]


def _messages(n):
    return [{"messages": [{"role": "user", "content": f"where is thing {i % 40}?"},
                          {"role": "assistant", "content": f"in box {i % 9}"}], "id": i} for i in range(n)]


def _some_extra(n):
    """Rows of which every 4th from row 21 has an 'extra' field (--template names it) and every 9th from row 54 a
    numeric target (the first in the second chunk): notes counted over the file, their example from a later chunk."""
    rows = qa_rows(n)
    for i, r in enumerate(rows):
        if i % 4 == 1 and i > 20:
            r["extra"] = f"context words {i}"
        if i % 9 == 0 and i > 50:
            r["target"] = i
    return rows


def _run(cfg, cache, monkeypatch, streamed):
    """load_encoded on a fresh cache: the lines said, the result, the store's files (name -> bytes), and whether
    the rows were read in passes."""
    monkeypatch.setenv("SUREFIT_STARTUP_CACHE", str(cache))
    # small chunks and batches: the passes and the encoding cross many chunk boundaries (300 rows)
    monkeypatch.setattr(train_sft, "READ_CHUNK", 37)
    monkeypatch.setattr(train_sft, "STREAM_CHUNK", 16)
    used = []

    def spy(*a, **kw):
        got = STREAM(*a, **kw) if streamed else None
        used.append(got is not None)
        return got

    monkeypatch.setattr(train_sft, "stream_data", spy)
    said: list[str] = []
    data = train_sft.load_encoded(cfg, resolve_model(cfg.model), said.append, [])
    stores = list(cache.glob("encoded/*/*/header.json"))
    assert len(stores) == 1
    files = {p.name: p.read_bytes() for p in stores[0].parent.iterdir()}
    said = [s.replace(str(cache), "CACHE") for s in said]  # the cache folder's line names where it is
    return said, data, files, used


CASES = {
    "flat": (lambda n: qa_rows(n), {}),
    "alpaca with a bad line, skipped": (_alpaca, {"on_bad_rows": "skip", "bad": True}),
    "messages, --limit": (_messages, {"limit": 230}),
    "flat, --val_data overlapping, --limit": (lambda n: qa_rows(n), {"val": True, "limit": 250}),
    "alpaca, --val_data, skip": (_alpaca, {"val": True, "on_bad_rows": "skip"}),
    "messages, val_fraction 0, a system prompt": (_messages, {"val_fraction": 0.0, "system_prompt": "you help",
                                                              "max_steps": 2}),
    # augmented per chunk (37 rows) with one generator carried across: the draws of one call over all rows (120
    # rows, 4 chunks: each variant is encoded too, so 300 rows would cost 2-4 times as long and cross no new border)
    "flat, augmentation x3": (lambda n: qa_rows(n), {"augmentation_factor": 3, "rows": 120}),
    "messages, augmentation x2, --val_data": (_messages, {"augmentation_factor": 2, "val": True, "rows": 120}),
    "alpaca, augmentation x4, skip": (_alpaca, {"augmentation_factor": 4, "on_bad_rows": "skip", "bad": True,
                                                "rows": 120}),
    # notes counted over the file, added up over the chunks
    "flat, --template lacking a field, numeric targets": (_some_extra, {"template": "{extra}\n\n{input}"}),
    "flat, numeric targets, augmentation x2": (_some_extra, {"augmentation_factor": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_streamed_miss_writes_the_in_memory_miss_store_byte_for_byte(tmp_path, tiny_lm_dir, monkeypatch, case):
    make, extra = CASES[case]
    extra = dict(extra)
    rows = extra.pop("rows", 300)
    lines = [json.dumps(r) + "\n" for r in make(rows)]
    if extra.pop("bad", False):
        lines[17] = "{not json\n"
        lines[40] = json.dumps({"instruction": "", "output": "x"}) + "\n"  # rejected by the format's check
    data = _lines(tmp_path / "train.jsonl", lines)
    if extra.pop("val", False):  # rows 3 and 7 of the training file again (and a bad line, skipped)
        bad = [json.dumps({"x": 1}) + "\n"] if extra.get("on_bad_rows") == "skip" else []
        val_lines = [lines[3], *bad, lines[7]] + [json.dumps(r) + "\n" for r in make(rows + 20)[rows:]]
        extra["val_data"] = str(_lines(tmp_path / "val.jsonl", val_lines))
    model = tiny_lm_dir if case == "flat" else _chat_model(tmp_path)
    cfg = SFTConfig(**{"model": str(model), "data": str(data), "max_seq_length": 160, "val_fraction": 0.1,
                       "output_dir": str(tmp_path / "run"), **({"chat_format": "chatml"} if case != "flat" else {}),
                       **extra})
    said_mem, mem, files_mem, used = _run(cfg, tmp_path / "c1", monkeypatch, streamed=False)
    assert used == [False]
    said_str, got, files_str, used = _run(cfg, tmp_path / "c2", monkeypatch, streamed=True)
    assert used == [True], f"the file was not read in passes: {used}"
    assert said_str == said_mem
    assert sorted(files_str) == sorted(files_mem)
    for name in files_mem:
        assert files_str[name] == files_mem[name], name
    assert list(got.features) == list(mem.features) and list(got.lengths) == list(mem.lengths)
    assert [got.where(i) for i in range(len(got.features))] == [mem.where(i) for i in range(len(mem.features))]
    assert [e.row for e in got.val_ex] == [e.row for e in mem.val_ex]
    strip = lambda s: {k: v for k, v in s.to_json().items() if k != "encoded_store"}  # noqa: E731
    assert strip(got.summary) == strip(mem.summary)
    if case == "alpaca with a bad line, skipped":
        assert [r.where for r in got.summary.rejected] == [f"{data} line 18", f"{data} line 41"]
    if case == "alpaca, --val_data, skip":
        assert [r.where for r in got.summary.rejected] == [f"{tmp_path / 'val.jsonl'} line 2"]
    if "overlapping" in case:
        assert any(s.startswith("warning: ") and "validation rows have the same input" in s for s in said_str)
    if "augmentation" in case:
        factor = cfg.augmentation_factor
        assert got.summary.train_rows == factor * sum(1 for i in range(len(got.features)) if "variant" not in got.where(i))
        assert any(s.startswith(f"augmentation x{factor}: ") for s in said_str)
    if "numeric" in case:
        assert any(s.startswith("28 rows had a numeric 'target'; converted to text (e.g. ") and "line 55" in s
                   for s in said_str), said_str
    if "--template" in case:
        assert "--template: 230 of 300 rows have no or an empty 'extra'; its paragraph is left out of their prompt" \
            in said_str
    if case == "messages, --limit":
        assert got.summary.train_rows + got.summary.val_rows == 230
        assert any(s.startswith("--limit 230: using the first 230 rows") for s in said_str)


@pytest.mark.parametrize("why", ["a field a whole chunk lacks", "a problem", "csv"])
def test_what_cannot_stream_is_read_in_memory_with_the_same_result(tmp_path, tiny_lm_dir, monkeypatch, why):
    rows = qa_rows(120)
    extra: dict = {}
    name = "train.jsonl"
    if why == "a field a whole chunk lacks":
        for r in rows[100:]:
            r["extra"] = "context words"
        # over the file a note (rows without 'extra'); in the first chunk of 37 rows a problem (no row has it)
        extra["template"] = "{extra}\n\n{input}"
    elif why == "a problem":
        del rows[5]["target"]  # a problem, reported by the in-memory read
    if why == "csv":
        name = "train.csv"
        text = "input,target\n" + "".join(f"\"{r['input']}\",{r['target']}\n" for r in rows)
        data = _lines(tmp_path / name, [text])
    else:
        data = _lines(tmp_path / name, [json.dumps(r) + "\n" for r in rows])
    cfg = SFTConfig(model=str(tiny_lm_dir), data=str(data), max_seq_length=160, val_fraction=0.1,
                    output_dir=str(tmp_path / "run"), **extra)
    monkeypatch.setattr(train_sft, "READ_CHUNK", 37)  # the chunks of _run
    assert train_sft.stream_data(cfg, lambda s: pytest.fail(f"said {s!r} before falling back"), []) is None
    if why == "a problem":
        with pytest.raises(DataError, match="line 6"):
            train_sft.load_encoded(cfg, resolve_model(cfg.model), lambda s: None, [])
        return
    said_mem, _, files_mem, _ = _run(cfg, tmp_path / "c1", monkeypatch, streamed=False)
    said_str, _, files_str, used = _run(cfg, tmp_path / "c2", monkeypatch, streamed=True)
    assert used == [False] and said_str == said_mem and files_str == files_mem


def test_rows_on_disk_walks_give_the_read_rows_and_report_once(tmp_path):
    data = _lines(tmp_path / "t.jsonl", [json.dumps({"a": i}) + "\n" for i in range(5)] + ["oops\n"] +
                  [json.dumps({"a": 9}) + "\n"])
    rejects: list = []
    disk = RowsOnDisk.open(str(data), rejects, None)
    assert disk is not None and len(disk) == 6 and [r.where for r in rejects] == [f"{data} line 6"]
    assert [r.fields["a"] for r in disk] == [0, 1, 2, 3, 4, 9] and disk[5].index == 5 and disk[1:3][0].fields == {"a": 1}
    assert [len(c) for c in disk.chunks(4)] == [4, 2] and len(rejects) == 1  # later walks report nothing
    assert RowsOnDisk.open(str(data), None, None) is None  # error mode: the bad line is a problem, read in memory
    cut = RowsOnDisk.open(str(data), [], 3)
    assert cut is not None and cut.cut and len(cut) == 3 and len(list(cut)) == 3
    # a JSON document saved as .jsonl is parsed whole: not streamed
    doc = _lines(tmp_path / "d.jsonl", [json.dumps([{"a": 1}, {"a": 2}], indent=1)])
    assert RowsOnDisk.open(str(doc), None, None) is None


def test_a_file_rewritten_between_walks_is_refused_naming_it(tmp_path):
    data = _lines(tmp_path / "t.jsonl", [json.dumps({"a": i}) + "\n" for i in range(5)])
    disk = RowsOnDisk.open(str(data), None, None)
    assert disk is not None
    walk = iter(disk)
    next(walk)
    _lines(data, [json.dumps({"a": i}) + "\n" for i in range(50, 56)])  # rewritten mid-walk: another size
    with pytest.raises(DataError, match="t.jsonl changed while it was read"):
        list(walk)
    with pytest.raises(DataError, match="changed while it was read"):
        list(disk)
