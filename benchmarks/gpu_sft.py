"""surefit vs TRL on a GPU: a Qwen3-0.6B-shaped model, LoRA r=16, max length 512, batch 8, bf16.

    python benchmarks/gpu_sft.py [--shared ../shared/data] [--rows 256]     # needs a CUDA GPU
    python benchmarks/gpu_sft.py --tiny                                     # smoke test of the script, CPU is fine

Three runs, each in its own process, on the same rows (the first N SQuAD questions, surefit's prompt template for
everyone), one epoch, LoRA r=16 alpha 32 dropout 0.05 on every linear layer of the blocks, AdamW lr 2e-4, seed 0:

* ``surefit``: ``surefit.train`` with ``precision="bf16"`` (its planner, supervised-only logits, fused LoRA).
* ``trl``: TRL ``SFTTrainer`` on a prompt/completion dataset with its defaults plus ``bf16=True`` (TRL's defaults
  include gradient checkpointing).
* ``trl_no_ckpt``: the same without gradient checkpointing (TRL at its fastest).

Reported per run: training seconds (surefit: its ``time_per_epoch``; TRL: ``on_epoch_begin`` to ``on_epoch_end``),
tokens/s over the real (non-padding) tokens of the rows, peak GPU memory (``torch.cuda.max_memory_allocated``), final
training loss, and MFU = tokens/s x 4 x (non-embedding parameters) / the GPU's dense bf16 peak. 4 x N is the
forward (2N) and the input-gradient half of the backward (2N) through frozen weights: the adapters' own FLOPs
(under 1%) and attention are left out, so MFU is a lower bound, the same for every run.

The model is built from ``Qwen3Config`` with Qwen3-0.6B's real dimensions and random weights (nothing is downloaded;
``gpu_small_card.build_model``). Writes ``benchmarks/results/gpu_sft.{json,md}`` (with ``--tiny`` only where ``--out`` says).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402
from gpu_small_card import build_model  # noqa: E402

MAX_LEN, BATCH = 512, 8
# Dense bf16 peaks (no sparsity), TFLOP/s, from the vendors' data sheets (SXM parts).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
RUNS = ("surefit", "trl", "trl_no_ckpt")


def _device() -> tuple[str, float | None]:
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return name, peak


def _nonembedding_params(model: Any) -> int:
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters()) - emb.numel()


def prepare(args: argparse.Namespace, folder: Path, workdir: Path) -> dict[str, Any]:
    """The rows every run trains on (surefit's reader and encoder, so the same questions, answers and token count
    everywhere) and 8 held-out rows for surefit's per-epoch evaluation (outside the timed epoch)."""
    from transformers import AutoTokenizer

    from surefit.data.encode import DEFAULT_TEMPLATE, build_prompt_format, encode_rows
    from surefit.data.readers import read_rows

    problems: list = []
    rows = read_rows(Path(args.data), problems)
    if problems:
        raise SystemExit(f"cannot read {args.data}: {problems}")
    train, val = rows[: args.rows], rows[-8:]
    tok = AutoTokenizer.from_pretrained(folder)
    examples, report = encode_rows(train, tok, build_prompt_format(tok), max_seq_length=MAX_LEN)
    if len(examples) != len(train) or report.truncated:
        raise SystemExit("some rows were excluded or truncated at the length limit; pick other rows")
    for name, part in (("train.jsonl", train), ("val.jsonl", val)):
        with (workdir / name).open("w", encoding="utf-8") as fh:
            for r in part:
                fh.write(json.dumps({k: r.fields[k] for k in ("input", "target", "answers")}) + "\n")
    spec = {"tokens": report.tokens, "supervised_tokens": report.supervised_tokens, "template": DEFAULT_TEMPLATE}
    (workdir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    return spec


def _peak_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None


def worker_surefit(args: argparse.Namespace) -> dict[str, Any]:
    import surefit

    work = Path(args.workdir)
    out = work / "surefit-run"
    result = surefit.train(task="sft", model=args.model, data=str(work / "train.jsonl"),
                           val_data=str(work / "val.jsonl"), epochs=1, batch_size=BATCH, max_seq_length=MAX_LEN,
                           lora_r=16, lora_alpha=32, lora_dropout=0.05, lr=2e-4, seed=0, precision="bf16",
                           # the anchors' prompt: without it surefit would use the tokenizer's chat template
                           template=json.loads((work / "spec.json").read_text())["template"],
                           output_dir=str(out), overwrite=True)
    epoch = result.history[-1]
    plan = json.loads((out / "memory_plan.json").read_text(encoding="utf-8"))
    return {"seconds": epoch["time_per_epoch"], "train_loss": epoch["train_loss"], "peak_gb": _peak_gb(),
            "plan": {k: plan[k] for k in ("micro_batch_size", "grad_accum", "gradient_checkpointing", "precision",
                                          "frozen_dtype")}}


def worker_trl(args: argparse.Namespace, checkpointing: bool) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(args.model)
    template = json.loads((Path(args.workdir) / "spec.json").read_text())["template"]
    rows = [json.loads(line) for line in (Path(args.workdir) / "train.jsonl").read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": template.replace("{input}", r["input"]), "completion": r["target"]}
                            for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    timer = benchlib.make_epoch_timer()
    steps = -(-len(rows) // BATCH)
    cfg = SFTConfig(output_dir=str(Path(args.workdir) / "trl"), num_train_epochs=1, per_device_train_batch_size=BATCH,
                    learning_rate=2e-4, lr_scheduler_type="cosine", warmup_steps=int(0.05 * steps), seed=0,
                    bf16=torch.cuda.is_available(), max_length=MAX_LEN, gradient_checkpointing=checkpointing,
                    logging_steps=1, save_strategy="no", report_to=[])
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = benchlib.recording(SFTTrainer)(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                                             peft_config=lora, callbacks=[timer])
    benchlib.warm_up(trainer, cfg.bf16)  # undone; surefit's timed epoch also follows a warm start
    trainer.bench_reset()
    trainer.train()
    return {"seconds": timer.seconds, "peak_gb": _peak_gb(), "train_loss": trainer.bench_loss,
            "resolved": {"bf16": cfg.bf16, "gradient_checkpointing": cfg.gradient_checkpointing}}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    device, peak = _device()
    rec = worker_surefit(args) if args.worker == "surefit" else worker_trl(args, args.worker == "trl")
    tokens = json.loads((Path(args.workdir) / "spec.json").read_text())["tokens"]
    with __import__("torch").device("meta"):
        n = _nonembedding_params(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)))
    tps = tokens / rec["seconds"]
    rec.update(run=args.worker, device=device, tokens_per_s=round(tps, 1), nonembedding_params=n,
               mfu=round(tps * 4 * n / (peak * 1e12), 4) if peak else None)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and 8 rows: checks the script runs")
    ap.add_argument("--out", help="where to write gpu_sft.{json,md} (default benchmarks/results; with --tiny "
                                   "nothing is written unless --out is given)")
    ap.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer files, where the embedded model is not "
                                        "installed (a GPU machine that gets only the repository)")
    ap.add_argument("--worker", choices=RUNS)
    ap.add_argument("--workdir")
    ap.add_argument("--model")
    ap.add_argument("--data")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    import torch

    args.rows = 8 if args.tiny else args.rows
    args.data = str(Path(args.shared) / "squad" / "dev-v1.1-part-a.json")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-0.6b-shaped"
        build_model(folder, args.tiny, args.tokenizer)
        tokens = prepare(args, folder, Path(tmp))["tokens"]  # prompt + answer + EOS: the same work for every run
        results = []
        for run in RUNS:
            cmd = [sys.executable, __file__, "--worker", run, "--workdir", tmp, "--model", str(folder),
                   "--data", args.data, "--rows", str(args.rows)]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            results.append(json.loads(line[len("RESULT "):]) if line else
                           {"run": run, "failure": proc.stderr.strip()[-1500:]})
            print(json.dumps(results[-1], indent=2), flush=True)
    record = {"benchmark": "gpu_sft", "tiny": args.tiny, "rows": args.rows, "tokens": tokens, "max_length": MAX_LEN,
              "batch": BATCH, "torch": torch.__version__, "results": results}
    if any("failure" in r for r in results):
        raise SystemExit("a run failed (its stderr is printed above)")
    if args.tiny and not args.out:
        return  # a smoke test writes nothing
    out = Path(args.out or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_sft.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    base = {r["run"]: r for r in results}
    lines = [f"# gpu_sft: Qwen3-0.6B-shaped (random weights), LoRA r=16, max length {MAX_LEN}, batch {BATCH}, bf16",
             "", f"{args.rows} SQuAD rows, {tokens:,} real tokens, one epoch, on {results[0]['device']}; "
             f"torch {torch.__version__}. Command: `python benchmarks/gpu_sft.py --rows {args.rows}`.", "",
             "| run | train s | tokens/s | peak GB | MFU | final loss | surefit speed-up |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {r['seconds']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_gb']} | {r['mfu']} | "
                     f"{r['train_loss']:.4f} | {base['surefit']['tokens_per_s'] / r['tokens_per_s']:.2f}x |")
    lines += ["", "MFU: tokens/s x 4 x non-embedding parameters / the GPU's dense bf16 peak (forward + input gradient "
              "through frozen weights; adapters and attention left out, so a lower bound). Final loss: token-weighted "
              "mean over the epoch of the answer + EOS tokens. Raw numbers in `gpu_sft.json`."]
    (out / "gpu_sft.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
