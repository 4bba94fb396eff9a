"""CPU preference-tuning benchmark: surefit --task dpo against TRL's DPOTrainer, each in its own process.

Same model (the embedded SmolLM2-135M-Instruct), same pairs (text prompt / chosen / rejected built from
../shared/data/chat/glaive_toolcall_en_demo.json: prompt = "Question: <first user turn>\\nAnswer:", chosen = the first
assistant reply of 6-60 words, rejected = the next such conversation's first reply), same settings: LoRA r=16 / alpha 32 / dropout 0 on
all linear layers, batch 4, max length 512, AdamW lr 5e-5, one epoch, sigmoid loss, beta 0.1, seed 0.

    surefit              surefit's defaults (precision auto; the reference = the adapters off, per step)
    surefit_precompute   the same with --precompute_ref (the reference computed once before step 1)
    trl                  trl.DPOTrainer at its defaults (bf16=True, gradient_checkpointing=True; reference = adapters
                         off through peft, per step)
    trl_precompute       the same with precompute_ref_log_probs=True

Whole-process tokens/s = tokens of both sequences of every pair / the worker's wall time from its start to its exit
(imports, model load, reference, training); peak RSS is the worker's own (``ru_maxrss``). Goal: surefit >= 2x TRL's
tokens/s at the same or lower peak memory (surefit vs trl, surefit_precompute vs trl_precompute).

    .venv/bin/python benchmarks/cpu_dpo.py --pairs 32
    .venv/bin/python benchmarks/cpu_dpo.py --only surefit,trl

Writes benchmarks/results/cpu_dpo.md and .json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent
CONFIGS = ("surefit", "surefit_precompute", "trl", "trl_precompute")
DATA = HERE.parent.parent / "shared" / "data" / "chat" / "glaive_toolcall_en_demo.json"


def make_pairs(n: int, path: Path) -> None:
    rows = json.loads(DATA.read_text(encoding="utf-8"))
    firsts = []
    for r in rows:
        turns = r["conversations"]
        # answers of 6-60 words: every pair fits max length 512 whole, so no tool truncates or drops one
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt" \
                and 6 <= len(turns[1]["value"].split()) <= 60:
            firsts.append((turns[0]["value"], turns[1]["value"]))
    pairs = [{"prompt": f"Question: {q}\nAnswer:", "chosen": " " + a, "rejected": " " + firsts[(i + 1) % len(firsts)][1]}
             for i, (q, a) in enumerate(firsts[:n])]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")


def worker(name: str, workdir: Path, model: str) -> None:
    data = workdir / "pairs.jsonl"
    out = workdir / name
    if name.startswith("surefit"):
        from surefit.cli import main

        argv = ["train", "--task", "dpo", "--model", model, "--data", str(data), "--output_dir", str(out),
                "--overwrite", "--val_fraction", "0", "--batch_size", "4", "--max_seq_length", "512",
                "--lora_targets", "all-linear", "--lr", "5e-5", "--epochs", "1", "--seed", "0"]
        if name == "surefit_precompute":
            argv.append("--precompute_ref")
        rc = main(argv)
        assert rc == 0, rc
        history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        loss = next((r.get("train_loss") for r in reversed(history) if "train_loss" in r), None)
    else:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import DPOConfig, DPOTrainer

        tok = AutoTokenizer.from_pretrained(model)
        policy = AutoModelForCausalLM.from_pretrained(model)
        pairs = [json.loads(x) for x in data.read_text().splitlines()]
        args = DPOConfig(output_dir=str(out), per_device_train_batch_size=4, learning_rate=5e-5, num_train_epochs=1,
                         max_length=512, beta=0.1, seed=0, report_to="none", use_cpu=True, save_strategy="no",
                         logging_steps=1, precompute_ref_log_probs=name == "trl_precompute")
        trainer = DPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok,
                             peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        result = trainer.train()
        loss = result.training_loss
    tokens = _tokens(model, data)
    seconds = time.perf_counter() - T0
    record = {"name": name, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "train_loss": loss}
    (workdir / f"{name}.json").write_text(json.dumps(record), encoding="utf-8")


def _tokens(model: str, data: Path) -> int:
    """Tokens of both sequences of every pair, the prompt counted in each (what each tool computes per epoch)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    n = 0
    for line in data.read_text().splitlines():
        p = json.loads(line)
        prompt = len(tok(p["prompt"])["input_ids"])
        n += 2 * prompt + len(tok(p["chosen"])["input_ids"]) + len(tok(p["rejected"])["input_ids"]) + 2
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--workdir", default="/tmp/surefit_cpu_dpo")
    ap.add_argument("--worker")
    ap.add_argument("--model")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    if a.worker:
        worker(a.worker, workdir, a.model)
        return
    workdir.mkdir(parents=True, exist_ok=True)
    make_pairs(a.pairs, workdir / "pairs.jsonl")
    sys.path.insert(0, str(HERE.parent / "src"))
    from surefit.models import model_folder, resolve_model

    model = model_folder(resolve_model(None), log=lambda s: None)  # the converted folder, cached: no worker pays it
    results: dict = {}
    previous = HERE / "results" / "cpu_dpo.json"
    if a.only != ",".join(CONFIGS) and previous.is_file():  # --only: the other configurations keep their last results
        results = {k: v for k, v in json.loads(previous.read_text())["results"].items() if k in CONFIGS}
    for name in a.only.split(","):
        env_cmd = [sys.executable, __file__, "--worker", name, "--workdir", str(workdir), "--model", model]
        proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode:
            results[name] = {"name": name, "error": proc.stderr[-2000:]}
            continue
        results[name] = json.loads((workdir / f"{name}.json").read_text())
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    lines = [f"# CPU DPO: surefit vs TRL DPOTrainer ({a.pairs} pairs, 1 epoch, SmolLM2-135M, LoRA r=16)", "",
             f"Measured on a loaded, shared 2-core machine (load average at the end: {' '.join(load)}; other "
             "helpers were training at the same time): the ratios are indicative, the absolute numbers are not.", "",
             "| configuration | whole-process s | tokens | tokens/s | peak RSS MiB | train loss |", "|---|---|---|---|---|---|"]
    for name in CONFIGS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed | | | | |")
            continue
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['train_loss'] if r['train_loss'] is None else round(r['train_loss'], 4)} |")
    lines.append("")
    for ours, theirs in (("surefit", "trl"), ("surefit_precompute", "trl_precompute")):
        if ours in results and theirs in results and "error" not in results[ours] and "error" not in results[theirs]:
            speed = results[ours]["tokens_per_s"] / results[theirs]["tokens_per_s"]
            mem = results[ours]["peak_rss_mb"] / results[theirs]["peak_rss_mb"]
            verdict = "PASS" if speed >= 2 and mem <= 1.0 else "FAIL"
            lines.append(f"- {ours} vs {theirs}: {speed:.2f}x tokens/s, {mem:.2f}x peak RSS: **{verdict}** "
                         "(goal: >= 2x at the same or lower peak memory)")
    out = HERE / "results"
    (out / "cpu_dpo.json").write_text(json.dumps({"pairs": a.pairs, "loadavg": load, "results": results}, indent=2),
                                      encoding="utf-8")
    (out / "cpu_dpo.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
