"""Does LoRA learn the same under bf16? peft under autocast vs surefit's fused forward vs fp32, step by step.

The same model (embedded SmolLM2-135M-Instruct), LoRA (r 16, alpha 32, all block linears, dropout 0 so that every
configuration sees exactly the same computation apart from precision), batches (the first SQuAD rows, surefit's
encoding and length-grouped batch plan, batch 4) and AdamW steps (lr 2e-4). Each configuration runs in this process
from a fresh copy of the weights; the table gives the loss of each step's batch before its update, and the largest
gap to fp32 over the steps after the first (the first is before any update, where only the forward differs).

    .venv/bin/python benchmarks/lora_bf16_drift.py [--steps 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.data.sampling import step_batches
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import store_frozen_in
    from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora

    source = resolve_model(None)
    path = model_folder(source, log=print)
    tok, _ = load_tokenizer(path, source)
    rows = read_rows(Path(args.shared) / "squad" / "dev-v1.1-part-a.json", [])[: 4 * args.steps]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=384)
    feats = [e.features() for e in examples]
    batches = list(step_batches([len(e.input_ids) for e in examples], 4, 0, 1))[: args.steps]
    collate = PadCollator(pad_token_id=tok.pad_token_id)

    def run(name: str) -> dict:
        torch.manual_seed(0)
        model = get_peft_model(load_causal_lm(path, source), LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        if name != "peft_fp32":
            store_frozen_in(model, torch.bfloat16)  # what surefit's planner does under bf16 + LoRA (same numbers)
        if name == "surefit_bf16":
            fuse_lora(model)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.0)
        losses, t0 = [], time.perf_counter()
        for b in batches:
            batch = collate([feats[i] for i in b])
            saved = SavedActivationsIn() if name == "surefit_bf16" else contextlib.nullcontext()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "peft_fp32"), saved:
                loss, n = causal_lm_loss_sum(model, batch)
            (loss / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item() / n)
        return {"losses": losses, "seconds": time.perf_counter() - t0}

    names = ["peft_fp32", "peft_bf16_autocast", "surefit_bf16"]
    res = {n: run(n) for n in names}
    ref = res["peft_fp32"]["losses"]
    lines = ["# lora_bf16_drift: does LoRA learn the same under bf16?", "",
             f"SmolLM2-135M-Instruct, LoRA r=16 alpha 32 dropout 0 on all block linears, AdamW lr 2e-4, batch 4, the "
             f"first {len(feats)} SQuAD rows in surefit's batch plan; loss of each step's batch before its update. "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads. Command: "
             "`.venv/bin/python benchmarks/lora_bf16_drift.py`.", "",
             "| configuration | " + " | ".join(f"step {i + 1}" for i in range(len(ref))) + " | largest gap to fp32 after "
             "step 1 | seconds |", "|---|" + "---|" * (len(ref) + 2)]
    desc = {"peft_fp32": "peft, fp32", "peft_bf16_autocast": "peft, bf16 autocast (frozen weights bf16)",
            "surefit_bf16": "surefit's fused forward (bf16 matmuls, adapter added in fp32, activations saved in bf16)"}
    for n in names:
        ls = res[n]["losses"]
        gap = max(abs(a - b) for a, b in zip(ls[1:], ref[1:], strict=True)) if len(ls) > 1 else 0.0
        lines.append(f"| {desc[n]} | " + " | ".join(f"{x:.4f}" for x in ls) + f" | {gap:.4f} | {res[n]['seconds']:.1f} |")
    lines += ["", "Step 1 is before any update: there only the forward's rounding differs. From step 2 on, peft under "
              "autocast adds the adapter's output to a bf16 base output and rounds the sum to bf16, so a young "
              "adapter's contribution (below half a bf16 step) is mostly lost; surefit adds it in fp32 (its matmuls, the "
              "adapter's included, run in bf16, and the activations it saves for the backward pass are stored in "
              "bf16, as in its training loop).", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_bf16_drift.md").write_text("\n".join(lines), encoding="utf-8")
    (out / "lora_bf16_drift.json").write_text(json.dumps(res, indent=2), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
