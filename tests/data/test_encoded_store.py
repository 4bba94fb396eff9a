"""The encoded-data cache (data/encoded_store.py): encode once, read by position in every later run; keyed by content;
a damaged store is rebuilt; parallel encoding is the serial encoding byte for byte; a run killed mid-epoch and resumed
from the store ends with the weights of an uninterrupted run that never used one."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import build_tiny_lm, chat_tokenizer, qa_rows
from surefit.cli import main
from surefit.config import SFTConfig
from surefit.data import encoded_store
from surefit.data.encoded_store import EncodedSplit, StoreWriter
from surefit.data.summary import TextFacts
from surefit.models import resolve_model
from surefit.tasks.sft import train_sft
from surefit.tasks.sft.train_sft import Encoder, load_encoded

CRASH = Path(__file__).parents[1] / "training" / "crash_run.py"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture()
def counted(monkeypatch):
    """Counts the rows handed to the encoder (in this process: one worker below 2 chunks)."""
    calls = {"rows": 0}
    original = Encoder.encode_raw

    def encode_raw(self, rows, split):
        calls["rows"] += len(rows)
        return original(self, rows, split)

    monkeypatch.setattr(Encoder, "encode_raw", encode_raw)
    return calls


def _load(cfg, said=None):
    out = [] if said is None else said
    return load_encoded(cfg, resolve_model(cfg.model), out.append, [])


def _cfg(tmp_path, model, data, **kw):
    return SFTConfig(**{"model": str(model), "data": str(data), "max_seq_length": 128, "val_fraction": 0.2,
                        "output_dir": str(tmp_path / "run"), **kw})


def test_a_second_run_reads_the_store_and_encodes_nothing(tmp_path, tiny_lm_dir, counted):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    cfg = _cfg(tmp_path, tiny_lm_dir, data)
    said_first: list[str] = []
    first = _load(cfg, said_first)
    assert counted["rows"] == 40 and first.store.status == "miss"
    assert isinstance(first.features, EncodedSplit)  # the loop reads the store, written or found

    counted["rows"] = 0
    said: list[str] = []
    second = _load(cfg, said)
    assert counted["rows"] == 0, "a cache hit encoded rows"
    assert second.store.status == "hit" and second.summary.facts_as(TextFacts).encoded_store["status"] == "hit"
    assert any(line.startswith("encoded data: 32 training examples read from the cache") for line in said)
    # Every line of the encoding run is said again (the counts, the split, the format), the cache's own line aside.
    assert sorted(x for x in said_first if not x.startswith("encoded data")) == \
        sorted(x for x in said if not x.startswith("encoded data"))

    # The same examples, lengths, counts, locations and validation set as encoding in memory (--no_cache).
    plain = _load(_cfg(tmp_path, tiny_lm_dir, data, no_cache=True))
    assert plain.store.status == "off" and isinstance(plain.features, list)
    assert list(second.features) == plain.features
    assert list(second.lengths) == plain.lengths and list(second.counts) == plain.counts
    assert [second.where(i) for i in range(32)] == [plain.where(i) for i in range(32)]
    assert [(e.input_ids, e.labels, e.prompt_len, e.row) for e in second.val_ex] == \
        [(e.input_ids, e.labels, e.prompt_len, e.row) for e in plain.val_ex]
    strip = lambda s: {k: v for k, v in s.to_json().items() if k != "encoded_store"}  # noqa: E731
    assert strip(second.summary) == strip(plain.summary)
    assert second.summary.encoding["train"]["encoded"] == 32 and second.summary.encoding["validation"]["rows"] == 8
    assert second.longest_target == plain.longest_target


def test_changed_content_with_the_same_size_and_mtime_is_encoded_again(tmp_path, tiny_lm_dir, counted):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    cfg = _cfg(tmp_path, tiny_lm_dir, data)
    before = _load(cfg)
    st = data.stat()
    text = data.read_text(encoding="utf-8")
    changed = text.replace("the cat", "the dog", 1)  # same length, other content
    assert changed != text and len(changed) == len(text)
    data.write_text(changed, encoding="utf-8")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    counted["rows"] = 0
    after = _load(cfg)
    assert counted["rows"] == 40 and after.store.status == "miss"
    assert after.store.folder != before.store.folder
    assert list(after.features) != list(before.features)


def test_a_changed_encoding_setting_is_another_key_and_a_training_setting_is_not(tmp_path, tiny_lm_dir, counted):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    _load(_cfg(tmp_path, tiny_lm_dir, data))
    counted["rows"] = 0
    assert _load(_cfg(tmp_path, tiny_lm_dir, data, lr=0.5, batch_size=2)).store.status == "hit"
    assert counted["rows"] == 0
    assert _load(_cfg(tmp_path, tiny_lm_dir, data, max_seq_length=256)).store.status == "miss"
    assert _load(_cfg(tmp_path, tiny_lm_dir, data, seed=3)).store.status == "miss"  # another split


def test_a_damaged_store_is_rebuilt_with_a_note(tmp_path, tiny_lm_dir, counted):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    cfg = _cfg(tmp_path, tiny_lm_dir, data)
    first = _load(cfg)
    examples = list(first.features)
    ids = Path(first.store.folder) / "train.input_ids"
    raw = bytearray(ids.read_bytes())
    raw[5] ^= 0xFF
    ids.write_bytes(bytes(raw))
    counted["rows"] = 0
    said: list[str] = []
    again = _load(cfg, said)
    assert any("is damaged (train.input_ids does not match its checksum)" in x for x in said), said
    assert counted["rows"] == 40 and again.store.status == "rebuilt"
    assert list(again.features) == examples
    # A store cut short (a partial copy) is not trusted either.
    with (Path(again.store.folder) / "train.labels").open("r+b") as fh:
        fh.truncate(8)
    said.clear()
    third = _load(cfg, said)
    assert any("train.labels holds 8 bytes, the header says" in x for x in said)
    assert list(third.features) == examples


def test_no_cache_reads_and_writes_no_store(tmp_path, tiny_lm_dir, counted):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    got = _load(_cfg(tmp_path, tiny_lm_dir, data, no_cache=True))
    assert got.summary.facts_as(TextFacts).encoded_store == {"status": "off", "folder": None, "why": "--no_cache"}
    assert not encoded_store.store_root().exists()


def _chat_model(tmp_path):
    folder = tmp_path / "chat_lm"
    tok = chat_tokenizer("chatml")
    build_tiny_lm(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _conversations(n):
    words = "the cat sat on mat dog ran to park bird flew over tree Paris France city".split()
    return [{"messages": [{"role": "user", "content": f"where is the {words[i % 16]} {i}?"},
                          {"role": "assistant", "content": f"in the {words[(i * 3) % 16]}"},
                          {"role": "user", "content": "and then?"},
                          {"role": "assistant", "content": f"to {words[(i * 5) % 16]} " * (1 + i % 4)}]}
            for i in range(n)]


@pytest.mark.parametrize("kind", ["flat", "conversations"])
def test_encoding_on_several_processes_is_the_serial_encoding_byte_for_byte(tmp_path, tiny_lm_dir, kind):
    if kind == "flat":
        model, rows, extra = tiny_lm_dir, qa_rows(60), {}
    else:
        model, rows, extra = _chat_model(tmp_path), _conversations(60), {"chat_format": "chatml"}
    data = _write(tmp_path / "train.jsonl", rows)
    cfg = _cfg(tmp_path, model, data, no_cache=True, **extra)
    plain = _load(cfg)  # reads the rows, builds the encoder
    train_rows, _, summary = train_sft.load_data(cfg, lambda s: None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    folders, reports = [], []
    for workers, chunk in ((1, 10**9), (2, 7)):
        enc = Encoder.build(cfg, tok, str(summary.format), bool(summary.format_conversational))
        writer = StoreWriter(tmp_path / f"store{workers}", {"k": 1})
        rep = enc.encode_into(train_rows, "train", False, lambda a, w=writer: w.add("train", a), workers, chunk=chunk)
        folders.append(writer.commit(None))
        reports.append((rep.__dict__, sorted(enc.terminators)))
    assert reports[0] == reports[1]
    names = sorted(p.name for p in folders[0].iterdir() if p.name != "header.json")
    assert names == sorted(p.name for p in folders[1].iterdir() if p.name != "header.json")
    for name in names:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
    split = EncodedSplit(folders[1], "train", len(plain.features))
    assert list(split) == plain.features
    assert np.array_equal(np.asarray(list(split.lengths)), np.asarray(plain.lengths))


def _crash(args, out, env_cache):
    env = {**os.environ, "SUREFIT_STARTUP_CACHE": env_cache,
           "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(CRASH), "mid-epoch", "--", *args, "--output_dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)


def test_a_run_killed_mid_epoch_and_resumed_from_the_store_ends_with_the_in_memory_runs_weights(
        tmp_path, tiny_lm_dir, capsys):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    args = ["--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "4", "--lora_r", "8",
            "--lr", "1e-2", "--val_fraction", "0.2", "--max_seq_length", "128", "--save_every", "3",
            "--lora_dropout", "0.1", "--eval_generate", "false"]
    # The reference never touches a store: examples encoded in memory, uninterrupted.
    assert main(["train", *args, "--no_cache", "--output_dir", str(tmp_path / "reference")]) == 0
    reference = load_file(tmp_path / "reference" / "final" / "adapter_model.safetensors")
    assert not encoded_store.store_root().exists()

    out = tmp_path / "killed"
    proc = _crash(args, out, os.environ["SUREFIT_STARTUP_CACHE"])  # writes the store, then dies in step 5
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "training examples encoded and written to the cache" in proc.stdout
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "training examples read from the cache" in said and "resumed from" in said
    report = json.loads((out / "data_report.json").read_text())
    assert report["encoded_store"]["status"] == "hit"
    got = load_file(out / "final" / "adapter_model.safetensors")
    assert got.keys() == reference.keys()
    worst = max(float((got[k] - reference[k]).abs().max()) for k in got)
    assert worst <= 1e-6, worst


def test_inspect_reads_a_training_runs_store_instead_of_encoding_again(tmp_path, tiny_lm_dir, counted):
    from surefit.tasks.sft.use_sft import inspect

    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    _load(_cfg(tmp_path, tiny_lm_dir, data))  # a training run's encoding: 32 train + 8 validation rows
    counted["rows"] = 0
    said: list[str] = []
    got = inspect(_cfg(tmp_path, tiny_lm_dir, data), out=str(tmp_path / "hit.jsonl"), show=1, color=False,
                  say=said.append)
    assert counted["rows"] == 0 and any(x.startswith("encoded data: read from the cache") for x in said)
    plain = inspect(_cfg(tmp_path, tiny_lm_dir, data, no_cache=True), out=str(tmp_path / "plain.jsonl"), show=1,
                    color=False, say=lambda _: None)
    assert counted["rows"] == 40  # --no_cache encodes
    assert got == plain and got["rows"] == 40
    lines = lambda p: sorted((tmp_path / p).read_text(encoding="utf-8").splitlines())  # noqa: E731
    assert lines("hit.jsonl") == lines("plain.jsonl")


def test_a_cache_folder_that_cannot_be_written_encodes_in_memory_and_says_why(tmp_path, tiny_lm_dir, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")  # a real file where the cache's folder would be: mkdir fails with ENOTDIR
    monkeypatch.setenv("SUREFIT_STARTUP_CACHE", str(blocker))
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    said: list[str] = []
    got = _load(_cfg(tmp_path, tiny_lm_dir, data), said)
    assert got.store.status == "not cacheable" and "the cache cannot be written" in got.store.why
    assert isinstance(got.features, list) and len(got.features) == 32
    assert any(x.startswith("encoded data: in memory, not cached (the cache cannot be written") for x in said)
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("longest_target", "12", "'longest_target' is '12' (str); expected int"),
    ("terminators", [2, "x"], "expected a list of int"),
    ("validation_rows", [{"where": "a line 1"}], "'validation_rows[0]' is {'where': 'a line 1'} (dict); expected an "
                                                 "object with 'fields' (dict)"),
    ("version", 7, "'record' is version 7; this surefit reads version 1"),
])
def test_a_tampered_record_in_the_header_is_refused_naming_the_file_and_key(tmp_path, tiny_lm_dir, capsys, key,
                                                                            value, expected):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    first = _load(_cfg(tmp_path, tiny_lm_dir, data))
    header = Path(first.store.folder) / "header.json"
    saved = json.loads(header.read_text(encoding="utf-8"))
    saved["record"][key] = value  # the header's own bytes are no part of the checksums: the record checks itself
    header.write_text(json.dumps(saved), encoding="utf-8")
    capsys.readouterr()
    code = main(["inspect", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--val_fraction", "0.2",
                 "--max_seq_length", "128", "--out", str(tmp_path / "x.jsonl")])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and "Traceback" not in text
    assert expected in text and f"{header}" in text and f"'record' '{key}" in text, text
    assert "delete that folder" in text and not (tmp_path / "x.jsonl").exists()


def test_the_typed_record_reads_back_what_it_wrote(tmp_path, tiny_lm_dir):
    data = _write(tmp_path / "train.jsonl", qa_rows(40))
    first = _load(_cfg(tmp_path, tiny_lm_dir, data))
    header = Path(first.store.folder) / "header.json"
    saved = json.loads(header.read_text(encoding="utf-8"))["record"]
    rec = encoded_store.StoreRecord.from_json(saved, str(header))
    assert rec.to_json() == saved
    assert rec.longest_target == first.longest_target and len(rec.validation_rows) == 8
    assert rec.validation_rows == [e.row for e in first.val_ex]
