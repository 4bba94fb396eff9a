"""Where a surefit GPU run's steps go: per-step wall times, the set-up peak against the training peak, and a
torch.profiler table of two steps. The companion of gpu_sft.py / gpu_small_card.py when their numbers need a cause.

    python benchmarks/gpu_profile.py --shared ../shared/data --job sft        # gpu_sft.py's job (batch 8, 256 rows)
    python benchmarks/gpu_profile.py --job small --quantize 4bit              # gpu_small_card.py's (batch 4, 3.8 GB)
    python benchmarks/gpu_profile.py --tiny                                   # smoke test, CPU is fine

Nothing in surefit changes: a global optimizer-step hook (``torch.optim``'s, which every optimizer calls) marks each
step's end (after a device synchronisation), reads the peak allocated memory before the first step (loading, the
doctor, the planner) and resets it, and drives the profiler's schedule (steps 4 and 5, after a warm-up). Prints one
JSON line ``RESULT {...}`` and writes ``profile_<job>_<quantize>.txt`` (the operator table) where ``--out`` says.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_small_card import CAP_GB, build_model, cap_memory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--job", choices=("sft", "small"), default="sft")
    ap.add_argument("--quantize", choices=("none", "4bit"), default="none")
    ap.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer files (default: the embedded model's)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and 16 rows: checks the script runs")
    ap.add_argument("--attention", choices=("surefit", "torch"), default="surefit",
                    help="attention kernel order while training: surefit's (flash, efficient, cuDNN) or torch's own")
    ap.add_argument("--norm", choices=("torch", "transformers"), default="torch",
                    help="RMSNorm forward: torch's rms_norm (surefit's default: fused on a GPU) or transformers' own")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps (0: the whole epoch)")
    ap.add_argument("--out", help="where the operator table goes (default: a temporary folder)")
    args = ap.parse_args()

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    import surefit
    import surefit.training.precision as precision

    if args.attention == "torch":
        precision.ATTENTION_ORDER = None
    if args.norm == "transformers":
        import surefit.training.speedups.lora_fast as lora_fast

        lora_fast.FUSED_RMS_NORM = False
    cuda = torch.cuda.is_available()
    small = args.job == "small"
    rows, batch = (16, 4) if args.tiny else ((64, 4) if small else (256, 8))
    marks: list[float] = []
    memory: dict[str, float] = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=2, warmup=1, active=2, repeat=1))

    def pre(_opt, _a, _k) -> None:
        if not marks:  # everything before step 1: loading, the doctor, the planner, the epoch-0 evaluation
            if cuda:
                torch.cuda.synchronize()
                memory["setup_peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                torch.cuda.reset_peak_memory_stats()
            marks.append(time.perf_counter())

    def post(_opt, _a, _k) -> None:
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        prof.step()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build_model(folder, args.tiny, args.tokenizer)
        device = cap_memory() if small else (torch.cuda.get_device_name(0) if cuda else "cpu")
        register_optimizer_step_pre_hook(pre)
        register_optimizer_step_post_hook(post)
        data = str(Path(args.shared) / "squad" / "dev-v1.1-part-a.json")
        t0 = time.perf_counter()
        with prof:
            result = surefit.train(task="sft", model=str(folder), data=data, limit=rows, epochs=1, batch_size=batch,
                                   max_seq_length=512, lora_r=16, lora_alpha=32, lora_dropout=0.05, lr=2e-4, seed=0,
                                   precision="bf16", quantize=args.quantize, val_fraction=0.1,
                                   gpu_memory_gb=str(CAP_GB) if small and cuda else None,
                                   max_steps=args.steps or None, output_dir=str(Path(tmp) / "run"), overwrite=True)
        total = time.perf_counter() - t0
        plan = json.loads((Path(tmp) / "run" / "memory_plan.json").read_text(encoding="utf-8"))
    # marks[0] is step 1's optimizer call, so the first whole step is marks[1] -> marks[2]
    steps = [round(b - a, 4) for a, b in zip(marks[1:], marks[2:], strict=False)]
    if cuda:
        memory["training_peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{args.job}_{args.quantize}_{args.attention}_{args.norm}.txt").write_text(table + "\n\n" + cpu_table + "\n", encoding="utf-8")
    epoch = result.history[-1]
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
    kernels = {e.key: e.count for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::_")}
    print("RESULT " + json.dumps({
        "job": args.job, "quantize": args.quantize, "attention": args.attention, "norm": args.norm, "device": device, "rows": rows, "batch": batch,
        "whole_s": round(total, 1), "to_step1_optimizer_s": round(marks[0] - t0, 1) if marks else None, "time_per_epoch": round(epoch["time_per_epoch"], 2), "steps": len(steps),
        "attention_ops": kernels, "launches_2_steps": launches, "step_s": steps, "median_step_s": sorted(steps)[len(steps) // 2] if steps else None, **memory,
        "plan": {k: plan.get(k) for k in ("micro_batch_size", "grad_accum", "gradient_checkpointing", "frozen_dtype",
                                            "quantized", "estimated_bytes")}}), flush=True)
    print(cpu_table[:6000])


if __name__ == "__main__":
    main()
