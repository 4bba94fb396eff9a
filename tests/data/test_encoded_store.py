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
from surefit.data.encoded_store import EncodedSplit, EncodedStore, StoreWriter
from surefit.data.summary import TextFacts
from surefit.errors import DataError
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
    folder = Path(first.store.folder)
    assert (folder / encoded_store.CHUNK_CHECKS).is_file()  # the first open checked every byte and saved the chunks'
    ids = folder / "train.input_ids"
    raw = bytearray(ids.read_bytes())
    raw[5] ^= 0xFF
    ids.write_bytes(bytes(raw))
    # Opening checks the header and sizes only; the damaged chunk is found by the first read that touches it.
    counted["rows"] = 0
    hit = _load(cfg)
    assert hit.store.status == "hit" and counted["rows"] == 0
    with pytest.raises(DataError) as e:
        hit.features[0]
    assert "train.input_ids bytes 0-" in str(e.value) and "do not match their checksum" in str(e.value)
    assert "run the same command again" in str(e.value)
    said: list[str] = []
    again = _load(cfg, said)  # the mark the reader left: removed with a note and encoded anew
    assert any("is damaged (a run reading it found train.input_ids bytes 0-" in x for x in said), said
    assert counted["rows"] == 40 and again.store.status == "rebuilt"
    assert list(again.features) == examples
    # Without the saved chunk checks (or with damaged ones) every file is checked whole at open, as at the first.
    folder = Path(again.store.folder)
    (folder / encoded_store.CHUNK_CHECKS).write_text("{not json")
    raw = bytearray((folder / "train.labels").read_bytes())
    raw[-1] ^= 0x01
    (folder / "train.labels").write_bytes(bytes(raw))
    said.clear()
    third = _load(cfg, said)
    assert any("is damaged (train.labels does not match its checksum)" in x for x in said), said
    assert third.store.status == "rebuilt" and list(third.features) == examples
    # A store cut short (a partial copy) is not trusted either.
    with (Path(third.store.folder) / "train.labels").open("r+b") as fh:
        fh.truncate(8)
    said.clear()
    fourth = _load(cfg, said)
    assert any("train.labels holds 8 bytes, the header says" in x for x in said)
    assert list(fourth.features) == examples


def test_each_chunk_is_checked_when_first_read_and_a_damaged_one_is_never_returned(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(40, 60, size=3000)
    ids = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
    writer = StoreWriter(tmp_path / "store", {"k": 1})
    writer.add("train", encoded_store.SplitArrays(ids, ids.copy(), lengths, np.ones(3000, np.int32),
                                                  (lengths - 1).astype(np.int32), np.arange(3000),
                                                  [f"line {i}" for i in range(3000)]))
    folder = writer.commit({})
    store = EncodedStore.open(folder, {"k": 1})
    assert store is not None and (folder / encoded_store.CHUNK_CHECKS).is_file()
    split = store.split("train")
    offsets = np.fromfile(folder / "train.offsets", dtype="<i8")
    chunk = encoded_store.CHECK_BYTES
    # Damage one byte in the third 64 KiB chunk of the labels: the examples there are refused, the others read.
    with (folder / "train.labels").open("r+b") as fh:
        fh.seek(2 * chunk + 100)
        byte = fh.read(1)
        fh.seek(2 * chunk + 100)
        fh.write(bytes([byte[0] ^ 0x10]))
    bad = int(np.searchsorted(offsets, (2 * chunk + 100) // 4, side="right")) - 1
    far = 2999
    assert offsets[far] * 4 > 3 * chunk  # in another chunk
    reopened = EncodedStore.open(folder, {"k": 1})  # sizes unchanged: opens without reading the data
    assert reopened is not None
    split = reopened.split("train")
    assert split[far]["labels"] == ids[offsets[far] : offsets[far + 1]].tolist()
    with pytest.raises(DataError, match=rf"train.labels bytes {2 * chunk}-{3 * chunk - 1} do not match"):
        split[bad]
    with pytest.raises(DataError):  # still refused on a second try: a chunk is marked checked only when it matches
        split[bad]
    assert (folder / encoded_store.DAMAGED).is_file()
    said: list[str] = []
    assert EncodedStore.open(folder, {"k": 1}, said.append) is None and not folder.exists()
    assert "found train.labels bytes" in said[0]


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


def test_cache_dir_holds_the_store_and_beats_the_environment(tmp_path, tiny_lm_dir, capsys):
    data = _write(tmp_path / "train.jsonl", qa_rows(24))
    cache = tmp_path / "my cache"
    args = ["--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4", "--lora_r", "4",
            "--val_fraction", "0.25", "--max_seq_length", "96", "--eval_generate", "false", "--cache_dir", str(cache)]
    assert main(["train", *args, "--output_dir", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    stores = list((cache / "startup" / "encoded").glob("*/*/header.json"))
    assert len(stores) == 1 and f"written to the cache {stores[0].parent}" in said
    assert not encoded_store.store_root().exists()  # $SUREFIT_STARTUP_CACHE (set for every test) is not used
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["encoded_store"]["folder"] == str(stores[0].parent)
    # inspect with the same flag reads that store instead of encoding again
    assert main(["inspect", "--task", "sft", *args, "--output_dir", str(tmp_path / "unused"),
                 "--out", str(tmp_path / "inspect.jsonl")]) == 0, capsys.readouterr().err
    assert f"encoded data: read from the cache {stores[0].parent}" in capsys.readouterr().out


def test_cache_dir_at_an_input_or_in_the_runs_records_is_refused_before_anything_is_written(
        tmp_path, tiny_lm_dir, capsys):
    data_dir = tmp_path / "c" / "startup"  # where --cache_dir c would keep its start-up entries
    data_dir.mkdir(parents=True)
    data = _write(data_dir / "train.jsonl", qa_rows(24))
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--output_dir", str(out)]
    model_files = sorted(p.name for p in tiny_lm_dir.iterdir())
    cases = {str(tiny_lm_dir): f"--cache_dir {tiny_lm_dir} is --model",
             str(tiny_lm_dir / "cache"): "is inside --model",
             str(tmp_path / "c"): f"--cache_dir {data_dir} holds --data",
             str(out / "checkpoints" / "cache"): "the run's checkpoints",
             str(out / "final"): "the run's final"}
    link = tmp_path / "link"
    link.symlink_to(tiny_lm_dir)  # a path that resolves to the base model's folder
    cases[str(link / "cache")] = f"(it resolves to {tiny_lm_dir.resolve() / 'cache'}) is inside --model"
    for cache, expected in cases.items():
        capsys.readouterr()
        assert main([*args, "--cache_dir", cache]) == 2, cache
        err = capsys.readouterr().err
        assert expected in err and "pass another path for --cache_dir" in err, err
    assert main([*args, "--cache_dir", str(data)]) == 2  # a file: not a folder
    assert f"--cache_dir {data} is not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_lm_dir.iterdir()) == model_files
    assert sorted(p.name for p in data_dir.iterdir()) == ["train.jsonl"] and not out.exists()


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
