"""How many aten operations one surefit optimizer step dispatches, and its CPU time: before against after a change.

Why the count: on a GPU every operation is a kernel launch (5-20 us of host time whatever its size), and surefit's
step on an H200 was bound by the host (results/h200/README.md: ~15,000 launches per step, the GPU busy 10% of it).
The number of operations per step is the same on every device (give or take the paths that differ by device, see
below), so it can be measured and cut on a CPU.

The step is the real one: ``surefit.train`` (precision bf16, LoRA r=16 / alpha 32 / dropout 0.05 on every linear layer,
batch 4, max length 384, seed 0) on the SQuAD rows of ``benchmarks/cpu_sft.py`` with the embedded SmolLM2-135M
(``--model smollm2``), or on a tiny Qwen3-shaped model (``--model tiny-qwen3``: ``gpu_small_card.qwen3_config(tiny=True)``,
random weights, the GPU job's structure in seconds). Step 1 warms up; step 2 runs under a ``TorchDispatchMode`` that
counts every aten operation by name (forward, backward, clipping, optimizer); steps 3 onward are timed with
``time.process_time`` (one thread). Each side runs in its own process with its own ``src`` first on ``sys.path``,
the two sides alternating, ``--repeats`` times; the final adapter's sha256 of both sides must agree (same numbers).

Views and other metadata-only operations (``view``, ``t``, ``slice``, ``detach``, ``empty`` ...) launch no kernel on a
GPU: they are counted apart (``metadata``). On a CPU the fused LoRA layers pack dropout masks with numpy (no aten
operation); on a GPU they take the torch path, so ``--torch-pack`` counts that path's operations too (the masks and
gradients are the same either way).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/step_ops.py --before /tmp/base/src --after src
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/step_ops.py --after src --model tiny-qwen3 --torch-pack

Writes results/step_ops.{json,md} (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METADATA = {  # operations that only make a new view or allocate: no kernel launch on a GPU
    "view", "_unsafe_view", "reshape", "alias", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "detach", "split", "split_with_sizes", "unbind", "empty", "empty_like", "empty_strided",
    "_reshape_alias", "view_as", "lift_fresh", "set_", "resize_", "is_same_size", "_has_compatible_shallow_copy_type",
    "result_type", "_local_scalar_dense", "numpy_T", "chunk", "narrow", "diagonal", "expand_as", "unfold",
}


def _op_name(func: Any) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _caller() -> str:
    """The innermost frame of surefit, transformers, peft or accelerate that dispatched the operation."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        for pkg in ("/surefit/", "/transformers/", "/peft/", "/accelerate/"):
            if pkg in fn:
                return f"{pkg.strip('/')}/{fn.split(pkg, 1)[1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def worker(args: argparse.Namespace) -> None:
    """One side: train, count step 2's operations, time the later steps; print one JSON line."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(HERE))
    import cpu_sft

    import surefit
    from surefit.training import loop

    if args.torch_pack:
        import types

        import surefit.training.speedups.lora_fast as lf

        # pack_mask / unpack_mask take the torch path (a GPU's) when they think they are being compiled.
        proxy = _TorchProxy(torch, types.SimpleNamespace(is_compiling=lambda: True))
        for fn in ("pack_mask", "unpack_mask"):
            f = getattr(lf, fn)
            setattr(lf, fn, types.FunctionType(f.__code__, {**f.__globals__, "torch": proxy}, f.__name__, f.__defaults__))

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()
            self.where: collections.Counter[tuple[str, str]] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, a: Any = (), k: Any = None) -> Any:
            name = _op_name(func)
            self.ops[name] += 1
            if args.where and (args.where_metadata or name not in METADATA):
                self.where[(name, _caller())] += 1
            return func(*a, **(k or {}))

    wd = Path(args.workdir)
    state: dict[str, Any] = {"calls": 0, "ops": None, "times": [], "where": []}
    real_step = loop._Fit.optimizer_step

    def optimizer_step(self: Any, step_indices: list[int], stop: Any) -> Any:
        state["calls"] += 1
        if state["calls"] == 2:
            mode = Count()
            with mode:
                out = real_step(self, step_indices, stop)
            state["ops"] = dict(mode.ops)
            state["where"] = [[f"{op} @ {at}", n] for (op, at), n in mode.where.most_common(args.where)]
            return out
        t0 = time.process_time()
        out = real_step(self, step_indices, stop)
        if state["calls"] > 2:
            state["times"].append(time.process_time() - t0)
        return out

    loop._Fit.optimizer_step = optimizer_step
    spec = json.loads((wd / "spec.json").read_text())
    model = spec.get("model_path")
    out = Path(tempfile.mkdtemp(dir=wd))
    surefit.train(task="sft", model=model, data=str(wd / "train.jsonl"), epochs=1, batch_size=cpu_sft.BATCH,
                  max_seq_length=cpu_sft.MAX_LEN, lora_r=cpu_sft.LORA_R, lora_alpha=cpu_sft.LORA_ALPHA,
                  lora_dropout=args.dropout, lr=cpu_sft.LR, warmup_ratio=cpu_sft.WARMUP_RATIO, seed=cpu_sft.SEED,
                  eval_generate=False, precision="bf16", val_fraction=0.0, output_dir=str(out / "run"))
    sha = hashlib.sha256((out / "run" / "final" / "adapter_model.safetensors").read_bytes()).hexdigest()
    print("STEP_OPS " + json.dumps({"ops": state["ops"], "step_seconds": state["times"], "sha256": sha,
                                    "where": state["where"],
                                    "torch": torch.__version__, "surefit": surefit.__file__}))


class _TorchProxy:
    """``torch`` as lora_fast sees it, with ``torch.compiler.is_compiling`` answering True (the torch pack path)."""

    def __init__(self, torch: Any, compiler: Any) -> None:
        self._torch, self.compiler = torch, compiler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def prepare(args: argparse.Namespace, wd: Path) -> None:
    sys.path.insert(0, str(HERE))
    import cpu_sft

    spec = cpu_sft.prepare(argparse.Namespace(shared=args.shared, rows=args.rows, val_rows=4, workload="squad"), wd)
    if args.model == "tiny-qwen3":
        import gpu_small_card

        folder = wd / "tiny-qwen3"
        gpu_small_card.build_model(folder, tiny=True)
        spec["model_path"] = str(folder)
    (wd / "spec.json").write_text(json.dumps(spec, indent=2))


def run_side(src: str, args: argparse.Namespace, wd: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--workdir", str(wd), "--dropout",
           str(args.dropout), "--where", str(args.where)] + (["--where-metadata"] if args.where_metadata else []) + (["--torch-pack"] if args.torch_pack else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("STEP_OPS ")]
    if p.returncode or not line:
        raise SystemExit(f"worker for {src} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[0][len("STEP_OPS "):])


def summary(ops: dict[str, int]) -> dict[str, Any]:
    meta = sum(n for k, n in ops.items() if k in METADATA)
    total = sum(ops.values())
    return {"total": total, "compute": total - meta, "metadata": meta,
            "top": sorted(([k, n] for k, n in ops.items() if k not in METADATA), key=lambda kv: -kv[1])[:20]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--before", default=None, help="src folder of the code before the change (optional)")
    ap.add_argument("--after", default=str(HERE.parent / "src"), help="src folder of the code after the change")
    ap.add_argument("--model", choices=("smollm2", "tiny-qwen3"), default="smollm2")
    ap.add_argument("--rows", type=int, default=24, help="training rows (batch 4: rows/4 steps; step 2 is counted)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--torch-pack", action="store_true", help="count the mask packing's torch path (a GPU's)")
    ap.add_argument("--where", type=int, default=40, help="record the N most frequent (operation, caller) pairs")
    ap.add_argument("--where-metadata", action="store_true", help="record where metadata operations come from too")
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    wd = Path(args.workdir or tempfile.mkdtemp(prefix="step_ops-"))
    wd.mkdir(parents=True, exist_ok=True)
    prepare(args, wd)
    sides = {"before": args.before, "after": args.after} if args.before else {"after": args.after}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    for r in range(args.repeats):
        for name, src in sides.items():
            res = run_side(src, args, wd)
            runs[name].append(res)
            print(f"repeat {r + 1} {name}: {sum(res['step_seconds']):.2f} CPU s over {len(res['step_seconds'])} steps, "
                  f"{sum(res['ops'].values())} ops, sha {res['sha256'][:12]}", flush=True)
    result: dict[str, Any] = {"model": args.model, "rows": args.rows, "dropout": args.dropout,
                              "torch_pack": args.torch_pack, "repeats": args.repeats, "sides": {}}
    for name, rs in runs.items():
        result["sides"][name] = {"src": sides[name], **summary(rs[0]["ops"]), "ops": rs[0]["ops"],
                                 "where": rs[0]["where"],
                                 "ops_same_every_repeat": all(x["ops"] == rs[0]["ops"] for x in rs),
                                 "step_cpu_s": [round(sum(x["step_seconds"]), 3) for x in rs],
                                 "sha256": sorted({x["sha256"] for x in rs})}
    if "before" in runs:
        ratios = [sum(b["step_seconds"]) / sum(a["step_seconds"]) for a, b in zip(runs["before"], runs["after"], strict=True)]
        result["cpu_ratio_after_over_before"] = [round(x, 3) for x in ratios]
        result["cpu_ratio_median"] = round(statistics.median(ratios), 3)
        result["same_weights"] = result["sides"]["before"]["sha256"] == result["sides"]["after"]["sha256"]
    result["command"] = " ".join(["python", "benchmarks/step_ops.py", *sys.argv[1:]])
    print(json.dumps({k: v for k, v in result.items() if k != "sides"}, indent=1))
    for name, s in result["sides"].items():
        print(name, s["total"], s["compute"], s["metadata"], s["top"][:12])
    stem = f"step_ops{'' if args.model == 'smollm2' else '_' + args.model.replace('-', '_')}"
    stem += "_torch_pack" if args.torch_pack else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / stem}.json")


if __name__ == "__main__":
    main()
