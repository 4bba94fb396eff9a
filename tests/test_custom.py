"""--task custom end to end on generated shards: the three figures, the shape check, the protocol variants."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_model

from surefit.cli import main

REPO = Path(__file__).resolve().parents[1]
MODEL = str(REPO / "examples/custom/projection_model.py") + ":build"


def _shards(folder: Path, n=160, vocab=17, seed=0, fmt="npy"):
    subprocess.run([sys.executable, str(REPO / "examples/custom/make_shards.py"), "--out", str(folder), "--vocab",
                    str(vocab), "--train", str(n), "--val", "40", "--shard_rows", "64", "--seed", str(seed)],
                   check=True, capture_output=True)
    return folder / "train", folder / "val"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def custom_run(shards, tmp_path_factory):
    import surefit

    train, val = shards
    out = tmp_path_factory.mktemp("custom") / "run"
    result = surefit.train(task="custom", model=MODEL, model_args='{"vocab": 17, "hidden": 32}', data=str(train),
                           val_data=str(val), epochs=3, batch_size=16, lr=3e-3, output_dir=str(out),
                           max_memory_gb=0.05)
    return out, result


def test_three_figures_each_epoch_in_output_metrics_and_api(custom_run, capsys):
    out, result = custom_run
    epochs = [r for r in result.history if r["epoch"] > 0]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    for r in epochs:
        assert r["avg_train_loss"] > 0 and r["avg_valid_loss"] > 0 and r["time_per_epoch"] > 0
    assert epochs[-1]["avg_valid_loss"] < result.history[0]["avg_valid_loss"]
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["avg_train_loss"] for r in logged if r["type"] == "epoch" and r["epoch"] > 0] == [
        r["avg_train_loss"] for r in epochs]


def test_the_doctor_report_is_saved_in_the_run_folder(custom_run):
    """As for sft and classify: report.html and later readers take the checks from doctor.json."""
    out, _ = custom_run
    saved = json.loads((out / "doctor.json").read_text())
    assert saved["has_errors"] is False and isinstance(saved["findings"], list)
    assert "no doctor report saved" not in (out / "report.html").read_text()


def test_final_model_reloads_through_its_factory(custom_run):
    out, _ = custom_run
    spec = json.loads((out / "final/surefit_model.json").read_text())
    assert spec == {"factory": MODEL, "model_args": {"vocab": 17, "hidden": 32}}
    from surefit.models import load_factory

    model = load_factory(spec["factory"])(**spec["model_args"])
    missing, unexpected = load_model(model, out / "final/model.safetensors")
    assert not missing and not unexpected


def test_wrong_width_stops_before_step_1_with_the_message(tmp_path, capsys):
    train, val = _shards(tmp_path / "wrong", n=40, vocab=40)
    code = main(["train", "--task", "custom", "--model", MODEL, "--model_args", '{"vocab": 17}', "--data", str(train),
                 "--val_data", str(val), "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert "'inputs_embeds' arrives as [B, 20, 40] (float32), but the layer expects a last dimension of 17" in err
    assert "--model_args '{\"vocab\": 40}'" in err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_inspect_lists_arrays_and_first_consumers(shards, capsys):
    train, _ = shards
    assert main(["inspect", "--data", str(train), "--model", MODEL, "--model_args", '{"vocab": 17}']) == 0
    out = capsys.readouterr().out
    assert "inputs_embeds  [160, 20, 17]  float32  0..1" in out
    assert "inputs_embeds [2, 20, 17] float32 -> first consumed by projection (nn.Linear(17 -> 256)) - shapes agree" in out


def _factory_file(tmp_path, body: str) -> str:
    path = tmp_path / "m.py"
    path.write_text("import torch\nfrom torch import nn\n" + body)
    return f"{path}:build"


def test_forward_batch_protocol_tuple_output_and_loss_from_logits(shards, tmp_path):
    import surefit

    train, val = shards
    spec = _factory_file(tmp_path, '''
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(17, 4)
    def forward(self, batch):  # a single argument: gets the whole batch dict
        return (self.lin(batch["inputs_embeds"].mean(1)),)
def build():
    return M()
''')
    result = surefit.train(task="custom", model=spec, data=str(train), val_data=str(val), loss="cross_entropy",
                           epochs=2, batch_size=16, lr=1e-2, output_dir=str(tmp_path / "o"))
    assert result.history[-1]["avg_valid_loss"] < result.history[0]["avg_valid_loss"]


@pytest.mark.parametrize("body,flags,expected", [
    ("class M(nn.Module):\n    def __init__(self):\n        super().__init__(); self.lin = nn.Linear(17, 2)\n"
     "    def forward(self, inputs_embeds):\n        return self.lin(inputs_embeds.mean(1))\ndef build():\n    return M()\n",
     ["--loss", "cross_entropy"], "'labels' holds values from 0 to 3, but the model's logits have 2 classes"),
    ("class M(nn.Module):\n    def __init__(self):\n        super().__init__(); self.lin = nn.Linear(17, 4)\n"
     "    def forward(self, inputs_embeds):\n        return self.lin(inputs_embeds.mean(1))\ndef build():\n    return M()\n",
     [], "the model returned no loss (a tensor of shape [2, 4])"),
])
def test_output_and_label_checks_stop_before_training(shards, tmp_path, capsys, body, flags, expected):
    train, val = shards
    code = main(["train", "--task", "custom", "--model", _factory_file(tmp_path, body), "--data", str(train),
                 "--val_data", str(val), "--output_dir", str(tmp_path / "o"), *flags])
    assert code == 2 and expected in capsys.readouterr().err


def test_nan_in_data_and_bad_factory_are_reported(tmp_path, capsys):
    folder = tmp_path / "nan"
    folder.mkdir()
    x = np.random.rand(30, 20, 17).astype(np.float32)
    x[7, 3, 2] = np.nan
    np.save(folder / "inputs_embeds.npy", x)
    np.save(folder / "labels.npy", np.zeros(30, dtype=np.int64))
    assert main(["train", "--task", "custom", "--model", MODEL, "--model_args", '{"vocab": 17}', "--data", str(folder),
                 "--output_dir", str(tmp_path / "o")]) == 2
    assert "'inputs_embeds' has 1 NaN and 0 inf values (first at row 7)" in capsys.readouterr().err
    assert main(["train", "--task", "custom", "--model", "no_such_module_xyz:build", "--data", str(folder),
                 "--output_dir", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "cannot import 'no_such_module_xyz'" in err and "--model" in err


def test_npz_shards_under_a_bound_are_read_once_per_epoch(tmp_path, monkeypatch):
    """.npz shards load whole into a bounded cache: the epoch's order must visit them shard by shard, not at random."""
    from surefit.config.task_configs import CustomConfig
    from surefit.data import sampling
    from surefit.tasks import custom

    rng = np.random.default_rng(0)
    for folder, shards in (("train", 8), ("val", 1)):
        (tmp_path / folder).mkdir()
        for s in range(shards):
            x = rng.random((40, 20, 17), dtype=np.float32)  # 54 KB a shard
            np.savez(tmp_path / folder / f"part-{s:02d}.npz", inputs_embeds=x, labels=rng.integers(0, 4, 40))
    opened = []
    monkeypatch.setattr(custom, "load_tensor_data", lambda *a, **k: opened.append(custom.TensorData(*a, **k))
                        or opened[-1])
    cfg = CustomConfig(model=MODEL, model_args='{"vocab": 17, "hidden": 8}', data=str(tmp_path / "train"),
                       val_data=str(tmp_path / "val"), batch_size=16, max_memory_gb=0.00016,  # ~3 shards fit
                       output_dir=str(tmp_path / "o"))
    p = custom.prepare(cfg, say=lambda _: None)
    data = opened[0]
    assert p.work.epoch_batches is not None

    def loads_for(batches):
        seen, before = [], data.shard_loads
        for step in batches:
            p.work.collate([p.work.features[i] for i in step])
            seen += step
        assert sorted(seen) == list(range(len(p.work.features)))  # every example once
        return data.shard_loads - before

    for epoch in (1, 2):
        assert loads_for(p.work.epoch_batches(epoch)) <= 8 + 1  # each shard once (+1: the one cached from the check)
    assert p.work.epoch_batches(1) != p.work.epoch_batches(2)  # still shuffled per epoch
    random_loads = loads_for(sampling.epoch_steps(p.work.lengths, 16, 0, 1))  # the loop's own order
    assert random_loads > 3 * 8, random_loads  # what the plain shuffled order costs on the same data


def test_forward_x_with_loss_cross_entropy_is_not_refused_over_labels(tmp_path, capsys):
    """The column table says labels go to --loss, not to forward(x): the doctor must not refuse them as unexpected."""
    folder = tmp_path / "d"
    folder.mkdir()
    rng = np.random.default_rng(0)
    np.save(folder / "x.npy", rng.normal(size=(40, 4)).astype(np.float32))
    np.save(folder / "labels.npy", rng.integers(0, 3, 40))
    spec = _factory_file(tmp_path, "class M(nn.Module):\n    def __init__(self):\n        super().__init__(); "
                         "self.lin = nn.Linear(4, 3)\n    def forward(self, x):\n        return self.lin(x)\n"
                         "def build():\n    return M()\n")
    assert main(["train", "--task", "custom", "--model", spec, "--data", str(folder), "--loss", "cross_entropy",
                 "--epochs", "1", "--output_dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "labels  kept     targets for --loss cross_entropy (not passed to forward)" in out
    assert "unexpected-columns" not in out
