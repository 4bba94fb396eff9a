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
GPU: they are counted apart (``metadata``). The fused LoRA layers take other paths on a CPU than elsewhere: numpy packs
their dropout masks (no aten operation) and the masks are cast before a product. ``--gpu-paths`` takes a GPU's paths on
the CPU (masks packed by torch operations, products with the boolean mask) to count what a GPU launches; the masks
and gradients are the same either way (tests/training/test_lora_fast.py).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/step_ops.py --before /tmp/base/src --after src
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/step_ops.py --before /tmp/base/src --after src \
        --model tiny-qwen3 --layers 28 --gpu-paths --repeats 1 --rows 16     # the H200 job's structure
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/step_ops.py --report results/step_ops.json ...  # the markdown

``--before`` is a ``src`` folder of the code to compare with (e.g. ``git archive HEAD~3 src | tar -x -C /tmp/base``).
Writes results/step_ops.{json,md} (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import resource
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


def masks_worker(args: argparse.Namespace) -> None:
    """``--masks``: CPU seconds of the keyed dropout masks of one SmolLM2-135M micro-batch (30 layers: q, k, v, o, gate,
    up on [4, 287, 576], down on [4, 287, 1536]; p 0.05), each micro-batch new (its salted keys computed anew)."""
    from surefit.training.dropout import SeededDropout, training_rows

    mods = []
    for i in range(30):
        for name, width in (("self_attn.q_proj", 576), ("self_attn.k_proj", 576), ("self_attn.v_proj", 576),
                            ("self_attn.o_proj", 576), ("mlp.gate_proj", 576), ("mlp.up_proj", 576),
                            ("mlp.down_proj", 1536)):
            mods.append((SeededDropout(0.05, name=f"model.layers.{i}.{name}.lora_dropout.default").train(), width))
    times = []
    for step in range(args.mask_steps + 1):
        t0 = time.process_time()
        with training_rows(0, step, [3, 17, 5, 40]):
            for m, width in mods:
                m.keep((4, 287, width), "cpu")
        if step:  # the first one warms up
            times.append(time.process_time() - t0)
    print("STEP_OPS " + json.dumps({"mask_seconds": times}))


def worker(args: argparse.Namespace) -> None:
    """One side: train, count step 2's operations, time the later steps; print one JSON line."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(HERE))
    import cpu_sft

    import surefit
    from surefit.training import loop

    if args.gpu_paths:
        import types

        import surefit.training.speedups.lora_fast as lf

        if hasattr(lf, "CAST_MASKS_ON"):  # products take the boolean mask as it is, as off the CPU
            lf.CAST_MASKS_ON = set()
        import surefit.training.dropout as dropout

        if hasattr(dropout, "CONTIGUOUS_WORDS_ON"):  # the keyed masks compare strided words, as off the CPU
            dropout.CONTIGUOUS_WORDS_ON = set()
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
    state: dict[str, Any] = {"calls": 0, "ops": None, "times": [], "where": [], "faults": [], "sys": []}
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
        t0, r0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        out = real_step(self, step_indices, stop)
        if state["calls"] > 2:
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            state["times"].append(time.process_time() - t0)
            state["faults"].append(r1.ru_minflt - r0.ru_minflt)
            state["sys"].append(round(r1.ru_stime - r0.ru_stime, 3))
        return out

    loop._Fit.optimizer_step = optimizer_step
    spec = json.loads((wd / "spec.json").read_text())
    model = spec.get("model_path")
    out = Path(tempfile.mkdtemp(dir=wd))
    surefit.train(task="sft", model=model, data=str(wd / "train.jsonl"), epochs=1, batch_size=cpu_sft.BATCH,
                  max_seq_length=cpu_sft.MAX_LEN, lora_r=cpu_sft.LORA_R, lora_alpha=cpu_sft.LORA_ALPHA,
                  lora_dropout=args.dropout, lr=cpu_sft.LR, warmup_ratio=cpu_sft.WARMUP_RATIO, seed=cpu_sft.SEED,
                  eval_generate=False, precision=args.precision, val_fraction=0.0, output_dir=str(out / "run"))
    sha = hashlib.sha256((out / "run" / "final" / "adapter_model.safetensors").read_bytes()).hexdigest()
    print("STEP_OPS " + json.dumps({"ops": state["ops"], "step_seconds": state["times"], "sha256": sha,
                                    "minor_faults": state["faults"], "sys_seconds": state["sys"],
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

    spec = cpu_sft.prepare(argparse.Namespace(shared=args.shared, rows=args.rows, val_rows=4, workload=args.workload),
                          wd)
    if args.model == "tiny-qwen3":
        import gpu_small_card
        import torch
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        folder = wd / f"tiny-qwen3-{args.layers}"
        cfg = gpu_small_card.qwen3_config(tiny=True)
        cfg.num_hidden_layers = args.layers
        cfg.layer_types = [cfg.layer_types[0]] * args.layers
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        tok = AutoTokenizer.from_pretrained(spec["model_path"])  # the embedded SmolLM2's, as gpu_small_card's default
        model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        spec["model_path"] = str(folder)
    (wd / "spec.json").write_text(json.dumps(spec, indent=2))


def run_side(src: str, args: argparse.Namespace, wd: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--workdir", str(wd), "--dropout",
           str(args.dropout), "--precision", args.precision, "--where", str(args.where)] + (["--where-metadata"] if args.where_metadata else []) + (["--gpu-paths"] if args.gpu_paths else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("STEP_OPS ")]
    if p.returncode or not line:
        raise SystemExit(f"worker for {src} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[0][len("STEP_OPS "):])


def masks_ab(args: argparse.Namespace) -> None:
    """Before against after, alternating processes: median CPU seconds of one micro-batch's keyed masks."""
    sides = {"before": args.before, "after": args.after} if args.before else {"after": args.after}
    res: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.repeats):
        for name, src in sides.items():
            env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS="1")
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--masks", "--mask-steps",
                                str(args.mask_steps)], env=env, capture_output=True, text=True, check=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("STEP_OPS ")][0]
            res[name].append(statistics.median(json.loads(line[len("STEP_OPS "):])["mask_seconds"]))
    out = {"masks_micro_batch_cpu_s": {k: [round(x, 4) for x in v] for k, v in res.items()},
           "command": " ".join(["python", "benchmarks/step_ops.py", *sys.argv[1:]])}
    if "before" in res:
        ratios = [b / a for a, b in zip(res["before"], res["after"], strict=True)]
        out["ratio_after_over_before"] = [round(x, 3) for x in ratios]
        out["ratio_median"] = round(statistics.median(ratios), 3)
    print(json.dumps(out, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_ops_masks.json").write_text(json.dumps(out, indent=1) + "\n")


def summary(ops: dict[str, int]) -> dict[str, Any]:
    meta = sum(n for k, n in ops.items() if k in METADATA)
    total = sum(ops.values())
    return {"total": total, "compute": total - meta, "metadata": meta,
            "top": sorted(([k, n] for k, n in ops.items() if k not in METADATA), key=lambda kv: -kv[1])[:20]}


def report(results: list[dict[str, Any]], machine: dict[str, Any], started: str) -> list[str]:
    """The markdown of one or more results (one per model / packing path)."""
    import benchlib

    md = ["# step_ops: aten operations per surefit optimizer step, and its CPU time", "",
          f"Run on {started}. One optimizer step of `surefit.train` (forward, backward, clipping, optimizer; precision "
          f"{results[0].get('precision', 'bf16')}, LoRA r=16 / alpha 32 on q, k, v, o, gate, up, down, batch 4, SQuAD rows of `cpu_sft.py`, seed 0), "
          "counted by a `TorchDispatchMode` at step 2; `compute` = operations that launch a kernel on a GPU, "
          "`metadata` = views, detaches and allocations. CPU seconds: `time.process_time` of steps 3 onward, one "
          "thread, the two sides alternating in fresh processes; the ratio is per repeat (after / before).", ""]
    md += ["| run | compute operations before | after | all operations before | after | CPU time after / before |",
           "|---|---|---|---|---|---|"]
    for r in results:
        if "sides" in r and "before" in r["sides"]:
            b, a = r["sides"]["before"], r["sides"]["after"]
            paths = "a GPU's paths" if r["gpu_paths"] else "the CPU's paths"
            cpu = "-" if r["gpu_paths"] else f"{r['cpu_ratio_median']:.3f} (median of {r['repeats']})"
            layers = f" ({r['layers']} layers)" if r.get("layers") else ""
            md.append(f"| {r['model']}{layers}, "
                      f"{r['rows']} rows, {paths} | {b['compute']:,} | {a['compute']:,} ({a['compute'] / b['compute']:.2f}x) | "
                      f"{b['total']:,} | {a['total']:,} | {cpu} |")
        elif "ratio_median" in r:
            md.append(f"| the keyed masks of one micro-batch alone | | | | | {r['ratio_median']:.3f} (median of "
                      f"{len(r['ratio_after_over_before'])}) |")
    md.append("")
    for r in results:
        if "masks_micro_batch_cpu_s" in r:
            t = r["masks_micro_batch_cpu_s"]
            md += ["## The keyed masks alone", "",
                   "CPU seconds of the keyed dropout masks of one SmolLM2-135M micro-batch (210 masks: q, k, v, o, gate, "
                   "up on [4, 287, 576], down on [4, 287, 1536]), median of 10 micro-batches per process, the two "
                   "sides alternating:", "", "| code | per repeat |", "|---|---|"]
            md += [f"| {k} | {', '.join(f'{x:.3f}' for x in v)} |" for k, v in t.items()]
            if "ratio_median" in r:
                md += ["", f"After / before: median {r['ratio_median']:.3f} (per repeat "
                       f"{', '.join(f'{x:.3f}' for x in r['ratio_after_over_before'])})."]
            md += ["", f"Command: `{r['command']}`", ""]
            continue
        sides = r["sides"]
        model = r["model"] + (f" ({r['layers']} layers)" if r.get("layers") else "") + f", {r['rows']} rows"
        title = f"{model}, dropout {r['dropout']}" + (", the fused LoRA's GPU paths (masks packed by torch operations, "
                                                     "products with the boolean mask)" if r["gpu_paths"] else
                                                     ", the fused LoRA's CPU paths (masks packed by numpy)")
        md += [f"## {title}", "", "| code | operations | compute | metadata | CPU s, steps 3+ (per repeat) | adapter sha256 |",
               "|---|---|---|---|---|---|"]
        for name, s in sides.items():
            md.append(f"| {name} | {s['total']:,} | {s['compute']:,} | {s['metadata']:,} | "
                      f"{', '.join(f'{x:.2f}' for x in s['step_cpu_s'])} | `{s['sha256'][0][:16]}`"
                      f"{'' if len(s['sha256']) == 1 else ' (varied!)'} |")
        if r.get("gpu_paths"):
            md += ["", "(These CPU seconds measure nothing a GPU does: its paths are slower on a CPU, which is why the CPU "
                   "keeps its own.)"]
        elif "cpu_ratio_median" in r:
            md += ["", f"CPU time after / before: median {r['cpu_ratio_median']:.3f} (per repeat "
                   f"{', '.join(f'{x:.3f}' for x in r['cpu_ratio_after_over_before'])}); same final adapter: "
                   f"{'yes' if r['same_weights'] else 'NO'}."]
        names = list(sides)
        kinds = sorted({k for s in sides.values() for k, _ in s["top"][:16]},
                       key=lambda k: -max(s["ops"].get(k, 0) for s in sides.values()))
        md += ["", "Compute operations by kind:", "", "| operation | " + " | ".join(names) + " |",
               "|---|" + "---|" * len(names)]
        md += [f"| `{k}` | " + " | ".join(f"{sides[n]['ops'].get(k, 0):,}" for n in names) + " |" for k in kinds]
        last = sides[names[-1]]
        if last.get("where"):
            md += ["", f"Where the {names[-1]} code's most frequent compute operations come from (operation @ the "
                   "innermost surefit / transformers / peft / accelerate frame; builtin backward formulas show as "
                   "accelerate's `backward` call):", ""]
            md += [f"- `{w}` x{n}" for w, n in last["where"][:25]]
        md += ["", f"Command: `{r['command']}`", ""]
    md += [*benchlib.machine_lines(machine, [], []), ""]
    return md


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
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32", "auto"],
                    help="the run's --precision (fp32: the fused LoRA's fp32 path; bf16 is emulated without AVX-512 BF16)")
    ap.add_argument("--gpu-paths", action="store_true",
                    help="take the fused LoRA's GPU paths on the CPU: masks packed by torch operations, bool mask products")
    ap.add_argument("--layers", type=int, default=2, help="tiny-qwen3's decoder layers (28: Qwen3-0.6B's structure)")
    ap.add_argument("--where", type=int, default=40, help="record the N most frequent (operation, caller) pairs")
    ap.add_argument("--where-metadata", action="store_true", help="record where metadata operations come from too")
    ap.add_argument("--report", nargs="+", default=None, help="write step_ops.md from these result JSON files")
    ap.add_argument("--masks", action="store_true", help="time the keyed masks of one micro-batch only (no training)")
    ap.add_argument("--mask-steps", type=int, default=10)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--workload", default="squad", choices=["squad", "chat"], help="cpu_sft.py's rows to train on")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if args.worker:
        (masks_worker if args.masks else worker)(args)
        return
    if args.report:
        sys.path.insert(0, str(HERE))
        import benchlib

        results = [json.loads(Path(f).read_text()) for f in args.report]
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        (Path(args.out) / "step_ops.md").write_text("\n".join(report(results, benchlib.machine_info(), started)))
        print(f"wrote {Path(args.out) / 'step_ops.md'}")
        return
    if args.masks:
        masks_ab(args)
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
                  f"{sum(res['ops'].values())} ops, sha {res['sha256'][:12]}; per step "
                  f"{[round(t, 2) for t in res['step_seconds']]} s, system {res['sys_seconds']} s, "
                  f"minor faults {res['minor_faults']}", flush=True)
    result: dict[str, Any] = {"model": args.model, "rows": args.rows, "dropout": args.dropout, "precision": args.precision,
                              "gpu_paths": args.gpu_paths, "layers": args.layers if args.model == "tiny-qwen3" else None, "repeats": args.repeats, "sides": {}}
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
    stem += f"_{args.layers}layers" if args.model == "tiny-qwen3" and args.layers != 2 else ""
    stem += "_gpu_paths" if args.gpu_paths else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / stem}.json")


if __name__ == "__main__":
    main()
