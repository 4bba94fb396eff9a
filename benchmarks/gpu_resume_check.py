"""Where two runs that should train the same weights part: the question the H200 test run left open.

On an H200 six resume tests held to 1e-6 and three did not (results/h200/README.md): a resume with another
``--save_every``, an old-sampler resume, a dpo full fine-tuning resume. This script trains the resume tests' tiny LoRA
job (tests/training/test_resume.py: 32 rows, batch 4, 2 epochs, lr 1e-2, LoRA dropout 0.1) several ways in one
process, records the trainable weights after every optimizer step, and prints the first step where each variant
departs from the reference, and by how much:

- ``again``: the reference's settings once more (is training itself deterministic here?);
- ``save_every_2``: checkpoints at other steps (does saving a checkpoint change what follows?);
- ``eval_every_2``: an evaluation every 2 steps as well (does an evaluation change what follows?);
- ``resumed``: the reference stopped after step 5 and resumed from its step-3 checkpoint (in this process).

On a CPU every variant should match at every step (max difference 0); that is the script's own check.

    python benchmarks/gpu_resume_check.py                 # on a GPU; prints one JSON line RESULT {...}
    python benchmarks/gpu_resume_check.py --out OUT       # also writes OUT/gpu_resume_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def _job(folder: Path) -> tuple[Path, Path]:
    """The tiny model and the 40 rows of the resume tests, built as their conftest builds them."""
    from conftest import build_tiny_lm, build_tokenizer, qa_rows

    model_dir = folder / "tiny_lm"
    tok = build_tokenizer()
    build_tiny_lm(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    return model_dir, data


def _recorded(argv: list[str], steps: list[dict[str, Any]]) -> int:
    """``surefit <argv>`` in this process; ``steps`` receives the trainable weights after each optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from surefit.cli import main

    def record(optimizer: Any, *_: Any) -> None:
        steps.append({f"{i}.{j}": p.detach().float().cpu().clone()
                      for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])})

    handle = register_optimizer_step_post_hook(record)
    try:
        return main(argv)
    finally:
        handle.remove()


def _train(model_dir: Path, data: Path, out: Path, extra: list[str], steps: list[dict[str, Any]]) -> int:
    return _recorded(["train", "--model", str(model_dir), "--data", str(data), "--epochs", "2", "--batch_size", "4",
                      "--lora_r", "8", "--lr", "1e-2", "--max_seq_length", "128", "--lora_dropout", "0.1",
                      "--output_dir", str(out), *extra], steps)


def _train_resume(folder: Path, steps: list[dict[str, Any]]) -> int:
    return _recorded(["train", "--resume", "--output_dir", str(folder)], steps)


def _first_difference(ref: list[dict[str, Any]], other: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The first step (1-based, of the reference) where ``other`` (starting at reference step ``offset`` + 1) departs,
    and the largest difference at that step and at the end."""
    worst_at: list[float] = []
    for k, after in enumerate(other):
        before = ref[offset + k]
        worst_at.append(max(float((after[n] - before[n]).abs().max()) for n in before))
    first = next((offset + k + 1 for k, d in enumerate(worst_at) if d > 0), None)
    return {"steps_compared": len(worst_at), "first_differing_step": first,
            "max_diff_there": worst_at[first - offset - 1] if first else 0.0,
            "max_diff_last": worst_at[-1] if worst_at else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where gpu_resume_check.json goes (default: only the RESULT line)")
    args = ap.parse_args()
    import torch

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                              "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, data = _job(work)
        base = ["--val_fraction", "0.2", "--save_every", "3"]
        ref: list[dict[str, Any]] = []
        assert _train(model_dir, data, work / "reference", base, ref) == 0
        variants = {"again": base, "save_every_2": ["--val_fraction", "0.2", "--save_every", "2"],
                    "eval_every_2": [*base, "--eval_every", "2"]}
        for name, extra in variants.items():
            steps: list[dict[str, Any]] = []
            rc = _train(model_dir, data, work / name, extra, steps)
            result[name] = {"rc": rc, **_first_difference(ref, steps)}
        # What a run killed in step 5 leaves: the reference's folder with only its step-3 checkpoint, resumed.
        import shutil

        copy = work / "copy"
        shutil.copytree(work / "reference", copy)
        for p in (copy / "checkpoints").iterdir():
            if p.name != "step-0000003":
                shutil.rmtree(p)
        shutil.rmtree(copy / "final", ignore_errors=True)
        steps = []
        rc = _train_resume(copy, steps)
        result["resumed_from_step_3"] = {"rc": rc, **_first_difference(ref, steps, offset=3)}
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_resume_check.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
