"""Greedy generation for per-epoch F1: surefit's decode loop against transformers' ``generate``.

Same model (the embedded SmolLM2-135M-Instruct with a LoRA adapter on every linear layer, under the same autocast
as evaluation), same prompts (SQuAD rows rendered with the default template), same batches (sorted by length, left
padded). The anchor is ``model.generate`` called the way a careful user writes it. The outputs are compared row by
row; the two are timed alternately, and each one's fastest repeat is kept.

    .venv/bin/python benchmarks/generation.py [--rows 32] [--batch 8] [--max-new-tokens 48] [--repeats 2] \
        [--out benchmarks/results/generation]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data", default="examples/sft/squad-sample.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.eval.generate import greedy_generate
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.training.precision import make_accelerator

    source = resolve_model(None)
    path = model_folder(source, log=print)
    tok, _ = load_tokenizer(path, source)
    model = load_causal_lm(path, source)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.eval()
    acc = make_accelerator("auto" if torch.cuda.is_available() else "bf16")
    problems: list = []
    rows = read_rows(args.data, problems)[: args.rows]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=512)
    prompts = [e.prompt_ids for e in examples]
    eos = [tok.eos_token_id]

    def anchor() -> list[list[int]]:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                               pad_token_id=tok.pad_token_id)
        collate = PadCollator(pad_token_id=tok.pad_token_id, padding_side="left")
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), args.batch):
            idx = order[start : start + args.batch]
            batch = collate([{"input_ids": prompts[i]} for i in idx])
            with torch.no_grad(), acc.autocast():
                new = model.generate(**batch, generation_config=cfg)[:, batch["input_ids"].shape[1] :].tolist()
            for i, seq in zip(idx, new, strict=True):
                out[i] = seq[: next((k for k, t in enumerate(seq) if t in eos), len(seq))]
        return out

    def surefit() -> list[list[int]]:
        return greedy_generate(model, prompts, pad_token_id=tok.pad_token_id, eos_token_ids=eos,
                               max_new_tokens=args.max_new_tokens, batch_size=args.batch, autocast=acc.autocast)

    times: dict[str, list[float]] = {"generate": [], "surefit": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, fn in (("generate", anchor), ("surefit", surefit)):
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    same = sum(a == b for a, b in zip(outputs["generate"], outputs["surefit"], strict=True))
    new_tokens = sum(map(len, outputs["surefit"]))
    best = {k: min(v) for k, v in times.items()}
    result = {
        "rows": len(prompts), "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "precision": str(acc.mixed_precision), "new_tokens": new_tokens,
        "rows_identical": same, "seconds": times, "best_seconds": best,
        "speedup": round(best["generate"] / best["surefit"], 2),
        "surefit_new_tokens_per_s": round(new_tokens / best["surefit"], 1),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
