"""Checkpoints as the run's safety net: retention only counts checkpoints that verify and keeps the one a run
resumed from; the manifest lists the files a checkpoint requires, so one that lost its optimizer is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from surefit.training import checkpoint as ck


def _save(folder: Path, step: int, with_optimizer: bool = True) -> Path:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return ck.save_checkpoint(folder / f"step-{step:07d}", model=model,
                              states=ck.States(optimizer=opt if with_optimizer else None, scheduler=sched),
                              state=ck.TrainerState(global_step=step, position={"epoch": 1}, history=[],
                                                    metrics_bytes=0))


def _corrupt(folder: Path, name: str = "trainable.safetensors") -> None:
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(data))


def test_retention_counts_only_checkpoints_that_verify(tmp_path):
    for step in (3, 4, 6):
        _save(tmp_path, step)
    _corrupt(tmp_path / "step-0000006")  # the newest is corrupt
    said = []
    ck.prune(tmp_path, 1, said.append)
    # The newest checkpoint that verifies is kept, the corrupt one (which cannot be resumed from) goes.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000004"]
    assert ck.latest_checkpoint(tmp_path, say=lambda *_: None) == tmp_path / "step-0000004"
    assert any("step-0000006: it is unusable (trainable.safetensors does not match its checksum" in s for s in said)


def test_retention_keeps_the_checkpoint_a_run_resumed_from_until_a_newer_one_verifies(tmp_path):
    resumed = _save(tmp_path, 3)
    _save(tmp_path, 6)
    _corrupt(tmp_path / "step-0000006")
    ck.prune(tmp_path, 1, lambda *_: None, protect=resumed)
    assert (tmp_path / "step-0000003").is_dir()  # nothing newer verifies: the resume point stays
    _save(tmp_path, 4)
    ck.prune(tmp_path, 1, lambda *_: None, protect=resumed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000004"]  # now a newer one verifies


def test_nothing_is_removed_while_no_checkpoint_verifies(tmp_path):
    for step in (3, 6):
        _save(tmp_path, step)
        _corrupt(tmp_path / f"step-{step:07d}")
    ck.prune(tmp_path, 1, lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000003", "step-0000006"]


@pytest.mark.parametrize("name", ["optimizer.pt", "trainable.safetensors", "scheduler.pt", "rng.pt"])
def test_a_checkpoint_missing_a_required_file_with_its_manifest_entry_removed_is_refused(tmp_path, name):
    folder = _save(tmp_path, 3)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "optimizer.pt" in manifest["required"] and "trainable.safetensors" in manifest["required"]
    (folder / name).unlink()
    del manifest["files"][name]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert ck.verify(folder) == f"{name} is missing from the manifest (a checkpoint requires it)"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ck.CheckpointError, match=f"cannot resume from .*step-0000003: {name} is missing"):
        ck.load_checkpoint(folder, model=model, optimizer=opt)


def test_a_checkpoint_saved_without_an_optimizer_is_refused_by_a_run_that_has_one(tmp_path):
    # Even with "required" edited too, loading for a run with an optimizer needs optimizer.pt.
    folder = _save(tmp_path, 3, with_optimizer=False)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ck.CheckpointError, match="optimizer.pt is missing from the manifest"):
        ck.load_checkpoint(folder, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))


@pytest.mark.parametrize("manifest", ['[1, 2]', '{"files": [1]}', '{"files": {"rng.pt": {"bytes": "x"}}}',
                                      '{"format": 2, "required": "rng.pt", "files": {}}', '{"a": 3}'])
def test_a_manifest_that_is_not_a_manifest_is_named_not_a_traceback(tmp_path, manifest):
    folder = _save(tmp_path, 3)
    (folder / "manifest.json").write_text(manifest)
    reason = ck.verify(folder)
    assert reason is not None and "manifest.json" in reason
    assert ck.latest_checkpoint(tmp_path, say=lambda *_: None) is None


def test_a_trainer_state_that_is_not_json_is_a_checkpoint_error(tmp_path):
    folder = _save(tmp_path, 3)
    shutil.copy(folder / "manifest.json", tmp_path / "m.json")
    (folder / "trainer_state.json").write_text("{not json")
    manifest = json.loads((tmp_path / "m.json").read_text())
    import hashlib

    data = (folder / "trainer_state.json").read_bytes()
    manifest["files"]["trainer_state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ck.CheckpointError, match="trainer_state.json could not be read"):
        ck.load_checkpoint(folder, model=model)


def test_the_trainer_state_reads_back_what_it_wrote_and_refuses_a_newer_layout(tmp_path):
    state = ck.TrainerState(global_step=7, position={"epoch": 2, "step_in_epoch": 3}, history=[{"epoch": 1}],
                            metrics_bytes=120, counters={"rows": 4})
    data = json.loads(json.dumps(state.to_json()))
    assert data["version"] == ck.STATE_VERSION and ck.TrainerState.from_json(data) == state
    del data["version"]  # written before the layout had a version: read as the first one
    assert ck.TrainerState.from_json(data) == state
    with pytest.raises(ValueError, match="trainer state version 2"):
        ck.TrainerState.from_json({**data, "version": 2})
    with pytest.raises(ValueError, match="no 'position'"):
        ck.TrainerState.from_json({"global_step": 1})
