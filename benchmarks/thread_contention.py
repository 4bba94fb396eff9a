"""One training's step time with another training running beside it, before and after surefit's thread settings.

"Before" is what a process got until now: no OpenMP settings, so torch uses every core and GNU OpenMP's default
wait policy (idle threads spin before they sleep). "After" is :func:`surefit.threads.configure_threads`:
``OMP_WAIT_POLICY=PASSIVE``, ``KMP_BLOCKTIME=0``, ``OMP_NUM_THREADS`` = the available cores. For each, the measured
process runs alone, then with a neighbour (the same workload, the same settings) training beside it. The workload is
a LoRA-free full training step of a small Llama (4 layers, hidden 256, batch 4 x 128 tokens): a stand-in for one
surefit step, cheap enough for a shared machine. The machine's load (``os.getloadavg``) is recorded before and after
each measurement: on a machine other jobs use, "alone" is not alone.

    python benchmarks/thread_contention.py --steps 12 --out benchmarks/results/thread_contention
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {"before": {}, "after": None}  # after: filled from configure_threads


def worker(steps: int, out: str | None) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (4, 128))
    times = []
    for _ in range(steps if steps > 0 else 10**9):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    if out:
        Path(out).write_text(json.dumps({"times": times, "threads": torch.get_num_threads()}))


def env_for(setting: str) -> dict[str, str]:
    sys.path.insert(0, str(HERE.parent / "src"))
    from surefit.threads import configure_threads

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME",
                                                            "GOMP_SPINCOUNT")}
    if setting == "after":
        configure_threads(env)
    return env


def measure(setting: str, neighbour: bool, steps: int, tmp: Path) -> dict:
    env = env_for(setting)
    load_before = os.getloadavg()
    other = None
    if neighbour:
        other = subprocess.Popen([sys.executable, __file__, "--worker", "--steps", "0"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(8)  # the neighbour is in its steps (model built, first step done)
    out = tmp / f"{setting}_{int(neighbour)}.json"
    subprocess.run([sys.executable, __file__, "--worker", "--steps", str(steps), "--out", str(out)], env=env,
                   check=True)
    if other is not None:
        other.terminate()
        other.wait()
    data = json.loads(out.read_text())
    times = data["times"][2:]  # the first steps warm up the allocator and the kernels
    return {"setting": setting, "neighbour": neighbour, "threads": data["threads"],
            "env": {k: env[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME") if k in env},
            "median_step_s": round(statistics.median(times), 4), "mean_step_s": round(statistics.mean(times), 4),
            "steps": len(times), "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.out)
        return
    import tempfile

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for neighbour in (False, True):
            for setting in ("before", "after"):
                rows.append(measure(setting, neighbour, args.steps, Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch": torch.__version__, "python": platform.python_version()}
    result = {"machine": machine, "rows": rows}
    out = Path(args.out or HERE / "results" / "thread_contention")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    by = {(r["setting"], r["neighbour"]): r for r in rows}
    lines = [f"machine: {machine}", "",
             "| setting | neighbour training | threads | median step (s) | load avg before -> after (1 min) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} ({', '.join(f'{k}={v}' for k, v in r['env'].items()) or 'torch defaults'})"
                     f" | {'yes' if r['neighbour'] else 'no'} | {r['threads']} | {r['median_step_s']} | "
                     f"{r['loadavg_before'][0]} -> {r['loadavg_after'][0]} |")
    for n in (False, True):
        b, a = by[("before", n)], by[("after", n)]
        lines.append(f"\n{'with' if n else 'without'} a neighbour: after / before = "
                     f"{a['median_step_s'] / b['median_step_s']:.2f}x the step time")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
