"""A bare LoRA training loop (no trainer) for A/B tests of single levers, on surefit's own batches.

The embedded SmolLM2-135M-Instruct, LoRA r=16 alpha 32 on every block linear, the first 64 SQuAD rows in surefit's
length-grouped batch plan (batch 4, max length 384), AdamW lr 2e-4, clipping 1.0, torch's default threads. The first
batch runs untimed (warm-up; with --compile, the compile); then --steps batches are timed.

    .venv/bin/python benchmarks/bare_loop.py --peft                   # peft's forward under bf16 autocast
    .venv/bin/python benchmarks/bare_loop.py                          # surefit's: fused LoRA, activations in bf16
    .venv/bin/python benchmarks/bare_loop.py --compile [--peft]       # each decoder layer under torch.compile
    .venv/bin/python benchmarks/bare_loop.py --fp32 [--peft]
    .venv/bin/python benchmarks/bare_loop.py --steps 15 [--unfuse-mlp]  # all 16 batches; the gated MLP unfused

Prints one JSON line: tokens/s over the timed steps, their losses and the process's peak RSS. Nothing is written.
Measured (2-core CPU, 8 steps, one sitting, 2026-11-21): surefit 332 tokens/s (peak RSS 2.70 GB); surefit compiled
238 (first step, with the compile, 25.7 s); peft 236 (3.67 GB, and its losses 0.1 higher: bf16 rounding, see
lora_bf16_drift.py); peft compiled 229 (11.4 s; inductor's on-disk cache was warm from an earlier run).
Later the same day (after the fused gated MLP), --steps 15 in four pairs: fused 279, 295, 270, 295 tokens/s (peak RSS
2.45-2.49 GB), --unfuse-mlp 250, 240, 260, 316 (2.66-2.71 GB): the memory difference is steady, the speed one is
within this machine's noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--peft", action="store_true", help="peft's own LoRA forward instead of surefit's fused one")
    ap.add_argument("--fp32", action="store_true", help="no bf16 (frozen weights fp32, no autocast)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (dynamic shapes)")
    ap.add_argument("--unfuse-mlp", action="store_true",
                    help="the MLP's own forward (act(gate) * up, then down_proj alone) instead of surefit's fused one")
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.data.sampling import step_batches
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.training.loop import make_adamw
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import flush_denormals, store_frozen_in
    from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora

    torch.manual_seed(0)
    source = resolve_model(None)
    path = model_folder(source, log=print)
    tok, _ = load_tokenizer(path, source)
    rows = read_rows(Path(args.shared) / "squad" / "dev-v1.1-part-a.json", [])[:64]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=384)
    feats = [e.features() for e in examples]
    lengths = [len(e.input_ids) for e in examples]
    batches = list(step_batches(lengths, 4, 0, 1))[: args.steps + 1]
    model = get_peft_model(load_causal_lm(path, source), LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    bf16 = not args.fp32
    if bf16:
        store_frozen_in(model, torch.bfloat16)  # what surefit's planner does under bf16 + LoRA
    if not args.peft:
        fuse_lora(model)
    if args.unfuse_mlp:
        for m in model.modules():
            if "forward" in m.__dict__ and hasattr(m, "_surefit_act"):
                del m.forward  # fuse_lora gave this gated MLP the fused forward (_SwiGLUDown); back to its class's
    if args.compile:
        for layer in model.base_model.model.model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_adamw(params, lr=2e-4, weight_decay=0.0)
    collate = PadCollator(pad_token_id=tok.pad_token_id)

    def step(b: list[int]) -> tuple[float, int]:
        batch = collate([feats[i] for i in b])
        saved = SavedActivationsIn() if bf16 and not args.peft else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), saved:
            loss, n = causal_lm_loss_sum(model, batch)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item() / n, sum(lengths[i] for i in b)

    with flush_denormals(torch.device("cpu")):
        t = time.perf_counter()
        step(batches[0])
        first = time.perf_counter() - t
        t, tokens, losses = time.perf_counter(), 0, []
        for b in batches[1:]:
            loss, n = step(b)
            tokens += n
            losses.append(round(loss, 4))
        seconds = time.perf_counter() - t
    print(json.dumps({"forward": "peft" if args.peft else "surefit", "bf16": bf16, "compile": args.compile, "unfuse_mlp": args.unfuse_mlp, "steps": args.steps,
                      "first_step_s": round(first, 1), "tokens_per_s": round(tokens / seconds, 1),
                      "losses": losses, "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                                                             2)}))


if __name__ == "__main__":
    main()
