"""In-step A/B of the row-chunked gated-MLP backward and RMSNorm (``row_chunks.py`` times them alone).

One process, the embedded SmolLM2-135M-Instruct with LoRA r=16 (alpha 32, dropout 0.05) on every linear layer as
surefit trains it (fused LoRA forward, frozen weights in bf16, bf16 autocast, activations saved in bf16), one
micro-batch of 4 x 380 random tokens (the chat workload's longest, 320 supervised per row). ``old``: ``_SwiGLUDown``'s
forward and backward and the norms' forward from ``--before`` (a ``src`` folder, e.g.
``git archive 43f8de3 src | tar -x -C /tmp/base``); ``new``: this checkout's. Rounds alternate the order; CPU
seconds (``process_time``, all threads) and wall seconds of forward + backward, and the gated MLP's backward alone.

    PYTHONPATH=src .venv/bin/python benchmarks/row_chunks_step.py --before /tmp/base/src --threads 2 --out results/x.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="src folder of the code to compare with")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(HERE))
    import benchlib

    import surefit.training.speedups.lora_fast as lf
    from surefit.models import model_folder, resolve_model
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import store_frozen_in

    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location(
        "old_lora_fast", Path(args.before) / "surefit" / "training" / "speedups" / "lora_fast.py")
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    model = AutoModelForCausalLM.from_pretrained(model_folder(resolve_model(None)), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"))
    lf.fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    model.train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 380))
    labels = ids.clone()
    labels[:, :60] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    norms = [m for m in model.modules() if getattr(m.forward, "__func__", None) is lf._rms_norm_forward]
    mlp_seconds = [0.0]

    def timed(f: Any) -> Any:
        def backward(ctx: Any, grad: Any) -> Any:
            t0 = time.process_time()
            out = f(ctx, grad)
            mlp_seconds[0] += time.process_time() - t0
            return out
        return staticmethod(backward)

    sides = {"old": (old._SwiGLUDown.forward, timed(old._SwiGLUDown.backward), old._rms_norm_forward),
             "new": (lf._SwiGLUDown.forward, timed(lf._SwiGLUDown.backward), lf._rms_norm_forward)}

    def step(side: str) -> dict[str, float]:
        fwd, bwd, norm = sides[side]
        lf._SwiGLUDown.forward, lf._SwiGLUDown.backward = fwd, bwd  # type: ignore[method-assign]
        for m in norms:
            m.forward = types.MethodType(norm, m)
        model.zero_grad(set_to_none=True)
        mlp_seconds[0] = 0.0
        t0, w0 = time.process_time(), time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16), lf.SavedActivationsIn():
            loss, n = causal_lm_loss_sum(model, batch)
        (loss / n).backward()
        return {"cpu_s": time.process_time() - t0, "wall_s": time.perf_counter() - w0, "mlp_backward_cpu_s":
                mlp_seconds[0], "loss": (loss / n).item()}

    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for side in runs:
        step(side)  # warm-up
    for r in range(args.rounds):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            runs[side].append(step(side))
    summary = {side: {k: sorted(round(x[k], 3) for x in rs) for k in ("cpu_s", "wall_s", "mlp_backward_cpu_s")}
               | {"loss": rs[0]["loss"]} for side, rs in runs.items()}
    for side, s in summary.items():
        print(side, json.dumps(s))
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "row_chunks_step", "machine": benchlib.machine_info(),
                                              "threads": args.threads, "rounds": args.rounds, "results": summary,
                                              "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
