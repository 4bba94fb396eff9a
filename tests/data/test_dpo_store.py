"""Dpo on the encoded-data cache (tasks/dpo/dpo_store.py): a second run reads its pairs by position and encodes
nothing, says what the encoding run said, and prepares, evaluates and is checked by the doctor exactly as a run that
encodes in memory (--no_cache); a changed file is another key; a run killed mid-epoch and resumed from the store
(with the reference precomputed) ends with the weights of an uninterrupted run that never used one."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import qa_rows
from surefit.cli import main
from surefit.config.dpo_config import DPOConfig
from surefit.data import encoded_store
from surefit.data.summary import TextFacts
from surefit.tasks.dpo import train_dpo, use_dpo
from surefit.tasks.dpo.dpo_store import StoredPairs

CRASH = Path(__file__).parents[1] / "training" / "crash_run.py"
WRONG = ["park", "tree", "river", "city", "Berlin"]


def write_pairs(path, n=40):
    items = [{"prompt": r["input"] + "\nAnswer:", "chosen": " " + r["target"],
              "rejected": " " + WRONG[i % len(WRONG)] + " " + r["target"] + " maybe"} for i, r in enumerate(qa_rows(n))]
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    return path


@pytest.fixture()
def counted(monkeypatch):
    """Counts the pairs handed to the encoder."""
    calls = {"rows": 0}
    original = train_dpo.encode_pairs

    def encode_pairs(rows, *a, **k):
        calls["rows"] += len(rows)
        return original(rows, *a, **k)

    monkeypatch.setattr(train_dpo, "encode_pairs", encode_pairs)
    monkeypatch.setattr(use_dpo, "encode_pairs", encode_pairs)
    return calls


def _cfg(tmp_path, model, data, **kw):
    return DPOConfig(**{"model": str(model), "data": str(data), "max_seq_length": 128, "val_fraction": 0.2,
                        "batch_size": 4, "precision": "fp32", "lora_r": 8, "output_dir": str(tmp_path / "run"), **kw})


def _prepare(cfg, said=None):
    torch.manual_seed(0)  # the adapters' initialisation: the same model for every run compared
    return train_dpo.prepare(cfg, (said if said is not None else []).append)


def _store(p):
    return p.found.data_report.facts_as(TextFacts).encoded_store


def test_a_second_run_reads_the_pairs_from_the_store_and_prepares_what_encoding_in_memory_does(
        tmp_path, tiny_lm_dir, counted):
    data = write_pairs(tmp_path / "pairs.jsonl")
    cfg = _cfg(tmp_path, tiny_lm_dir, data)
    said_first: list[str] = []
    first = _prepare(cfg, said_first)
    assert counted["rows"] == 40 and _store(first)["status"] == "miss"
    assert isinstance(first.work.features, StoredPairs)

    counted["rows"] = 0
    said: list[str] = []
    hit = _prepare(cfg, said)
    assert counted["rows"] == 0, "a cache hit encoded pairs"
    assert _store(hit)["status"] == "hit"
    assert any(x.startswith("encoded data: 32 training examples read from the cache") for x in said)
    # Every line of the encoding run is said again (the shape, the fields, the split, the template, the counts).
    assert sorted(x for x in said_first if not x.startswith("encoded data")) == \
        sorted(x for x in said if not x.startswith("encoded data"))

    plain = _prepare(_cfg(tmp_path, tiny_lm_dir, data, no_cache=True))
    assert _store(plain)["status"] == "off" and isinstance(plain.work.features, list)
    assert list(hit.work.features) == plain.work.features
    assert list(hit.work.lengths) == list(plain.work.lengths) and list(hit.work.counts) == list(plain.work.counts)
    assert [hit.work.where(i) for i in range(32)] == [plain.work.where(i) for i in range(32)]
    strip = lambda s: {k: v for k, v in s.to_json().items() if k != "encoded_store"}  # noqa: E731
    assert strip(hit.found.data_report) == strip(plain.found.data_report)
    a, b = hit.work.evaluate(hit.model, 0, 8), plain.work.evaluate(plain.model, 0, 8)
    assert a.records == b.records and a.metrics == b.metrics  # the same validation pairs, rows and scores
    # The doctor on the store's pairs reports what it reports on pairs in memory.
    assert str(hit.check()) == str(plain.check())


def test_changed_content_with_the_same_size_and_mtime_is_encoded_again(tmp_path, tiny_lm_dir, counted):
    data = write_pairs(tmp_path / "pairs.jsonl")
    cfg = _cfg(tmp_path, tiny_lm_dir, data)
    before = _prepare(cfg)
    st = data.stat()
    text = data.read_text(encoding="utf-8")
    changed = text.replace("park", "tree")  # same length, other content
    assert changed != text and len(changed) == len(text)
    data.write_text(changed, encoding="utf-8")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    counted["rows"] = 0
    after = _prepare(cfg)
    assert counted["rows"] == 40 and _store(after)["status"] == "miss"
    assert _store(after)["folder"] != _store(before)["folder"]
    assert list(after.work.features) != list(before.work.features)
    # A loss setting reads the same pairs; a reading setting does not.
    counted["rows"] = 0
    assert _store(_prepare(_cfg(tmp_path, tiny_lm_dir, data, beta=0.3, lr=0.5)))["status"] == "hit"
    assert counted["rows"] == 0
    assert _store(_prepare(_cfg(tmp_path, tiny_lm_dir, data, max_seq_length=64)))["status"] == "miss"


def test_a_run_killed_mid_epoch_and_resumed_from_the_store_ends_with_the_in_memory_runs_weights(
        tmp_path, tiny_lm_dir, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl")
    # Full fine-tuning: the reference is precomputed and carried by the stored pairs on resume.
    args = ["--task", "dpo", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "4",
            "--lr", "1e-3", "--val_fraction", "0.2", "--max_seq_length", "128", "--save_every", "3",
            "--precision", "fp32", "--lora_r", "0"]
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
    assert "reference: the log-probabilities stored in" in said
    assert json.loads((out / "data_report.json").read_text())["encoded_store"]["status"] == "hit"
    got = load_file(out / "final" / "model.safetensors")
    assert got.keys() == reference.keys()
    worst = max(float((got[k] - reference[k]).abs().max()) for k in got)
    assert worst <= 1e-6, worst


def test_inspect_reads_a_training_runs_store_instead_of_encoding_again(tmp_path, tiny_lm_dir, counted):
    data = write_pairs(tmp_path / "pairs.jsonl")
    _prepare(_cfg(tmp_path, tiny_lm_dir, data))  # a training run's encoding: 32 train + 8 validation pairs
    counted["rows"] = 0
    said: list[str] = []
    got = use_dpo.inspect(_cfg(tmp_path, tiny_lm_dir, data), out=str(tmp_path / "hit.jsonl"), show=1, color=False,
                  say=said.append)
    assert counted["rows"] == 0 and any(x.startswith("encoded data: read from the cache") for x in said)
    plain = use_dpo.inspect(_cfg(tmp_path, tiny_lm_dir, data, no_cache=True), out=str(tmp_path / "plain.jsonl"), show=1,
                    color=False, say=lambda _: None)
    assert counted["rows"] == 40  # --no_cache encodes
    assert got == plain and got["rows"] == 40
    lines = lambda p: sorted((tmp_path / p).read_text(encoding="utf-8").splitlines())  # noqa: E731
    assert lines("hit.jsonl") == lines("plain.jsonl")


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda r: r.update(terms=["2"]), "'terms' is ['2'] (list); expected a list of int"),
    (lambda r: r["excluded"].append({"where": "x"}), "'excluded[0]'"),
    (lambda r: r["validation_rows"][0].update(index="7"), "'validation_rows[0]'"),
    (lambda r: r.pop("lines"), "'lines' is missing"),
])
def test_a_hand_edited_record_in_the_header_is_refused_naming_the_file_and_key(tmp_path, tiny_lm_dir, capsys,
                                                                                edit, expected):
    data = write_pairs(tmp_path / "pairs.jsonl")
    cfg = _cfg(tmp_path, tiny_lm_dir, data)
    header = Path(_store(_prepare(cfg))["folder"]) / "header.json"
    saved = json.loads(header.read_text(encoding="utf-8"))
    edit(saved["record"])  # the header's own bytes are no part of the checksums: the record checks itself
    header.write_text(json.dumps(saved), encoding="utf-8")
    capsys.readouterr()
    code = main(["train", "--task", "dpo", "--model", str(tiny_lm_dir), "--data", str(data), "--max_seq_length", "128",
                 "--val_fraction", "0.2", "--batch_size", "4", "--precision", "fp32", "--lora_r", "8",
                 "--output_dir", str(tmp_path / "again")])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and "Traceback" not in text, text
    assert expected in text and str(header) in text and "delete that folder" in text, text
