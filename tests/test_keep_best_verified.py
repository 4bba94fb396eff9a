"""--keep_best copies the best checkpoint into final/ only after it verifies, and final/'s manifest is the verified
checkpoint's, never computed afresh over unverified bytes (run_folder/verified.py)."""

import json

import surefit.tasks.runner as common
from conftest import qa_rows
from surefit.cli import main


def _train(tiny_lm_dir, tmp_path, *extra):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(16)), encoding="utf-8")
    out = tmp_path / "run"
    code = main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "4",
                 "--lora_r", "4", "--val_fraction", "0.25", "--max_seq_length", "96", "--max_new_tokens", "4",
                 "--keep_best", "eval_loss", "--output_dir", str(out), *extra])
    return code, out


def test_final_carries_the_best_checkpoints_own_manifest(tiny_lm_dir, tmp_path, capsys):
    code, out = _train(tiny_lm_dir, tmp_path)
    assert code == 0, capsys.readouterr().err
    best = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"best_checkpoint"' in x][-1]
    source = json.loads((out / "checkpoints" / best["best_checkpoint"] / "manifest.json").read_text())["files"]
    final = json.loads((out / "final" / "manifest.json").read_text())["files"]
    assert final == {k.removeprefix("model/"): v for k, v in source.items() if k.startswith("model/")}


def test_a_best_checkpoint_corrupted_on_disk_is_never_copied_into_final(tiny_lm_dir, tmp_path, monkeypatch, capsys):
    """The bytes of the best checkpoint's adapter really change on disk after it was saved, before final/ is written."""
    real = common.final_model
    corrupted = []

    def corrupt_then_choose(folder, history, export_last):
        best = [r for r in history if r.get("best_checkpoint")][-1]["best_checkpoint"]
        weights = folder.checkpoint_model(best) / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-8:] = b"\xff" * 8  # same size, other bytes: only the checksum can tell
        weights.write_bytes(bytes(data))
        corrupted.append(weights)
        return real(folder, history, export_last)

    monkeypatch.setattr(common, "final_model", corrupt_then_choose)
    capsys.readouterr()
    code, out = _train(tiny_lm_dir, tmp_path)
    err = capsys.readouterr().err
    assert code != 0 and corrupted
    assert "cannot write final/ from the best evaluation" in err and "does not match its checksum" in err
    assert str(corrupted[0].parents[1]) in err
    assert not (out / "final").exists() and not (out / "final.tmp").exists()
    # nothing written afresh: eval finds no final/ rather than a final/ whose manifest vouches for the bad bytes
    assert main(["eval", "--run", str(out)]) == 2
    assert "has no final/ folder" in capsys.readouterr().err


