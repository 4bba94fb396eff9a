"""The seeds' 4 GB card on a big GPU: a Qwen3-0.6B-shaped model, LoRA r=16, max length 512, batch 4, in 3.8 GB.

    python benchmarks/gpu_small_card.py [--shared ../shared/data] [--rows 64]       # needs a CUDA GPU
    python benchmarks/gpu_small_card.py --tiny                                      # smoke test of the script, CPU
    python benchmarks/gpu_small_card.py --runs surefit,surefit-4bit                 # only these runs

Three runs (``--runs`` picks some), each in its own process with the process capped at 3.8 GB by
``torch.cuda.set_per_process_memory_fraction``:

* ``surefit``: ``surefit.train`` with ``gpu_memory_gb=3.8``; the planner picks micro-batch, accumulation,
  checkpointing and frozen-weight dtype, and the out-of-memory guard stays on as the net. Frozen weights are read
  straight into 16 bits.
* ``surefit-4bit``: the same with ``quantize="4bit"`` (QLoRA: nf4, double quantisation, bitsandbytes). Goal: it
  finishes under the cap with a lower peak than ``surefit`` (the ratio is recorded).
* ``plain``: the recipe without a planner, as the seeds wrote it: peft LoRA on the fp32 model, micro-batch 4, the
  Hugging Face loss (``labels=`` with full-vocabulary logits at every position), autocast, AdamW. It records the
  step at which it ran out of memory, if it does.

The model is built from ``Qwen3Config`` with Qwen3-0.6B's real dimensions and random weights (nothing downloaded);
the tokenizer is the embedded SmolLM2's (its ids fit in Qwen3's larger vocabulary). Writes
``benchmarks/results/gpu_small_card.{json,md}`` with the plan, peak memory and tokens/s of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAP_GB = 3.8


def qwen3_config(tiny: bool):
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 query / 8 key-value heads of 128, MLP 3072, vocabulary 151,936, tied.
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_model(folder: Path, tiny: bool, tokenizer: str | None = None) -> None:
    """Random weights in Qwen3-0.6B's shape; the tokenizer is ``tokenizer`` (a folder) or the embedded SmolLM2's."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from surefit.models import model_folder, resolve_model

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(tiny))
    tok = AutoTokenizer.from_pretrained(tokenizer or model_folder(resolve_model(None)))
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def cap_memory() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu (no cap)"
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_GB * 2**30 / total, 0)
    return f"{torch.cuda.get_device_name(0)} capped at {CAP_GB} GB of {total / 2**30:.1f} GB"


def worker_surefit(args: argparse.Namespace) -> dict:
    import torch

    import surefit

    device = cap_memory()
    quantize = "4bit" if args.worker == "surefit-4bit" else "none"
    out = Path(args.workdir) / f"{args.worker}-run"
    t0 = time.perf_counter()
    result = surefit.train(task="sft", model=args.model, data=args.data, limit=args.rows, epochs=1, batch_size=4,
                           max_seq_length=512, lora_r=16, lora_alpha=32, lora_dropout=0.05, lr=2e-4, seed=0,
                           gpu_memory_gb=str(CAP_GB) if torch.cuda.is_available() else None, val_fraction=0.1,
                           output_dir=str(out), overwrite=True, quantize=quantize,
                           **({} if torch.cuda.is_available() else {"precision": "bf16"}))
    seconds = time.perf_counter() - t0
    epoch = result.history[-1]
    plan = json.loads((out / "memory_plan.json").read_text())
    return {"run": args.worker, "device": device, "finished": True, "seconds": round(seconds, 1),
            "train_tokens_per_s": round(epoch["train_tokens_per_s"], 1), "oom_splits": epoch.get("oom_splits", 0),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
            "plan": {k: plan[k] for k in ("micro_batch_size", "grad_accum", "gradient_checkpointing", "precision",
                                          "frozen_dtype", "quantized", "eval_batch_size", "estimated_bytes",
                                          "measured", "changes") if k in plan},
            "train_loss": epoch["train_loss"], "eval_f1": epoch.get("eval_f1")}


def worker_plain(args: argparse.Namespace) -> dict:
    """The recipe without a planner: micro-batch 4, full logits, fp32 weights with autocast."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from surefit.config import SFTConfig, build_config
    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.tasks.sft import load_data

    device_name = cap_memory()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = build_config(SFTConfig, None, {"data": args.data, "limit": args.rows, "max_seq_length": 512})
    train, _, _ = load_data(cfg, say=lambda *_: None)
    examples, _ = encode_rows(train, tok, build_prompt_format(tok, cfg.template, cfg.chat_template), split="train",
                              max_seq_length=512, input_field=cfg.input_field, target_field=cfg.target_field)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    collate = PadCollator(pad_token_id=tok.pad_token_id)
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float16
    tokens, steps, failure = 0, 0, None
    t0 = time.perf_counter()
    for start in range(0, len(examples), 4):
        part = examples[start : start + 4]
        batch = {k: v.to(device) for k, v in collate([e.features() for e in part]).items()}
        try:
            with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError as e:
            failure = f"out of memory at step {steps + 1}: {str(e).splitlines()[0][:160]}"
            break
        tokens += int(batch["attention_mask"].sum())
        steps += 1
    seconds = time.perf_counter() - t0
    return {"run": "plain (micro-batch 4, full logits, fp32 weights)", "device": device_name,
            "finished": failure is None, "failure": failure, "steps": steps, "seconds": round(seconds, 1),
            "train_tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else None}


RUNS = ("surefit", "surefit-4bit", "plain")


def parse_runs(text: str) -> list[str]:
    """``--runs``: names among :data:`RUNS`, comma-separated, each once, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names among {', '.join(RUNS)} (got {text!r})")
    return names


def qlora_goal(results: list[dict]) -> list[dict]:
    """QLoRA's goal: the 4-bit run finishes under the cap with a lower peak than the 16-bit run (ratio recorded)."""
    by = {r.get("run"): r for r in results}
    four, half = by.get("surefit-4bit"), by.get("surefit")
    if four is None or half is None:
        return []
    ok = bool(four.get("finished") and half.get("finished") and four.get("peak_gb") and half.get("peak_gb"))
    ratio = four["peak_gb"] / half["peak_gb"] if ok else None
    speed = (four.get("train_tokens_per_s") or 0) / max(half.get("train_tokens_per_s") or 0, 1e-9) if ok else None
    return [{"goal": f"QLoRA (4-bit) finishes under {CAP_GB} GB with a lower peak than 16-bit LoRA",
             "status": "PASS" if ok and ratio < 1 else "FAIL",
             "measured": (f"peak {four['peak_gb']} GB vs {half['peak_gb']} GB (ratio {ratio:.2f}); tokens/s ratio "
                          f"{speed:.2f}") if ok else "a run did not finish or no GPU peak was read",
             "peak_ratio": ratio, "tokens_per_s_ratio": speed}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tiny", "--quick", action="store_true",
                    help="a 2-layer model: checks the script runs (CPU is fine); writes nothing")
    ap.add_argument("--runs", type=parse_runs, default=list(RUNS),
                    help=f"comma-separated runs among {', '.join(RUNS)} (default: all)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer files, where the embedded model is not "
                                        "installed (a GPU machine that gets only the repository)")
    ap.add_argument("--worker", choices=RUNS)
    ap.add_argument("--workdir")
    ap.add_argument("--model")
    ap.add_argument("--data")
    args = ap.parse_args()
    if args.worker:
        fn = worker_plain if args.worker == "plain" else worker_surefit
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return

    import torch

    rows = 8 if args.tiny else args.rows
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-0.6b-shaped"
        build_model(folder, args.tiny, args.tokenizer)
        data = str(Path(args.shared) / "squad" / "dev-v1.1-part-a.json")
        results = []
        for worker in args.runs:
            cmd = [sys.executable, __file__, "--worker", worker, "--workdir", tmp, "--model", str(folder),
                   "--data", data, "--rows", str(rows)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                results.append({"run": worker, "finished": False, "failure": proc.stderr.strip()[-1500:]})
            else:
                results.append(json.loads(line[len("RESULT "):]))
            print(json.dumps(results[-1], indent=2))
    goals = qlora_goal(results)
    record = {"benchmark": "gpu_small_card", "tiny": args.tiny, "rows": rows, "cap_gb": CAP_GB,
              "torch": torch.__version__, "results": results, "goals": goals}
    for g in goals:
        print(f"{g['status']}: {g['goal']} ({g['measured']})")
    if args.tiny:
        return  # a smoke test writes nothing
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_small_card.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    lines = [f"# gpu_small_card: Qwen3-0.6B-shaped, LoRA r=16, length 512, batch 4, capped at {CAP_GB} GB", "",
             "| run | finished | peak GB | tokens/s | notes |", "|---|---|---|---|---|"]
    for r in results:
        notes = r.get("failure") or "; ".join(r.get("plan", {}).get("changes", []))
        lines.append(f"| {r['run']} | {r.get('finished')} | {r.get('peak_gb')} | {r.get('train_tokens_per_s')} | "
                     f"{notes} |")
    lines += ["", "| goal | status | measured |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['status']} | {g['measured']} |" for g in goals]
    (out / "gpu_small_card.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
