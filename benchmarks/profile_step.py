"""Where a surefit training step goes: torch.profiler (CPU) over one optimizer step on the embedded model, per workload.

The step is the real one: ``surefit.train`` on the workload's rows of ``benchmarks/cpu_sft.py`` (same model, LoRA r=16
on every linear layer, batch 4, max length 384, surefit's defaults), with the profiler switched on around one
optimizer step after a warm one. Nothing in surefit changes; the script only wraps, for the profile's labels:

- ``forward``: the loss function (the model's forward, the LM head and the cross-entropy);
- ``backward``: ``accelerator.backward``;
- ``clip``: gradient clipping; ``optimizer``: torch's own ``Optimizer.step`` / ``Optimizer.zero_grad`` ranges;
- ``rest``: the step minus those (collation, device transfer, bookkeeping).

Then every operator's self CPU time in the step goes to one kind (the first that matches, looking at the operator and
then at the operators that called it):

- ``lm_head_ce``: the fused head's function, or any operator on a tensor with a vocabulary-sized dimension (the
  unfused head's matmul, log-softmax, cross-entropy), embeddings excluded;
- ``attention``: the scaled-dot-product attention kernels, forward and backward;
- ``lora_matmuls``: matmuls with an operand of rank r (the adapters' A and B, forward and backward);
- ``base_matmuls``: every other matmul (the frozen layers');
- ``other``: the rest (elementwise, norms, casts, dropout draws, copies, optimizer arithmetic).

    .venv/bin/python benchmarks/profile_step.py                     # both workloads -> results/profile_step.{json,md}
    .venv/bin/python benchmarks/profile_step.py --quick             # smoke: fewer rows, results in a temporary folder
    .venv/bin/python benchmarks/profile_step.py --chunk-sweep       # fused head: chunk size vs time and memory
    .venv/bin/python benchmarks/profile_step.py --precision auto,fp32   # each workload in both precisions

Each result also lists the operators grouped by input shapes, dtypes, operand layouts and the autograd function
that called them (``by_shape``): which matmul shape costs what in bf16 against fp32, and where the casts are.

``--chunk-sweep`` times the fused LM head + cross-entropy (forward and backward, frozen bf16 head as under LoRA, and
a trainable fp32 one) at several chunk sizes against the unfused head, alternating in one process, with the peak RSS
each adds (the kernel's high-water mark, reset before each run); it writes results/fused_chunk_sweep.{json,md}.
Timings need a quiet machine: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402
import cpu_sft  # noqa: E402

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "aten::_addmm_activation"}
PHASES = ("forward", "backward", "clip", "optimizer")
SHAPE_ROWS = 15  # rows of the by-shape table in the markdown (the JSON keeps --top)
KINDS = ("lm_head_ce", "attention", "lora_matmuls", "base_matmuls", "other")


def _kind(ev: Any, vocab: int, rank: int) -> str:
    chain = []
    e = ev
    while e is not None:
        chain.append(e)
        e = e.cpu_parent
    for e in chain:
        name = e.name
        if "FusedLinearCrossEntropy" in name:
            return "lm_head_ce"
        if "embedding" not in name and any(vocab in (s or []) for s in (e.input_shapes or [])):
            return "lm_head_ce"
    for e in chain:
        if "scaled_dot_product" in e.name or "flash_attention" in e.name:
            return "attention"
    for e in chain:
        if e.name in MATMULS:
            shapes = [s for s in (e.input_shapes or []) if s]
            return "lora_matmuls" if any(rank in s for s in shapes) else "base_matmuls"
    return "other"


def split(prof: Any, vocab: int, rank: int) -> dict[str, Any]:
    """Phase and kind totals (ms) of the profiled step."""
    events = list(prof.events())
    total = {n: 0.0 for n in ("step", *PHASES)}
    for ev in events:
        name = ev.name
        if name == "surefit.step":
            total["step"] += ev.cpu_time_total
        elif name in ("forward", "backward", "clip"):
            total[name] += ev.cpu_time_total
        elif name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad"):
            total["optimizer"] += ev.cpu_time_total
    kinds = dict.fromkeys(KINDS, 0.0)
    inside = 0.0
    for ev in events:
        if ev.name in ("surefit.step", "forward", "backward", "clip") or ev.name.startswith("Optimizer."):
            continue  # the labels themselves: their time is their operators'
        kinds[_kind(ev, vocab, rank)] += ev.self_cpu_time_total
        inside += ev.self_cpu_time_total
    ms = {k: round(v / 1000, 1) for k, v in total.items()}
    ms["rest"] = round(max(ms["step"] - sum(ms[p] for p in PHASES), 0.0), 1)
    step = max(total["step"], 1.0)
    return {"phases_ms": ms, "phases_share": {k: round(ms[k] * 1000 / step, 3) for k in (*PHASES, "rest")},
            "kinds_ms": {k: round(v / 1000, 1) for k, v in kinds.items()},
            "kinds_share": {k: round(v / max(inside, 1.0), 3) for k, v in kinds.items()},
            "operators_self_ms": round(inside / 1000, 1)}


def _layout(shape: Any, stride: Any) -> str:
    """``T`` for a 2-D operand that is a transposed view (column-major), ``N`` for row-major, ``-`` otherwise."""
    if not shape or not stride or len(shape) != 2 or len(stride) != 2:
        return "-"
    return "T" if stride[0] == 1 and shape[1] > 1 else "N"


def by_shape(prof: Any, top: int) -> list[dict[str, Any]]:
    """Operators' self time grouped by (name, input shapes, dtypes, operand layouts, caller), largest first."""
    groups: dict[tuple, list[float]] = {}
    for ev in prof.events():
        if ev.name in ("surefit.step", "forward", "backward", "clip") or ev.name.startswith("Optimizer."):
            continue
        shapes = [list(s) for s in (ev.input_shapes or []) if s]
        dtypes = [d for d in (getattr(ev, "input_dtypes", None) or []) if d]
        strides = getattr(ev, "structured_input_strides", None) or []
        layouts = "".join(_layout(sh, st) for sh, st in zip(ev.input_shapes or [], strides, strict=False) if sh)
        parent = ev.cpu_parent
        while parent is not None and parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        key = (ev.name, str(shapes), ",".join(dtypes), layouts, parent.name if parent is not None else "")
        acc = groups.setdefault(key, [0.0, 0])
        acc[0] += ev.self_cpu_time_total
        acc[1] += 1
    rows = sorted(groups.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return [{"name": k[0], "shapes": k[1], "dtypes": k[2], "layouts": k[3], "caller": k[4],
             "self_ms": round(v[0] / 1000, 1), "calls": int(v[1])} for k, v in rows]


def profile_workload(workload: str, rows: int, step_no: int, workdir: Path, top: int,
                     precision: str = "auto") -> dict[str, Any]:
    """Train on the workload's rows and profile optimizer step ``step_no`` (1-based); returns its split."""
    import accelerate
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import surefit
    import surefit.tasks.sft.train_sft as sft
    from surefit.training import loop

    wd = workdir / f"{workload}-{precision}"
    wd.mkdir(parents=True, exist_ok=True)
    spec = cpu_sft.prepare(argparse.Namespace(shared=str(HERE.parent.parent / "shared" / "data"), rows=rows,
                                              val_rows=4, workload=workload), wd)
    state: dict[str, Any] = {"calls": 0, "prof": None, "batch": None}
    real_step, real_loss = loop._Fit.optimizer_step, sft.causal_lm_loss_sum
    real_backward, real_clip = accelerate.Accelerator.backward, accelerate.Accelerator.clip_grad_norm_

    def optimizer_step(self: Any, step_indices: list[int], stop: Any) -> Any:
        state["calls"] += 1
        if state["calls"] != step_no:
            return real_step(self, step_indices, stop)
        state["batch"] = {"examples": len(step_indices), "tokens": sum(self.lengths[i] for i in step_indices),
                          "supervised": sum(self.counts[i] for i in step_indices),
                          "padded": len(step_indices) * max(self.lengths[i] for i in step_indices)}
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with record_function("surefit.step"):
                out = real_step(self, step_indices, stop)
        state["prof"] = prof
        return out

    def loss_fn(*a: Any, **k: Any) -> Any:
        with record_function("forward"):
            return real_loss(*a, **k)

    def backward(self: Any, *a: Any, **k: Any) -> Any:
        with record_function("backward"):
            return real_backward(self, *a, **k)

    def clip(self: Any, *a: Any, **k: Any) -> Any:
        with record_function("clip"):
            return real_clip(self, *a, **k)

    loop._Fit.optimizer_step, sft.causal_lm_loss_sum = optimizer_step, loss_fn
    accelerate.Accelerator.backward, accelerate.Accelerator.clip_grad_norm_ = backward, clip
    try:
        result = surefit.train(task="sft", data=str(wd / "train.jsonl"), val_data=str(wd / "val.jsonl"), epochs=1,
                               batch_size=cpu_sft.BATCH, max_seq_length=cpu_sft.MAX_LEN, lora_r=cpu_sft.LORA_R,
                               lora_alpha=cpu_sft.LORA_ALPHA, lora_dropout=cpu_sft.LORA_DROPOUT, lr=cpu_sft.LR,
                               warmup_ratio=cpu_sft.WARMUP_RATIO, seed=cpu_sft.SEED, eval_generate=False, precision=precision,
                               output_dir=str(wd / "run"))
    finally:
        loop._Fit.optimizer_step, sft.causal_lm_loss_sum = real_step, real_loss
        accelerate.Accelerator.backward, accelerate.Accelerator.clip_grad_norm_ = real_backward, real_clip
    prof = state["prof"]
    if prof is None:
        raise SystemExit(f"{workload}: the run had fewer than {step_no} optimizer steps; raise --rows")
    vocab = int(json.loads((Path(spec["model_path"]) / "config.json").read_text())["vocab_size"])
    out = split(prof, vocab, cpu_sft.LORA_R)
    ops = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    plan = json.loads((wd / "run" / "memory_plan.json").read_text()) if (wd / "run" / "memory_plan.json").is_file() else {}
    return {"workload": workload, "source": cpu_sft.WORKLOADS[workload], "step": step_no, "batch": state["batch"],
            "precision": plan.get("precision"), "train_loss": result.history[-1].get("train_loss"), **out,
            "top_operators": [{"name": a.key, "self_ms": round(a.self_cpu_time_total / 1000, 1), "calls": a.count}
                              for a in ops],
            "by_shape": by_shape(prof, top),
            "torch_threads": torch.get_num_threads()}


def report(results: list[dict[str, Any]], machine: dict[str, Any], started: str, command: str) -> list[str]:
    md = ["# profile_step: where one surefit training step goes", "",
          f"One optimizer step of `surefit train` (defaults; embedded SmolLM2-135M-Instruct, LoRA r={cpu_sft.LORA_R} on "
          f"q, k, v, o, gate, up, down, batch {cpu_sft.BATCH}, max length {cpu_sft.MAX_LEN}), after a warm one, under "
          f"torch.profiler (CPU). Run on {started}.", "",
          "| workload | batch (examples / tokens / supervised / padded) | precision | step ms | forward | backward | "
          "clip | optimizer | rest |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, p, s = r["batch"], r["phases_ms"], r["phases_share"]
        md.append(f"| {r['workload']} | {b['examples']} / {b['tokens']} / {b['supervised']} / {b['padded']} | "
                  f"{r['precision']} | {p['step']:.0f} | " + " | ".join(f"{p[k]:.0f} ({s[k]:.0%})"
                                                                         for k in (*PHASES, "rest")) + " |")
    md += ["", "Operators' own CPU time in the step, by kind (shares of all operators' self time):", "",
           "| workload | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for r in results:
        md.append(f"| {r['workload']} | " + " | ".join(f"{r['kinds_ms'][k]:.0f} ms ({r['kinds_share'][k]:.0%})"
                                                       for k in KINDS) + " |")
    for r in results:
        md += ["", f"Top operators ({r['workload']}, self time): " + ", ".join(
            f"`{o['name']}` {o['self_ms']:.0f} ms x{o['calls']}" for o in r["top_operators"][:12]) + "."]
    for r in results:
        if not r.get("by_shape"):
            continue
        md += ["", f"Largest operators by shape ({r['workload']}, {r['precision']}): self time, calls, input shapes, dtypes, "
               "layouts of 2-D operands (N row-major, T a transposed view), the autograd function or range that called "
               "it:", "", "| self ms | calls | operator | shapes | dtypes | layouts | caller |", "|---|---|---|---|---|---|---|"]
        md += [f"| {b['self_ms']:.0f} | {b['calls']} | `{b['name']}` | {b['shapes']} | {b['dtypes']} | {b['layouts']} | "
               f"{b['caller']} |" for b in r["by_shape"][:SHAPE_ROWS]]
    md += ["", "Kinds: `lm_head_ce` = the fused head's function or any operator on a vocabulary-sized tensor; "
           "`attention` = SDPA kernels; `lora_matmuls` = matmuls with a rank-r operand; `base_matmuls` = the other "
           "matmuls; `other` = elementwise, norms, casts, dropout, copies, optimizer arithmetic. Phases: `forward` "
           "= the loss function, `backward` = accelerator.backward, `optimizer` = torch's Optimizer.step / zero_grad "
           "ranges, `rest` = the step minus those (collation, transfers, bookkeeping). Profiling adds overhead per "
           "operator, so shares are more trustworthy than absolute times.", "",
           *benchlib.machine_lines(machine, [], []), "", f"Command: `{command}`", ""]
    return md


# ------------------------------------------------------------------------------------------------- chunk sweep


def chunk_sweep(tokens: int, repeats: int) -> tuple[dict[str, Any], list[str]]:
    """Fused head + loss at several chunk sizes vs the unfused head, forward + backward, alternating in one process."""
    import torch
    import torch.nn.functional as F

    from surefit.training.speedups.fused_head import fused_linear_cross_entropy

    vocab, hidden = 49152, 576  # SmolLM2-135M's head
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(tokens, hidden, generator=g)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    cases: dict[str, Any] = {}
    for label, wdtype, trainable, bf16 in (("LoRA: frozen bf16 head, bf16 autocast", torch.bfloat16, False, True),
                                           ("full fine-tuning: trainable fp32 head, fp32", torch.float32, True, False)):
        w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(wdtype).requires_grad_(trainable)

        def run(chunk: int | None, w: Any = w, bf16: bool = bf16) -> None:
            h = h0.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                if chunk is None:
                    loss = F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum")
                else:
                    loss = fused_linear_cross_entropy(h, w, None, targets, chunk_values=chunk)
            loss.backward()
            w.grad = None

        settings: dict[str, int | None] = {"unfused": None, **{f"2^{k}": 2**k for k in (20, 21, 22, 23, 24, 26)}}
        times: dict[str, list[float]] = {k: [] for k in settings}
        peaks: dict[str, list[float]] = {k: [] for k in settings}
        for chunk in settings.values():
            run(chunk)  # warm
        for _ in range(repeats):
            for name, chunk in settings.items():
                base = benchlib._vm_hwm_mb()
                Path("/proc/self/clear_refs").write_text("5")
                rss0 = _rss_mb()
                t0 = time.perf_counter()
                run(chunk)
                times[name].append(time.perf_counter() - t0)
                peaks[name].append((benchlib._vm_hwm_mb() or 0) - rss0 if base is not None else float("nan"))
        ref = statistics.median(times["unfused"])
        cases[label] = {name: {"tokens_per_chunk": (None if c is None else max(8, c // vocab)),
                               "median_s": round(statistics.median(times[name]), 4),
                               "best_s": round(min(times[name]), 4),
                               "time_vs_unfused": round(statistics.median(times[name]) / ref, 3),
                               "peak_added_mb": round(statistics.median(peaks[name]), 1)}
                        for name, c in settings.items()}
    md = [f"# Fused LM head + cross-entropy: chunk size sweep ({tokens} supervised tokens, vocabulary {vocab}, "
          f"hidden {hidden})", "", "Forward + backward, alternating in one process, median of "
          f"{repeats}; `peak added` = the process's peak RSS above its RSS before the run.", ""]
    for label, rows in cases.items():
        md += [f"## {label}", "", "| chunk (values) | tokens per chunk | median s | vs unfused | peak added MB |",
               "|---|---|---|---|---|"]
        md += [f"| {n} | {r['tokens_per_chunk'] or 'all'} | {r['median_s']:.3f} | {r['time_vs_unfused']:.2f}x | "
               f"{r['peak_added_mb']:.0f} |" for n, r in rows.items()]
        md.append("")
    return {"tokens": tokens, "vocab": vocab, "hidden": hidden, "repeats": repeats, "cases": cases}, md


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="squad,chat", help="comma-separated: squad, chat (default both)")
    ap.add_argument("--rows", type=int, default=None, help="training rows per workload (default 16; --quick 8)")
    ap.add_argument("--step", type=int, default=2, help="which optimizer step to profile (1-based; default 2)")
    ap.add_argument("--top", type=int, default=25, help="operators listed in the JSON")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 rows, results in the work folder")
    ap.add_argument("--chunk-sweep", action="store_true", help="the fused head's chunk size vs time and memory")
    ap.add_argument("--tokens", type=int, default=1024, help="--chunk-sweep: supervised tokens (default 1024)")
    ap.add_argument("--repeats", type=int, default=5, help="--chunk-sweep: rounds (default 5; --quick 1)")
    ap.add_argument("--precision", default="auto", help="comma-separated: auto, fp32, bf16 (default auto)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: work folder)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="profile_step-"))
    out = Path(args.out) if args.out else (workdir if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    machine = benchlib.machine_info()
    if args.chunk_sweep:
        record, md = chunk_sweep(256 if args.quick else args.tokens, 1 if args.quick else args.repeats)
        stem = "fused_chunk_sweep"
        record = {"benchmark": stem, "started": started, "machine": machine, **record}
    else:
        rows = args.rows or (8 if args.quick else 16)
        results = [profile_workload(w.strip(), rows, args.step, workdir, args.top, prec.strip())
                   for w in args.workload.split(",") if w.strip() for prec in args.precision.split(",")]
        command = (f".venv/bin/python benchmarks/profile_step.py --workload {args.workload} --rows {rows} "
                   f"--step {args.step} --precision {args.precision}" + (" --quick" if args.quick else ""))
        md = report(results, machine, started, command)
        stem = "profile_step"
        record = {"benchmark": stem, "started": started, "machine": machine, "command": command, "results": results}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))
    print(f"wrote {out / (stem + '.md')} and .json")


if __name__ == "__main__":
    main()
