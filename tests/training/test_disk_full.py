"""A full disk never loses work and never ends in a raw traceback: what torch, safetensors and Python really raise
when a write fails is caught, the partial folder or file is removed, and the message names the cause and the space.

The failures are real: either a small tmpfs that fills up (needs root to mount; skipped otherwise) or a file-size
limit (``RLIMIT_FSIZE`` with SIGXFSZ ignored), under which every write past the limit fails inside the libraries
exactly as on a full disk, only with EFBIG instead of ENOSPC. Each run is a subprocess, so the limit stays there.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from conftest import qa_rows

SRC = Path(__file__).resolve().parents[2] / "src"

LIMITED = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as a full disk does
    limit = int(sys.argv[1])
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from surefit.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _run(argv, limit=0):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", LIMITED, str(limit), *argv], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def args(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    # LoRA r8 on the tiny model: a checkpoint is about 150 KB (weights 37 KB, optimizer 89 KB).
    return ["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
            "--lora_r", "8", "--val_fraction", "0.2", "--max_seq_length", "128", "--save_every", "3"]


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("limit,raised,file", [
    (32 * 1024, "SafetensorError", "trainable.safetensors"),  # safetensors fails first
    (64 * 1024, "RuntimeError", "optimizer.pt"),  # torch.save's zip writer fails first
])
def test_a_checkpoint_write_that_fails_removes_the_partial_folder_and_names_the_cause(args, tmp_path, limit, raised,
                                                                                     file):
    out = tmp_path / "run"
    proc = _run([*args, "--output_dir", str(out)], limit)
    assert proc.returncode == 2
    _no_traceback(proc)
    err = proc.stderr
    assert f"could not write checkpoint {out / 'checkpoints' / 'step-0000003'}: a file is larger than the file-size " \
           f"limit (ulimit -f) ({raised}" in err
    assert "it needs about" in err and "free there" in err and "no earlier checkpoint exists" in err
    assert not list((out / "checkpoints").glob("*.tmp"))  # the partial checkpoint is gone
    assert not (out / "final").exists()


def test_a_full_disk_at_the_start_leaves_no_empty_config(args, tmp_path):
    out = tmp_path / "run"
    proc = _run([*args, "--output_dir", str(out)], 256)  # config.yaml is about 1.5 KB
    assert proc.returncode == 2
    _no_traceback(proc)
    assert f"could not write {out / 'config.yaml'} (the run's settings): a file is larger than the file-size limit" \
        in proc.stderr
    assert not (out / "config.yaml").exists()
    assert not out.exists() or not [p.name for p in out.iterdir() if ".tmp" in p.name]  # no partial file either


SAVE_FINAL = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from surefit.run_folder import save_final
    from surefit.errors import SurefitError
    out = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    def save_model(folder):
        folder.mkdir()
        save_file({"w": torch.zeros(1 << 15)}, folder / "model.safetensors")  # 128 KB: past the limit
    try:
        save_final(out, save_model)
    except SurefitError as e:
        print(e.render())
        sys.exit(2)
""")


def test_a_final_save_that_fails_leaves_no_partial_final_and_names_the_cause(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SAVE_FINAL, str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"could not write the final model {out / 'final'}: a file is larger than the file-size limit" in proc.stdout
    assert "SafetensorError" in proc.stdout
    assert list(out.iterdir()) == []  # no final/, no final.tmp/


@pytest.fixture()
def small_disk(tmp_path):
    """A 340 KB tmpfs: a real full disk (root only); the run's files and one checkpoint (~160 KB) fit, two do not."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=340k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_real_full_disk_stops_clearly_and_keeps_the_previous_checkpoint(args, small_disk):
    """Replaces a test that raised OSError by hand: the second checkpoint (step 6) no longer fits on the disk."""
    from surefit.training import checkpoint as ck

    out = small_disk / "run"
    proc = _run([*args, "--output_dir", str(out)])
    assert proc.returncode == 2
    _no_traceback(proc)
    err = proc.stderr
    assert f"could not write checkpoint {out / 'checkpoints' / 'step-0000006'}: the disk is full" in err
    # Which write meets the full disk first decides the raw text: ENOSPC from open/safetensors, or torch's zip writer.
    assert "No space left on device" in err or "unexpected pos" in err
    assert f"the previous checkpoint {out / 'checkpoints' / 'step-0000003'} is intact" in err
    assert ck.verify(out / "checkpoints" / "step-0000003") is None
    assert not (out / "checkpoints" / "step-0000006.tmp").exists()
    assert not (out / "final").exists()


def test_a_real_full_disk_at_the_start_leaves_no_empty_config(args, small_disk):
    filler = small_disk / "filler"
    with filler.open("wb", buffering=0) as fh:  # fill the disk to the last byte
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    out = small_disk / "run"
    proc = _run([*args, "--output_dir", str(out)])
    assert proc.returncode == 2
    _no_traceback(proc)
    assert f"could not write {out / 'config.yaml'} (the run's settings): the disk is full" in proc.stderr
    assert not (out / "config.yaml").exists()
