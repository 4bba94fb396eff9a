"""The run folder has one owner: a task's ``prepare`` writes nothing, and ``RunFolder`` writes what it found."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from surefit.cli import main


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _rows(path: Path, bad: list[str]) -> Path:
    from conftest import qa_rows

    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(20)) + "".join(b + "\n" for b in bad),
                    encoding="utf-8")
    return path


def test_sft_prepare_on_a_read_only_output_folder_succeeds_and_writes_nothing(tmp_path, tiny_lm_dir):
    from surefit.config import SFTConfig, build_config
    from surefit.tasks.sft import prepare

    data = _rows(tmp_path / "train.jsonl", ['{"input": "x", "target": null}'])
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("a previous file", encoding="utf-8")
    cfg = build_config(SFTConfig, None, {"model": str(tiny_lm_dir), "data": str(data), "output_dir": str(out),
                                         "on_bad_rows": "skip", "epochs": 1})
    before, model_before = _tree(tmp_path), _tree(tiny_lm_dir)
    out.chmod(stat.S_IRUSR | stat.S_IXUSR)  # read-only (root may still write: the tree comparison below holds anyway)
    try:
        p = prepare(cfg, say=lambda _: None)
    finally:
        out.chmod(stat.S_IRWXU)
    assert _tree(tmp_path) == before and _tree(tiny_lm_dir) == model_before
    assert os.listdir(out) == ["keep.txt"]
    # What it found is returned instead: the data summary with the rejected row, and the excluded-rows list.
    summary = p.found.data_report
    assert summary.rejected_rows == 1 and summary.rejected[0].where == f"{data} line 21"
    assert summary.format == "input_target" and summary.format_conversational is False
    assert summary.to_json()["rejected_rows"] == 1 and summary.to_json()["train_rows"] == summary.train_rows
    assert len(p.work.features) == len(p.work.lengths) == len(p.work.counts) == summary.train_rows


def test_training_writes_what_prepare_found(tmp_path, tiny_lm_dir):
    data = _rows(tmp_path / "train.jsonl", ['{"input": "x", "target": null}', "[1, 2]"])
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--on_bad_rows", "skip", "--epochs", "1",
                 "--max_steps", "1", "--output_dir", str(out)]) == 0
    rejected = [json.loads(x) for x in (out / "rejected_rows.jsonl").read_text().splitlines()]
    assert sorted(r["where"] for r in rejected) == [f"{data} line 21", f"{data} line 22"]
    report = json.loads((out / "data_report.json").read_text())
    assert report["rejected_rows"] == 2 and report["format"] == "input_target"
    assert {"notes", "field_table", "augmentation", "encoding", "template", "stop_ids"} <= report.keys()
    for name in ("doctor.json", "memory_plan.json", "config.yaml", "startup.json", "schedule.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "memory_plan.json").read_text())["micro_batch_size"] >= 1
    assert "findings" in json.loads((out / "doctor.json").read_text())


def test_rows_rejected_before_a_data_error_are_listed_where_the_error_points(tmp_path, tiny_lm_dir, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input": "x", "target": null}\n[1, 2]\n', encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--on_bad_rows", "skip",
                 "--output_dir", str(out)]) == 2
    assert "all 2 rows rejected (see rejected_rows.jsonl)" in capsys.readouterr().err
    assert len((out / "rejected_rows.jsonl").read_text().splitlines()) == 2
    assert not (out / "config.yaml").exists() and not (out / "data_report.json").exists()


def test_a_previous_runs_rejected_rows_are_not_replaced_by_a_refused_run(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    (out / "rejected_rows.jsonl").write_text('{"where": "before"}\n', encoding="utf-8")
    data = _rows(tmp_path / "train.jsonl", ["[1, 2]"])
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--on_bad_rows", "skip",
                 "--output_dir", str(out)]) == 2
    assert (out / "rejected_rows.jsonl").read_text() == '{"where": "before"}\n'
