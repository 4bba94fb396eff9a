"""bf16 vs fp32 training step on this CPU, A/B interleaved in one process, with attention timed where it runs.

The embedded SmolLM2-135M-Instruct with LoRA r=16 (alpha 32, dropout 0.05) on every block linear, as
``benchmarks/cpu_sft.py`` trains it, forward + backward of the first ``--rows`` SQuAD rows one at a time (a
micro-batch of one, as surefit's memory plan runs them on a small machine), in these variants, each its own model:

- ``fp32``: frozen weights fp32, no autocast (``--precision fp32``); the fused LoRA forward (``_LoraBranch``).
- ``bf16``: what ``--precision auto`` runs on a CPU with AVX-512 BF16 or AMX: frozen weights stored in bf16, bf16
  autocast, the fused LoRA forward (``_LoraMixed``: bf16 matmuls, sums in fp32), saved activations in bf16.
- ``bf16_attn32``: as ``bf16``, but scaled-dot-product attention computed in fp32 (its inputs are fp32 already:
  they come out of the fused LoRA layers). Not what surefit runs: it tells what bf16 attention costs here.

Rounds alternate the variants' order; each round times all rows of each variant in CPU seconds (``process_time``:
the process's own, so other work on the machine inflates it less than wall seconds) and in wall seconds. Attention's
own CPU time is measured in place (forward: around the call; backward: from the gradient reaching its output to the
gradient leaving its query), in the variants with ``attn`` timing on (``+t`` suffix, e.g. ``bf16+t``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_precision.py                       # fp32,bf16,bf16_attn32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_precision.py --variants bf16+t,bf16_attn32+t --rounds 3
    .venv/bin/python benchmarks/step_precision.py --out results/step_precision.json      # also write the JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="fp32,bf16,bf16_attn32")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import flush_denormals, store_frozen_in
    from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    source = resolve_model(None)
    path = model_folder(source, log=lambda *a: None)
    tok, _ = load_tokenizer(path, source)
    rows = read_rows(Path(args.shared) / "squad" / "dev-v1.1-part-a.json", [])[: args.rows]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=384)
    feats = [e.features() for e in examples]
    collate = PadCollator(pad_token_id=tok.pad_token_id)
    models = {}
    for v in variants:
        torch.manual_seed(0)  # the same adapter initialisation in every variant
        m = get_peft_model(load_causal_lm(path, source), LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        if v.startswith("bf16"):
            store_frozen_in(m, torch.bfloat16)
        fuse_lora(m)
        m.train()
        models[v] = m

    real_sdpa = F.scaled_dot_product_attention
    attn = {v: {"forward_s": 0.0, "backward_s": 0.0, "calls": 0} for v in variants}
    current: dict[str, Any] = {}

    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, *a: Any, **kw: Any) -> Any:
        name = current["variant"]
        dt = torch.bfloat16 if torch.is_autocast_enabled("cpu") and "attn32" not in name else torch.float32
        with torch.autocast("cpu", enabled=False):  # the casts autocast would make, made here
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dt)
            t = time.process_time()
            out = real_sdpa(q, k, v, attn_mask, *a, **kw)
            rec = attn[name]
            rec["forward_s"] += time.process_time() - t
            rec["calls"] += 1
        if "+t" in name and out.requires_grad:
            start: dict[str, float] = {}
            out.register_hook(lambda g: start.__setitem__("t", time.process_time()))
            q.register_hook(lambda g: rec.__setitem__("backward_s", rec["backward_s"] + time.process_time() - start["t"]))
        return out

    def step(v: str, f: dict[str, Any]) -> float:
        bf16 = v.startswith("bf16")
        current["variant"] = v
        saved = SavedActivationsIn() if bf16 else contextlib.nullcontext()
        F.scaled_dot_product_attention = sdpa
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), saved:
                loss, n = causal_lm_loss_sum(models[v], collate([f]))
            (loss / n).backward()
        finally:
            F.scaled_dot_product_attention = real_sdpa
        for p in models[v].parameters():
            p.grad = None
        return loss.item() / n

    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {}
    busy0, wall0 = benchlib._cpu_busy_seconds(), time.perf_counter()
    own0 = time.process_time()
    with flush_denormals(torch.device("cpu")):
        for v in variants:  # warm
            step(v, feats[0])
        for rec in attn.values():
            rec.update(forward_s=0.0, backward_s=0.0, calls=0)
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                c, w = time.process_time(), time.perf_counter()
                losses[v] = [step(v, f) for f in feats]
                times[v].append((time.process_time() - c, time.perf_counter() - w))
    busy1, wall = benchlib._cpu_busy_seconds(), time.perf_counter() - wall0
    others = None if busy0 is None or busy1 is None else round(
        max(0.0, (busy1 - busy0) - (time.process_time() - own0)) / wall, 2)
    base = variants[0]
    result: dict[str, Any] = {"benchmark": "step_precision", "started": time.strftime("%Y-%m-%d %H:%M %Z"),
                              "machine": benchlib.machine_info(), "rows": args.rows, "rounds": args.rounds,
                              "others_cpu_cores": others, "variants": {}}
    for v in variants:
        cpu = [t[0] for t in times[v]]
        rec = attn[v]
        per_round = {k: round(rec[k] / args.rounds, 3) for k in ("forward_s", "backward_s")}
        result["variants"][v] = {
            "cpu_s_median": round(statistics.median(cpu), 3), "wall_s_median": round(statistics.median(t[1] for t in times[v]), 3),
            "cpu_s_rounds": [round(x, 3) for x in cpu],
            "cpu_vs_first_median": round(statistics.median(a[0] / b[0] for a, b in zip(times[v], times[base], strict=True)), 3),
            "attention_cpu_s_per_round": per_round if "+t" in v else {"forward_s": per_round["forward_s"]},
            "losses": [round(x, 4) for x in losses[v]]}
    print(json.dumps(result["variants"], indent=1))
    print(f"others_cpu_cores {others}; torch threads {torch.get_num_threads()}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
