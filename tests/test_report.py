"""--report_to tensorboard, OUTPUT/curves.svg, OUTPUT/report.html and `surefit report`, the page checked in headless
Chromium. CPU, seconds (one tiny training run shared by the module)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from surefit.cli import main
from surefit.config import SFTConfig, build_config
from surefit.errors import ConfigError
from surefit.run_folder.report import SECTIONS, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sft_run(tiny_lm_dir, tmp_path_factory):
    from conftest import qa_rows

    tmp = tmp_path_factory.mktemp("report")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    out = tmp / "run"
    argv = ["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2",
            "--lora_r", "8", "--batch_size", "4", "--max_seq_length", "128", "--lr", "1e-2", "--val_fraction", "0.2",
            "--log_every", "1", "--report_to", "tensorboard", "--output_dir", str(out)]
    assert main(argv) == 0
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ------------------------------------------------------------------------------------------------ trackers


def test_tensorboard_event_files_hold_the_logged_losses(sft_run):
    folder = sft_run / "tensorboard" / "surefit"
    assert list(folder.glob("events.out.tfevents.*")), sorted(p.name for p in sft_run.rglob("*"))
    scalars = _scalars(folder)
    records = _records(sft_run)
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert len(steps) == 16  # 32 training rows / batch 4 x 2 epochs, logged every step
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in steps]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    # Epoch records (epoch 0 = before training) at the global step reached by then.
    assert [s for s, _ in scalars["eval/loss"]] == [0, 8, 16]
    assert [v for _, v in scalars["eval/loss"]] == pytest.approx([r["eval_loss"] for r in epochs], rel=1e-6)
    assert [v for _, v in scalars["epoch/train_loss"]] == pytest.approx([r["train_loss"] for r in epochs[1:]], rel=1e-6)
    assert {"eval/f1", "eval/em", "train/lr", "train/grad_norm"} <= scalars.keys()
    # metrics.jsonl is written whatever --report_to says.
    assert epochs[-1]["epoch"] == 2


def test_resumed_run_replaces_the_points_logged_after_its_checkpoint(tmp_path):
    """A run killed after its checkpoint had logged more points; resuming logs them again, and TensorBoard must
    show each step once, with the resumed values (purge_step)."""
    from surefit.training.precision import make_accelerator
    from surefit.training.trackers import MetricsLog, Trackers

    def log_for():
        acc = make_accelerator("fp32", report_to=["tensorboard"], project_dir=tmp_path)
        return MetricsLog(tmp_path / "metrics.jsonl", trackers=Trackers(acc, {"lr": 0.1}, tmp_path))

    log = log_for()
    log.write({"type": "epoch", "epoch": 0, "eval_loss": 9.0})
    checkpoint_bytes = None
    for step in range(1, 7):
        log.write({"type": "step", "step": step, "epoch": 1, "loss": 10.0 + step})
        if step == 3:
            checkpoint_bytes = log.bytes_written()
    log.close()

    log = log_for()
    log.truncate(checkpoint_bytes)
    for step in range(4, 7):
        log.write({"type": "step", "step": step, "epoch": 1, "loss": 20.0 + step})
    log.close()
    points = _scalars(tmp_path / "tensorboard" / "surefit")["train/loss"]
    assert points == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]] == [
        11.0, 12.0, 13.0, 24.0, 25.0, 26.0]


def test_report_to_settings_are_checked(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        build_config(SFTConfig, None, {"data": "x.jsonl", "report_to": "wandb"})
    text = e.value.render()
    assert "--report_to" in text and "pip install wandb" in text
    with pytest.raises(ConfigError) as e:
        build_config(SFTConfig, None, {"data": "x.jsonl", "report_to": "tensorbord"})
    assert "did you mean 'tensorboard'" in e.value.render()
    with pytest.raises(ConfigError):
        build_config(SFTConfig, None, {"data": "x.jsonl", "report_to": "none,tensorboard"})
    assert build_config(SFTConfig, None, {"data": "x.jsonl"}).trackers == []
    assert build_config(SFTConfig, None, {"data": "x.jsonl", "report_to": "tensorboard"}).trackers == ["tensorboard"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        build_config(SFTConfig, None, {"data": "x.jsonl", "report_to": "tensorboard"})
    assert "surefit[tensorboard]" in e.value.render()


# ------------------------------------------------------------------------------------------------ curves and page


def _image(path: Path):
    from matplotlib.image import imread  # the browser's screenshot (a PNG); surefit itself draws no PNG

    return imread(str(path))[..., :3]


def _svg(path: Path):
    """The panels of curves.svg: ``{title: {label: [(x, y) pixel points]}}``, parsed as XML (so well-formed)."""
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    root = ET.parse(path).getroot()
    assert root.tag == f"{ns}svg"
    panels = {}
    for g in root.iter(f"{ns}g"):
        if g.get("class") != "panel":
            continue
        series = {}
        for line in g.iter(f"{ns}polyline"):
            series[line.get("data-label")] = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        for group in g.iter(f"{ns}g"):
            if group.get("class") == "markers":
                series.setdefault(group.get("data-label") + " (points)", [
                    (float(m.get("cx", m.get("x"))), float(m.get("cy", m.get("y")))) for m in group])
        panels[g.get("data-title")] = series
    return root, panels


def _rank(values):
    return sorted(range(len(values)), key=lambda i: values[i])


def test_curves_svg_draws_the_logged_numbers(sft_run):
    root, panels = _svg(sft_run / "curves.svg")
    assert list(panels) == ["training loss", "loss per epoch (epoch 0 = before training)", "evaluation metrics",
                            "learning rate"]
    records = _records(sft_run)
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    line = panels["training loss"]["training loss (logged steps)"]
    assert len(line) == len(steps) == 16
    # x grows with the step; y is drawn downwards, so the pixel order is the losses' order reversed
    assert [x for x, _ in line] == sorted(x for x, _ in line)
    assert _rank([-y for _, y in line]) == _rank([r["loss"] for r in steps])
    assert len(panels["training loss"]["epoch mean (points)"]) == 2
    per_epoch = panels["loss per epoch (epoch 0 = before training)"]
    assert len(per_epoch["evaluation"]) == 3 and len(per_epoch["train"]) == 2  # epochs 0-2; train after 1 and 2
    assert _rank([-y for _, y in per_epoch["evaluation"]]) == _rank([r["eval_loss"] for r in epochs])
    assert set(panels["evaluation metrics"]) >= {"f1", "em"}
    assert len(panels["learning rate"]["logged steps (points)"]) == 16
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "run  (sft)" in texts and "optimizer step" in texts


def test_curves_svg_escapes_text_and_skips_what_is_not_finite(tmp_path):
    run = _fake_run(tmp_path / "a<b&c", "sft", [{"eval_loss": 2.0, "eval_f1": 0.1}, {"eval_loss": float("nan"),
                                                                                        "eval_f1": 0.5}])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = json.dumps({"type": "step", "step": 1, "epoch": 1, "loss": float("inf")})
    (run / "metrics.jsonl").write_text("\n".join(lines), encoding="utf-8")
    from surefit.run_folder.report import write_curves

    root, panels = _svg(write_curves(run))
    assert [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")][0] == "a<b&c  (sft)"
    assert len(panels["training loss"]["training loss (logged steps)"]) == 5  # 6 steps, the infinite one left out
    assert len(panels["loss per epoch (epoch 0 = before training)"]["evaluation"]) == 1  # the NaN left out
    assert "nan" not in (run / "curves.svg").read_text().lower()


def test_a_long_run_is_drawn_thinned_with_its_spikes_and_ends_kept():
    from surefit.run_folder.svg_chart import MAX_LINE_POINTS, thin

    pts = [(float(i), 1.0 + (i % 7) * 0.01) for i in range(100_000)]
    pts[54_321] = (54_321.0, 9.0)  # one spike
    kept = thin(pts)
    assert len(kept) <= MAX_LINE_POINTS
    assert kept[0] == pts[0] and kept[-1] == pts[-1] and (54_321.0, 9.0) in kept
    assert [x for x, _ in kept] == sorted(x for x, _ in kept)
    assert thin(pts[:MAX_LINE_POINTS]) == pts[:MAX_LINE_POINTS]  # short lines are drawn whole


def test_curves_are_redrawn_after_an_epoch_at_most_every_few_seconds_and_the_end_draws_what_is_stale(sft_run, tmp_path):
    from surefit.run_folder import CURVES_EVERY_S, CurvesRedraw

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(sft_run / "metrics.jsonl", run / "metrics.jsonl")
    now = [100.0]
    redraw = CurvesRedraw(run, clock=lambda: now[0])
    now[0] += CURVES_EVERY_S - 1
    redraw()  # epochs of seconds: not drawn
    assert not (run / "curves.svg").exists()
    now[0] += 1
    redraw()  # CURVES_EVERY_S since the start
    assert (run / "curves.svg").read_text().startswith("<svg ")
    (run / "curves.svg").unlink()
    now[0] += CURVES_EVERY_S - 1
    redraw()  # a second less than CURVES_EVERY_S since the last drawing
    assert not (run / "curves.svg").exists()
    write_report(run, redraw=False)  # the end of a run: curves.svg is stale (here: missing), so it is drawn
    assert (run / "curves.svg").read_text().startswith("<svg ")


def test_report_html_has_every_section_and_no_external_resource(sft_run):
    page = (sft_run / "report.html").read_text(encoding="utf-8")
    for anchor, title in SECTIONS:
        assert f'<section id="{anchor}"><h2>{title}</h2>' in page
    assert 'src="data:image/svg+xml;base64,' in page
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page
    assert "report_to" in page and "tensorboard" in page  # the config
    assert "memory_plan.json" in page or "checkpoint" in page  # the memory plan, from wherever it was found
    assert "no findings" in page or "finding" in page  # doctor.json
    assert "predictions/epoch_2.jsonl" in page and "where did the" in page  # sample predictions of the last epoch
    assert "finished: 2 of 2 epochs" in page
    metrics_table = page.split('<section id="metrics">')[1].split("</section>")[0]
    assert metrics_table.count("<tr>") == 1 + 3  # header + epochs 0, 1, 2


def test_report_command_rebuilds_both_files(sft_run, capsys):
    (sft_run / "report.html").unlink()
    (sft_run / "curves.svg").unlink()
    assert main(["report", "--run", str(sft_run)]) == 0
    assert "report.html" in capsys.readouterr().out
    assert (sft_run / "report.html").is_file() and (sft_run / "curves.svg").is_file()


def test_report_command_refuses_a_folder_without_a_run(tmp_path, capsys):
    assert main(["report", "--run", str(tmp_path / "missing")]) == 2
    assert "--run" in capsys.readouterr().err
    assert main(["report", "--run", str(tmp_path)]) == 2


def _fake_run(folder: Path, task: str, epochs: list[dict], steps: int = 6, final: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"task: {task}\nepochs: 3\nbatch_size: 8\ngrad_accum: 2\n", encoding="utf-8")
    lines = [{"type": "epoch", "epoch": 0, **epochs[0]}]
    per = steps // max(len(epochs) - 1, 1)
    for i, rec in enumerate(epochs[1:], start=1):
        lines += [{"type": "step", "step": (i - 1) * per + s, "epoch": i, "loss": 2.0 / ((i - 1) * per + s)}
                  for s in range(1, per + 1)]
        lines.append({"type": "epoch", "epoch": i, "step": i * per, "train_loss": 1.0 / i, **rec})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "st',
                                          encoding="utf-8")  # a torn last line, as a crash leaves it
    if final:
        (folder / "final").mkdir()
    return folder


def test_report_escapes_everything_taken_from_the_run(tmp_path):
    run = _fake_run(tmp_path / "run", "sft", [{"eval_loss": 2.0, "eval_f1": 0.1}, {"eval_loss": 1.0, "eval_f1": 0.5}])
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    (run / "config.yaml").write_text(yaml_dump({"task": "sft", "epochs": 3, "template": evil + " {input}"}),
                                     encoding="utf-8")
    (run / "predictions").mkdir()
    rows = [{"where": f"a.jsonl line {i}", "input": evil, "gold": [evil, "b"], "prediction": "</td></tr>"}
            for i in range(15)]
    (run / "predictions" / "epoch_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (run / "doctor.json").write_text(json.dumps({"has_errors": True, "findings": [
        {"code": "split-leakage", "severity": "error", "message": evil, "fix": "a & b", "where": "<val>"}]}),
        encoding="utf-8")
    page = write_report(run).read_text(encoding="utf-8")
    assert "<script" not in page and "<img src=x" not in page and "</td></tr></td>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page and "a &amp; b" in page
    assert "the first 10 of 15 rows of predictions/epoch_1.jsonl" in page
    assert "1 finding, 1 error" in page
    assert "interrupted or still running: last evaluation after epoch 1 of 3" in page


def yaml_dump(data):
    import yaml

    return yaml.safe_dump(data)


def test_classification_and_custom_runs_get_their_own_panels_and_tables(tmp_path):
    cls = _fake_run(tmp_path / "cls", "classify", [
        {"eval_loss": 0.7, "eval_accuracy": 0.5, "eval_macro_f1": 0.33, "eval_per_class_f1": {"neg": 0.0, "pos": 0.67},
         "eval_confusion_matrix": [[0, 4], [0, 4]], "labels": ["neg", "pos"]},
        {"eval_loss": 0.3, "eval_accuracy": 1.0, "eval_macro_f1": 1.0, "eval_per_class_f1": {"neg": 1.0, "pos": 1.0},
         "eval_confusion_matrix": [[4, 0], [0, 4]], "labels": ["neg", "pos"]}], final=True)
    (cls / "predictions").mkdir()
    (cls / "predictions" / "epoch_1.jsonl").write_text(json.dumps(
        {"where": "dev.tsv line 2", "text": "a good film", "gold": "pos", "prediction": "pos"}) + "\n", encoding="utf-8")
    page = write_report(cls).read_text(encoding="utf-8")
    assert "confusion matrix after epoch 1" in page and "per-class F1 after epoch 1" in page
    assert "eval_accuracy" in page and "eval_macro_f1" in page and "a good film" in page
    assert "micro_batch_size" in page  # the plan, from config.yaml when there is no memory_plan.json or checkpoint
    _, panels = _svg(cls / "curves.svg")
    assert set(panels["evaluation metrics"]) == {"accuracy", "macro_f1", "accuracy (points)", "macro_f1 (points)"}

    custom = _fake_run(tmp_path / "custom", "custom", [{"eval_loss": 2.0, "avg_valid_loss": 2.0},
                                                      {"eval_loss": 1.5, "avg_valid_loss": 1.5}])
    page = write_report(custom).read_text(encoding="utf-8")
    assert "the custom task writes none" in page and "doctor.json is absent" in page
    _, panels = _svg(custom / "curves.svg")
    assert list(panels) == ["training loss", "loss per epoch (epoch 0 = before training)"]  # no task metric


# ------------------------------------------------------------------------------------------------ in a browser


def _chromium() -> str:
    if os.environ.get("SUREFIT_SKIP_BROWSER") == "1":
        pytest.skip("SUREFIT_SKIP_BROWSER=1: the report is not rendered in a browser")
    for name in (os.environ.get("SUREFIT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.fail("headless Chromium is needed to render report.html and was not found. Install it with "
                "`apt-get install -y chromium chromium-driver` (.ci/run does this on a clean machine), point "
                "SUREFIT_CHROMIUM at a Chromium/Chrome binary, or set SUREFIT_SKIP_BROWSER=1 to skip this test.")


def _browse(tmp_path: Path, page: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", *extra, page.resolve().as_uri()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_report_renders_in_headless_chromium(sft_run, tmp_path):
    page = sft_run / "report.html"
    dom = _browse(tmp_path, page, "--dump-dom").stdout
    for anchor, title in SECTIONS:
        assert f'id="{anchor}"' in dom and f"<h2>{title}</h2>" in dom, title
    assert 'src="data:image/svg+xml;base64,' in dom

    shot = tmp_path / "shot.png"
    # Tall enough to hold the curves below the config, plan, doctor and metrics sections.
    _browse(tmp_path, page, f"--screenshot={shot}", "--window-size=1200,3200")
    assert shot.read_bytes()[:8] == PNG_SIGNATURE
    img = _image(shot)
    assert img.shape[:2] == (3200, 1200)
    ink = img.min(-1) < 0.85
    assert ink.mean() > 0.01 and img.std() > 0.05, "the page rendered (nearly) blank"
    # The embedded curves were decoded and drawn: the first line colour (#1f77b4) is on screen.
    blue = (abs(img[..., 0] - 0x1F / 255) < 0.06) & (abs(img[..., 1] - 0x77 / 255) < 0.06) & (
        abs(img[..., 2] - 0xB4 / 255) < 0.06)
    assert blue.sum() > 200, int(blue.sum())
