"""A finished sft run's evaluation (``surefit eval``: the validation loss in the prompts' forward, then the answers)
with each batch's prompts prefilled whole (before) against in parts of similar length (after, the default since
2026-12-03: ``data/collate.length_parts``), alternating in one process after a warm-up.

Why: generation prefills the prompts of a decode batch, sorted longest first, in parts of up to ``--eval_batch_size``;
with 8 validation rows there was one part, padded to its longest prompt. On SQuAD rows of 107-231 prompt tokens that
computed 1,936 tokens for 1,238 real ones, and the prompts' forward is most of an evaluation on a CPU.

    python benchmarks/cpu_sft.py --rows 64 --workload squad --only surefit --keep --workdir /tmp/squad
    python benchmarks/prefill_parts.py --run /tmp/squad/run-surefit --repeats 4 --out results/epyc_zen4/prefill_parts

Writes OUT.json (each repeat's seconds, eval loss and metrics, the forwards and padded tokens of the prompts) and OUT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a finished sft run folder")
    ap.add_argument("--repeats", type=int, default=4, help="evaluations per side, alternating")
    ap.add_argument("--out", default=None, help="results path without extension (default: print only)")
    args = ap.parse_args()

    import surefit.eval.generate as generate
    import surefit.tasks.sft.train_sft as recipe
    import surefit.tasks.sft.use_sft as use
    from surefit.cli import main as cli

    side = {"by_length": True}
    counted: dict[str, int] = {"parts": 0, "padded": 0}
    real_generate, real_parts, real_evaluate = recipe.greedy_generate, generate._prefill_parts, use.evaluate_examples

    def greedy(model: Any, prompts: Any, decode: Any, **kw: Any) -> Any:
        return real_generate(model, prompts, dataclasses.replace(decode, prefill_by_length=side["by_length"]), **kw)

    def parts(prompts: Any, shared: Any, feats: Any, how: Any) -> Any:
        runs = real_parts(prompts, shared, feats, how)
        tails = [0] * len(prompts) if feats is None else [len(f["input_ids"]) - len(p) for p, f in zip(prompts, feats)]
        counted["parts"] += len(runs)
        counted["padded"] += sum((e - s) * (max(map(len, prompts[s:e])) + max(tails[s:e])) for s, e in runs)
        return runs

    results: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}

    def evaluate(*a: Any, **k: Any) -> Any:
        out = real_evaluate(*a, **k)  # warm-up
        for i in range(2 * args.repeats):
            side["by_length"] = bool(i % 2)
            counted.update(parts=0, padded=0)
            t0, c0 = time.perf_counter(), time.process_time()
            out = real_evaluate(*a, **k)
            results["after" if side["by_length"] else "before"].append({
                "seconds": round(time.perf_counter() - t0, 3), "cpu_seconds": round(time.process_time() - c0, 3),
                "metrics": out[0], "prompt_forwards": counted["parts"], "padded_tokens": counted["padded"]})
        return out

    recipe.greedy_generate, generate._prefill_parts, use.evaluate_examples = greedy, parts, evaluate
    sys.argv = ["surefit", "eval", "--run", args.run]
    cli()
    summary = {k: {"median_seconds": statistics.median(r["seconds"] for r in v),
                   "seconds": [r["seconds"] for r in v], "padded_tokens": v[0]["padded_tokens"],
                   "prompt_forwards": v[0]["prompt_forwards"], "metrics": v[0]["metrics"]} for k, v in results.items()}
    record = {"benchmark": "prefill_parts", "run": args.run, "repeats": args.repeats, "summary": summary,
              "results": results, "machine": {"cpu": platform.processor() or platform.machine(),
                                               "cores": os.cpu_count(), "load_average": os.getloadavg()}}
    print(json.dumps(summary, indent=1))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        b, a = summary["before"], summary["after"]
        lines = ["# Prompts prefilled whole against in parts of similar length", "",
                 f"`python benchmarks/prefill_parts.py --run {args.run} --repeats {args.repeats}`: `surefit eval` of "
                 "the run, the two sides alternating in one process after a warm-up, torch's default threads; load "
                 f"average at the end {os.getloadavg()[0]:.2f}.", "",
                 "| side | median s | each s | prompts' forwards | tokens computed (padding included) | metrics |",
                 "|---|---|---|---|---|---|"]
        for name, s in (("before (whole)", b), ("after (parts by length)", a)):
            shown = ", ".join(f"{k} {v:.4f}" for k, v in s["metrics"].items())
            lines.append(f"| {name} | {s['median_seconds']:.2f} | {', '.join(f'{x:.2f}' for x in s['seconds'])} | "
                         f"{s['prompt_forwards']} | {s['padded_tokens']:,} | {shown} |")
        lines += ["", f"After / before: {a['median_seconds'] / b['median_seconds']:.2f}x the time (medians)."]
        out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
