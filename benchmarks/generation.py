"""Greedy generation for per-epoch F1: surefit's evaluation generation against its own earlier loop and against
transformers' ``generate``.

Same model as evaluation sees it: the embedded SmolLM2-135M-Instruct with a LoRA adapter (r 16, every linear layer,
B drawn at random so the adapter changes the answers) on surefit's fused forward, frozen weights stored in 16 bits
under bf16 autocast (CPU) or the GPU's mixed precision. Same prompts: rows of ``../shared/data/squad`` (questions
that share their paragraph) and of ``../shared/data/chat`` (tool-calling conversations, long answers), encoded by
surefit's sft encoder as evaluation encodes them.

Configurations, each on the same prompts, batch size and ``max_new_tokens``:

- ``before``: surefit's generation as it was (length-sorted batches, finished rows dropped, LM head at the last
  position only, transformers' growing cache, adapter unmerged): ``greedy_generate(merge_lora=False,
  reuse_cache=False, share_prefixes=False)``.
- ``surefit``: what evaluation runs by default: reserved cache, shared prefixes, the lean LoRA forward (the same
  numbers as ``before``).
- ``merged``, ``shared``, ``merged_shared``: the same with ``--eval_merge_lora`` (adapter merged into a 16-bit
  copy of the weights), ``--eval_share_prefixes`` (shared prompt beginnings prefilled once), or both.
- ``generate``: the anchor, ``model.generate`` on the same peft model, batched (longest first, left padded), greedy,
  under the same autocast, as a careful user writes it.

Rows identical are counted against a reference in the same precision with the same weights: ``surefit`` and
``shared`` against ``before`` and ``generate``; the merged ones against ``generate`` run inside the same merge (the
unoptimised generation with the merged weights), and, to show what merging itself changes, against ``generate``. Each timed
configuration runs ``--repeats`` times, alternating; the fastest repeat is kept.

    .venv/bin/python benchmarks/generation.py [--quick] [--rows 32] [--batch 8] [--repeats 2] \
        [--out benchmarks/results/generation]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

GOALS = {"before": 4.0, "generate": 3.0}


def _prompts(workload: str, rows: int, shared: Path, tok: Any) -> tuple[list[list[int]], int]:
    """Prompts of ``rows`` rows encoded as evaluation encodes them, and the longest gold answer in tokens."""
    from surefit.config import SFTConfig
    from surefit.tasks.sft.train_sft import Encoder, load_data

    data = shared / ("squad/dev-v1.1-part-a.json" if workload == "squad" else "chat/glaive_toolcall_en_demo.json")
    cfg = SFTConfig(data=str(data), val_fraction=0.0, limit=rows, max_seq_length=1024)
    train, _, report = load_data(cfg, say=lambda _: None)
    enc = Encoder.build(cfg, tok, str(report.format), bool(report.format_conversational))
    examples, rep = enc.encode(train, "validation")
    longest = max(len(e.input_ids) - len(e.prompt_ids) for e in examples)
    return [e.prompt_ids for e in examples], longest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="evaluation batch (surefit's default: 2 x micro-batch 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: as training sets it, the longest answer of the rows + 4 (at most 256)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="squad,chat")
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[1] / ".." / "shared" / "data"))
    ap.add_argument("--quick", action="store_true", help="smoke test: 6 rows, 6 new tokens, 1 repeat, no files")
    ap.add_argument("--out", default="benchmarks/results/generation")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.batch, args.max_new_tokens, args.repeats = 6, 3, 6, 1

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    from surefit.data.collate import PadCollator
    from surefit.eval.generate import Decode, greedy_generate, merged_lora
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.tasks.sft.train_sft import eos_token_ids
    from surefit.training.precision import make_accelerator, store_frozen_in
    from surefit.training.speedups.lora_fast import fuse_lora
    from surefit.training.speedups.lora_generate import lean_lora
    from surefit.training.speedups.prefixes import why_not_shared

    source = resolve_model(None)
    path = model_folder(source, log=print)
    tok, _ = load_tokenizer(path, source)
    tok.padding_side = "left"
    model = load_causal_lm(path, source)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # a trained adapter's size: it changes answers, it does not wreck them
    fuse_lora(model)
    acc = make_accelerator("auto", lora=True)
    if acc.mixed_precision in ("bf16", "fp16"):
        store_frozen_in(model, torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float16)
    model.to(acc.device).eval()
    eos = sorted(set(eos_token_ids(model, tok)) | {t for t in tok.convert_tokens_to_ids(["<|im_end|>"]) if t is not None})
    shareable = why_not_shared(model) is None

    results: dict[str, Any] = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                                           "device": str(acc.device), "precision": str(acc.mixed_precision)},
                               "rows": args.rows, "batch": args.batch, "repeats": args.repeats, "workloads": {}}
    def measure(workload: str) -> dict[str, Any]:
        prompts, longest = _prompts(workload, args.rows, Path(args.shared), tok)
        max_new = args.max_new_tokens or min(longest + 4, 256)

        def ours(fast: bool, merge: bool = False, share: bool = False,
                 stats: dict | None = None) -> list[list[int]]:
            decode = Decode(pad_token_id=tok.pad_token_id, eos_token_ids=eos, max_new_tokens=max_new,
                            batch_size=args.batch, merge_lora=merge, reuse_cache=fast,
                            share_prefixes=share and shareable)
            return greedy_generate(model, prompts, decode, device=acc.device, autocast=acc.autocast,
                                   lora_context=lean_lora if fast else None, stats=stats)

        def anchor() -> list[list[int]]:
            cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                                   pad_token_id=tok.pad_token_id)
            collate = PadCollator(pad_token_id=tok.pad_token_id, padding_side="left")
            order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
            out: list[list[int]] = [[] for _ in prompts]
            for start in range(0, len(order), args.batch):
                idx = order[start : start + args.batch]
                batch = {k: v.to(acc.device) for k, v in collate([{"input_ids": prompts[i]} for i in idx]).items()}
                with torch.no_grad(), acc.autocast():
                    new = model.generate(**batch, generation_config=cfg)[:, batch["input_ids"].shape[1] :].tolist()
                for i, seq in zip(idx, new, strict=True):
                    out[i] = seq[: next((k for k, t in enumerate(seq) if t in eos), len(seq))]
            return out

        stats: dict[str, int] = {}
        runs = {
            "before": lambda: ours(False),
            "surefit": lambda: ours(True),
            "merged": lambda: ours(True, merge=True),
            "shared": lambda: ours(True, share=True, stats=stats),
            "merged_shared": lambda: ours(True, merge=True, share=True),
            "generate": anchor,
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                outputs[name] = fn()
                times[name].append(time.perf_counter() - t0)
        with merged_lora(model):
            outputs["generate_merged"] = anchor()  # the unoptimised generation with the same merged weights (untimed)

        def same(a: str, b: str) -> int:
            return sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))

        best = {k: min(v) for k, v in times.items()}
        new_tokens = {k: sum(map(len, v)) for k, v in outputs.items()}
        rec = {
            "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_new_tokens": max_new,
            "prefill_tokens_with_shared_prefixes": stats.get("prefill_tokens"),
            "new_tokens": new_tokens, "seconds": times, "best_seconds": best,
            "new_tokens_per_s": {k: round(new_tokens[k] / best[k], 1) for k in best},
            # each against the reference with the same weights in the same precision
            "rows_identical": {
                "surefit_vs_before": same("surefit", "before"),
                "surefit_vs_generate": same("surefit", "generate"),
                "before_vs_generate": same("before", "generate"),
                "shared_vs_generate": same("shared", "generate"),
                "merged_vs_generate_same_merged_weights": same("merged", "generate_merged"),
                "merged_shared_vs_generate_same_merged_weights": same("merged_shared", "generate_merged"),
                "merged_vs_generate_unmerged": same("merged", "generate"),
            },
            "speedup_of_surefit": {k: round(best[k] / best["surefit"], 2) for k in ("before", "generate")},
            "speedup_of_merged_shared": {k: round(best[k] / best["merged_shared"], 2) for k in ("before", "generate")},
        }
        rec["goals"] = {}
        for variant in ("surefit", "merged_shared"):
            for k, g in GOALS.items():
                ratio = rec[f"speedup_of_{variant}"][k]
                rec["goals"][f"{variant} vs {k}"] = {"ratio": ratio, "goal": g,
                                                     "result": "PASS" if ratio >= g else "FAIL"}
        return rec

    for workload in args.workloads.split(","):
        rec = measure(workload)
        results["workloads"][workload] = rec
        print(json.dumps({workload: rec}, indent=2))
    if args.quick:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(_report(results, args), encoding="utf-8")


def _report(results: dict[str, Any], args: Any) -> str:
    m = results["machine"]
    lines = [
        "# Generation-based evaluation: speed and identical answers", "",
        f"`.venv/bin/python benchmarks/generation.py --rows {args.rows} --batch {args.batch} --repeats {args.repeats}`"
        f" on {m['device']} ({m['precision']}), torch {m['torch']}. Embedded SmolLM2-135M-Instruct + LoRA r16 on every "
        f"linear layer (random B), evaluation batch {args.batch}. `before`: surefit's earlier loop. `surefit`: the "
        "default (lean LoRA forward, reserved KV cache). `merged` / `shared` / `merged_shared`: with "
        "`--eval_merge_lora` / `--eval_share_prefixes` / both. `generate`: transformers' `model.generate` on the same "
        "batches, left padded, same autocast. New tokens per second, fastest of the repeats.", "",
        "| workload | rows | before | surefit | merged | shared | merged_shared | generate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["workloads"].items():
        t = r["new_tokens_per_s"]
        lines.append(f"| {name} | {r['prompts']} | " + " | ".join(str(t[k]) for k in (
            "before", "surefit", "merged", "shared", "merged_shared", "generate")) + " |")
    lines += ["", "| workload | goal | ratio | result |", "|---|---|---|---|"]
    for name, r in results["workloads"].items():
        for goal, g in r["goals"].items():
            lines.append(f"| {name} | {goal} >= {g['goal']}x | {g['ratio']}x | {g['result']} |")
    lines += ["", "Rows identical (greedy answers token for token), each against the reference with the same weights "
              "in the same precision; the last column shows what merging into 16-bit weights changes:", "",
              "| workload | " + " | ".join(next(iter(results["workloads"].values()))["rows_identical"]) + " |",
              "|---|" + "---|" * len(next(iter(results["workloads"].values()))["rows_identical"])]
    for name, r in results["workloads"].items():
        n = r["prompts"]
        lines.append(f"| {name} | " + " | ".join(f"{v}/{n}" for v in r["rows_identical"].values()) + " |")
    lines += ["", "Prompt tokens computed with shared prefixes: " + ", ".join(
        f"{k} {r['prefill_tokens_with_shared_prefixes'] or 0:,} of {r['prompt_tokens']:,}"
        for k, r in results["workloads"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
