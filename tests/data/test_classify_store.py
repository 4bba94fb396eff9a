"""Classify on the encoded-data cache (tasks/classify/classify_store.py): a second run reads its examples by position
and encodes nothing, says what the encoding run said, and trains, evaluates and is checked by the doctor exactly as a
run that encodes in memory (--no_cache); the key is the data's content and every encoding setting; a run killed
mid-epoch and resumed from the store ends with the weights of an uninterrupted run that never used one."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import sentiment_rows, write_tsv
from surefit.cli import main
from surefit.config.task_configs import ClassifyConfig
from surefit.data import encoded_store
from surefit.data.summary import ClassifyFacts
from surefit.errors import DataError
from surefit.run_folder import COLUMNS
from surefit.tasks.classify import train_classify
from surefit.tasks.classify.classify_store import StoredExamples
from surefit.tasks.runner import doctor

CRASH = Path(__file__).parents[1] / "training" / "crash_run.py"


@pytest.fixture()
def counted(monkeypatch):
    """Counts the rows handed to the tokenizer (in this process: one worker below 2 chunks)."""
    calls = {"rows": 0}
    original = train_classify.tokenize

    def tokenize(rows, *a, **k):
        calls["rows"] += len(rows)
        return original(rows, *a, **k)

    monkeypatch.setattr(train_classify, "tokenize", tokenize)
    return calls


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _data(tmp_path, kind):
    """40 rows of one kind of labels (and what to pass for them)."""
    rows = sentiment_rows(40)
    if kind == "pairs":
        # Text pairs (token_type_ids 0 and 1), a long text cut to --max_seq_length, a row without a label skipped.
        out = [{"sentence1": r["sentence"], "sentence2": f"the plot {i}" if i % 2 else "the story was dull",
                "label": r["label"], "idx": i} for i, r in enumerate(rows)]
        out[3]["sentence1"] = " ".join(["the movie was very good"] * 6)
        out[7]["label"] = None
        return _jsonl(tmp_path / "pairs.jsonl", out), {"on_bad_rows": "skip", "max_seq_length": 16}
    if kind == "multi":
        out = [{"text": r["sentence"], "label": [r["label"], "x"] if i % 3 else [r["label"]]} for i, r in enumerate(rows)]
        return _jsonl(tmp_path / "multi.jsonl", out), {}
    out = [{"text": r["sentence"], "score": (0.9 if r["label"] == "pos" else 0.15) + i / 997} for i, r in enumerate(rows)]
    return _jsonl(tmp_path / "reg.jsonl", out), {"label_field": "score"}


def _cfg(tmp_path, model, data, **kw):
    return ClassifyConfig(**{"model": str(model), "data": str(data), "val_fraction": 0.25, "batch_size": 4,
                             "output_dir": str(tmp_path / "run"), **kw})


def _prepare(cfg, said=None):
    torch.manual_seed(0)  # the new head's initialisation: the same model for every run compared
    return train_classify.prepare(cfg, (said if said is not None else []).append)


def _status(p):
    return p.found.data_report.facts_as(ClassifyFacts).encoded_store["status"]


@pytest.mark.parametrize("kind", ["pairs", "multi", "regression"])
def test_a_second_run_reads_the_store_encodes_nothing_and_prepares_what_encoding_in_memory_does(
        tmp_path, tiny_bert_dir, counted, kind):
    data, extra = _data(tmp_path, kind)
    cfg = _cfg(tmp_path, tiny_bert_dir, data, **extra)
    said_first: list[str] = []
    first = _prepare(cfg, said_first)
    rows = 39 if kind == "pairs" else 40
    assert counted["rows"] == rows and _status(first) == "miss"
    assert isinstance(first.work.features, StoredExamples)  # the loop reads the store, written or found

    counted["rows"] = 0
    said: list[str] = []
    hit = _prepare(cfg, said)
    assert counted["rows"] == 0, "a cache hit tokenized rows"
    assert _status(hit) == "hit"
    n = len(hit.work.features)
    assert any(x.startswith(f"encoded data: {n} training examples read from the cache") for x in said)
    # Every line of the encoding run is said again, in the same order (the labels, the split, the truncations).
    assert [x for x in said_first if not x.startswith("encoded data")] == \
        [x for x in said if not x.startswith("encoded data")]
    if kind == "pairs":
        assert any("1 of" in x and "truncated to 16 tokens" in x for x in said)
        assert any("token_type_ids" in x for x in said)

    plain = _prepare(_cfg(tmp_path, tiny_bert_dir, data, no_cache=True, **extra))
    assert _status(plain) == "off" and isinstance(plain.work.features, list)
    assert list(hit.work.features) == plain.work.features
    if kind == "pairs":
        assert {1} <= {t for f in plain.work.features for t in f["token_type_ids"]}
    assert list(hit.work.lengths) == list(plain.work.lengths) and list(hit.work.counts) == list(plain.work.counts)
    assert [hit.work.where(i) for i in range(n)] == [plain.work.where(i) for i in range(n)]
    strip = lambda s: {k: v for k, v in s.to_json().items() if k != "encoded_store"}  # noqa: E731
    assert strip(hit.found.data_report) == strip(plain.found.data_report)
    assert hit.found.data_report.rejected == plain.found.data_report.rejected
    assert hit.found.files[COLUMNS] == plain.found.files[COLUMNS]
    keys = hit.cache_key(), plain.cache_key()
    assert keys[0]["labels"] == keys[1]["labels"] and keys[0]["validation"] == keys[1]["validation"]
    assert keys[0]["train"].startswith("store:")
    # The evaluation scores the same rows with the same labels: the same metrics and records.
    a, b = hit.work.evaluate(hit.model, 0, 8), plain.work.evaluate(plain.model, 0, 8)
    assert a.records == b.records and a.metrics == b.metrics


def test_changed_content_with_the_same_size_and_mtime_is_encoded_again(tmp_path, tiny_bert_dir, counted):
    data = write_tsv(tmp_path / "train.tsv", sentiment_rows(40))
    cfg = _cfg(tmp_path, tiny_bert_dir, data)
    before = _prepare(cfg)
    st = data.stat()
    text = data.read_text(encoding="utf-8")
    changed = text.replace("very good", "very poor", 1)  # same length, other content
    assert changed != text and len(changed) == len(text)
    data.write_text(changed, encoding="utf-8")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    counted["rows"] = 0
    after = _prepare(cfg)
    assert counted["rows"] == 40 and _status(after) == "miss"
    folder = lambda p: p.found.data_report.facts_as(ClassifyFacts).encoded_store["folder"]  # noqa: E731
    assert folder(after) != folder(before)
    assert list(after.work.features) != list(before.work.features)


def test_an_encoding_setting_is_another_key_and_a_training_setting_is_not(tmp_path, tiny_bert_dir, counted):
    rows = [{**r, "other": "neg" if i % 3 else "pos"} for i, r in enumerate(sentiment_rows(40))]
    data = write_tsv(tmp_path / "train.tsv", rows)
    _prepare(_cfg(tmp_path, tiny_bert_dir, data))
    counted["rows"] = 0
    assert _status(_prepare(_cfg(tmp_path, tiny_bert_dir, data, lr=0.5, batch_size=8, epochs=7))) == "hit"
    assert counted["rows"] == 0
    assert _status(_prepare(_cfg(tmp_path, tiny_bert_dir, data, max_seq_length=8))) == "miss"
    other = _prepare(_cfg(tmp_path, tiny_bert_dir, data, label_field="other"))
    assert _status(other) == "miss" and other.found.data_report.facts_as(ClassifyFacts).label_field == "other"
    assert _status(_prepare(_cfg(tmp_path, tiny_bert_dir, data, seed=3))) == "miss"  # another split
    assert _status(_prepare(_cfg(tmp_path, tiny_bert_dir, data, problem_type="multi"))) == "miss"


def test_a_damaged_store_is_rebuilt_with_a_note(tmp_path, tiny_bert_dir, counted):
    data, extra = _data(tmp_path, "pairs")
    cfg = _cfg(tmp_path, tiny_bert_dir, data, **extra)
    first = _prepare(cfg)
    examples = list(first.work.features)
    folder = Path(first.found.data_report.facts_as(ClassifyFacts).encoded_store["folder"])
    types = folder / "train.token.token_type_ids"
    raw = bytearray(types.read_bytes())
    raw[-4] ^= 1
    types.write_bytes(bytes(raw))
    # Opening checks the header and sizes only; the damaged chunk is found by the first read that touches it, and
    # an extra array is read through the same checks as the token ids.
    counted["rows"] = 0
    hit = _prepare(cfg)
    assert _status(hit) == "hit" and counted["rows"] == 0
    with pytest.raises(DataError) as e:
        list(hit.work.features)
    assert "train.token.token_type_ids bytes " in str(e.value) and "do not match their checksum" in str(e.value)
    said: list[str] = []
    again = _prepare(cfg, said)  # the mark the reader left: removed with a note and encoded anew
    assert any("is damaged (a run reading it found train.token.token_type_ids bytes " in x for x in said), said
    assert counted["rows"] == 39 and _status(again) == "rebuilt"
    assert list(again.work.features) == examples


def test_an_unknown_validation_label_is_reported_with_its_file_and_row_and_nothing_is_stored(tmp_path, tiny_bert_dir):
    train = write_tsv(tmp_path / "train.tsv", sentiment_rows(40))
    dev = write_tsv(tmp_path / "dev.tsv", [{"sentence": "the plot was dull", "label": "neg", "idx": 0},
                                           {"sentence": "a film", "label": "meh", "idx": 1}])
    for _ in range(2):
        with pytest.raises(DataError) as e:
            _prepare(_cfg(tmp_path, tiny_bert_dir, train, val_data=str(dev)))
        assert "meh" in str(e.value) and "dev.tsv" in str(e.value) and "line 3" in str(e.value)
    assert not encoded_store.store_root().exists() or not any(encoded_store.store_root().rglob("header.json"))


def test_the_doctor_on_a_hit_reports_what_it_reports_on_rows_encoded_in_memory(tmp_path, tiny_bert_dir, counted):
    data, extra = _data(tmp_path, "pairs")
    cfg = _cfg(tmp_path, tiny_bert_dir, data, **extra)
    _prepare(cfg)
    counted["rows"] = 0
    said: list[str] = []
    torch.manual_seed(0)
    report = doctor(cfg, train_classify.prepare, said.append)
    assert counted["rows"] == 0 and any("read from the cache" in x for x in said)
    torch.manual_seed(0)
    plain = doctor(_cfg(tmp_path, tiny_bert_dir, data, no_cache=True, **extra), train_classify.prepare, lambda _: None)
    assert str(report) == str(plain)
    assert [f.code for f in report.findings] == [f.code for f in plain.findings]


def test_a_run_killed_mid_epoch_and_resumed_from_the_store_ends_with_the_in_memory_runs_weights(
        tmp_path, tiny_bert_dir, capsys):
    train = write_tsv(tmp_path / "train.tsv", sentiment_rows(40))
    dev = write_tsv(tmp_path / "dev.tsv", sentiment_rows(8, template="the {filler} is really {word}"))
    args = ["--task", "classify", "--model", str(tiny_bert_dir), "--data", str(train), "--val_data", str(dev),
            "--epochs", "2", "--batch_size", "4", "--lr", "3e-3", "--save_every", "3"]
    # The reference never touches a store: examples encoded in memory, uninterrupted.
    assert main(["train", *args, "--no_cache", "--output_dir", str(tmp_path / "reference")]) == 0
    reference = load_file(tmp_path / "reference" / "final" / "model.safetensors")
    assert not encoded_store.store_root().exists()

    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(CRASH), "mid-epoch", "--", *args, "--output_dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)  # writes the store, dies in step 5
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "training examples encoded and written to the cache" in proc.stdout
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "training examples read from the cache" in said and "resumed from" in said
    assert json.loads((out / "data_report.json").read_text())["encoded_store"]["status"] == "hit"
    got = load_file(out / "final" / "model.safetensors")
    assert got.keys() == reference.keys()
    worst = max(float((got[k] - reference[k]).abs().max()) for k in got)
    assert worst <= 1e-6, worst


def test_a_store_encoded_to_another_length_than_the_model_takes_is_not_used(tmp_path, tiny_bert_dir, counted,
                                                                            monkeypatch):
    data, extra = _data(tmp_path, "pairs")
    cfg = _cfg(tmp_path, tiny_bert_dir, data, **extra)
    _prepare(cfg)
    # The model now caps inputs at 8 positions (the key holds its config and transformers' version, so only a
    # forward that changed behind the same version gets here: the store must not be trusted then).
    original = train_classify.model_inputs
    monkeypatch.setattr(train_classify, "model_inputs", lambda *a, **k: (8, *original(*a, **k)[1:]))
    counted["rows"] = 0
    said: list[str] = []
    got = _prepare(cfg, said)
    assert any("does not fit this model (it was encoded to 16 tokens" in x for x in said), said
    assert counted["rows"] == 39 and _status(got) == "not cacheable"
    plain = _prepare(_cfg(tmp_path, tiny_bert_dir, data, no_cache=True, **extra))
    assert got.work.features == plain.work.features and max(got.work.lengths) == 8


def test_extra_arrays_per_example_and_per_token_are_read_back_by_position(tmp_path):
    import numpy as np

    from surefit.data.encoded_store import EncodedStore, SplitArrays, StoreWriter

    def chunk(lengths, start):
        n, t = len(lengths), int(sum(lengths))
        lengths = np.array(lengths, dtype=np.int64)
        return SplitArrays(np.arange(start, start + t, dtype=np.int32), np.zeros(0, dtype=np.int32), lengths,
                           lengths.astype(np.int32), np.ones(n, dtype=np.int32), np.arange(n), [f"row {i}" for i in range(n)],
                           per_example={"target": np.arange(2 * n, dtype=np.float64).reshape(n, 2) / 3},
                           per_token={"kind": np.arange(t, dtype=np.int8) % 2})

    writer = StoreWriter(tmp_path / "store", {"k": 1})
    writer.add("train", chunk([2, 3], 0))
    writer.add("train", chunk([1], 5))
    with pytest.raises(ValueError, match="earlier chunks"):  # one dtype per array, whatever the chunk
        writer.add("train", SplitArrays(**{**chunk([1], 0).__dict__, "per_token": {"kind": np.zeros(1, np.int32)}}))
    with pytest.raises(ValueError, match="expected numbers"):
        writer.add("train", SplitArrays(**{**chunk([1], 0).__dict__, "per_example": {"x": np.array([None])}}))
    folder = writer.commit({})
    store = EncodedStore.open(folder, {"k": 1})
    split = store.split("train")
    extras = store.extras(split)
    assert [extras.tokens("input_ids", i).tolist() for i in range(3)] == [[0, 1], [2, 3, 4], [5]]
    assert [extras.tokens("kind", i).tolist() for i in range(3)] == [[0, 1], [0, 1, 0], [0]]
    assert extras.example("target", 1).tolist() == [2 / 3, 1.0] and extras.example("target", 2).tolist() == [0.0, 1 / 3]
    header = json.loads((folder / "header.json").read_text())
    assert header["extra"]["train.example.target"] == {"dtype": "<f8", "shape": [2]}
    # A header edited to claim an object array is refused, never read with pickle.
    header["extra"]["train.example.target"]["dtype"] = "|O"
    edited = EncodedStore(folder, header)
    with pytest.raises(DataError, match="has the type"):
        edited.extras(edited.split("train")).example("target", 0)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda r: r["spec"].update(problem_type="ordinal"), "'record' 'spec' 'problem_type'"),
    (lambda r: r.update(max_len="16"), "'max_len' is '16' (str); expected int"),
    (lambda r: r["validation_rows"][0].pop("where"), "'validation_rows[0]'"),
    (lambda r: r.pop("keys"), "'keys' is missing"),
    (lambda r: r["fields"].update(label=3), "'record' 'fields' 'label'"),
])
def test_a_hand_edited_record_in_the_header_is_refused_naming_the_file_and_key(tmp_path, tiny_bert_dir, capsys,
                                                                                edit, expected):
    data, _ = _data(tmp_path, "multi")
    first = _prepare(_cfg(tmp_path, tiny_bert_dir, data))
    header = Path(first.found.data_report.facts_as(ClassifyFacts).encoded_store["folder"]) / "header.json"
    saved = json.loads(header.read_text(encoding="utf-8"))
    edit(saved["record"])  # the header's own bytes are no part of the checksums: the record checks itself
    header.write_text(json.dumps(saved), encoding="utf-8")
    capsys.readouterr()
    code = main(["train", "--task", "classify", "--model", str(tiny_bert_dir), "--data", str(data), "--val_fraction",
                 "0.25", "--batch_size", "4", "--output_dir", str(tmp_path / "again")])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and "Traceback" not in text, text
    assert expected in text and str(header) in text and "delete that folder" in text, text
