"""What padding each batch's length up to a multiple costs in CPU time: the same epoch's batches, A and B interleaved.

The embedded SmolLM2-135M-Instruct as surefit trains it on a CPU with bf16 (frozen weights in bf16, LoRA r=16 on every
block linear, fused LoRA forward, keyed dropout, activations saved in bf16, the fused head and loss, and on SQuAD the
shared prompt prefixes), on the first --rows rows of a workload (cpu_sft.py's chat or SQuAD rows), batches of 4 in
surefit's epoch order. Each batch is trained twice in a row, once padded to its longest row (A) and once to a
multiple of --multiple (B), the order alternating from batch to batch; the process CPU time of each is summed.
Both train one model (timing only: the losses are not compared here; tests/training/test_loss_invariant.py does).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pad_multiple_ab.py --workload chat --multiple 64
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pad_multiple_ab.py --workload squad --multiple 64
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("chat", "squad"), default="chat")
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import cpu_sft
    import torch
    from peft import LoraConfig, get_peft_model

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.data.sampling import step_batches
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.training.dropout import seed_dropout, training_rows
    from surefit.training.loop import make_adamw
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import flush_denormals, store_frozen_in
    from surefit.training.speedups import fused_head
    from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora
    from surefit.training.speedups.prefixes import PrefixSharing

    torch.manual_seed(0)
    source = resolve_model(None)
    path = model_folder(source, log=print)
    tok, _ = load_tokenizer(path, source)
    if args.workload == "chat":
        rows_file = cpu_sft.chat_rows(Path(args.shared) / "chat" / "glaive_toolcall_en_demo.json", tok,
                                      Path(tempfile.mkdtemp(prefix="pad_ab-")))
    else:
        rows_file = Path(args.shared) / "squad" / "dev-v1.1-part-a.json"
    rows = read_rows(rows_file, [])[: args.rows]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=cpu_sft.MAX_LEN)
    feats = [e.features() for e in examples]
    lengths = [len(e.input_ids) for e in examples]
    model = get_peft_model(load_causal_lm(path, source), LoraConfig(
        r=cpu_sft.LORA_R, lora_alpha=cpu_sft.LORA_ALPHA, lora_dropout=cpu_sft.LORA_DROPOUT, task_type="CAUSAL_LM",
        target_modules=cpu_sft.LORA_TARGETS))
    seed_dropout(model)
    store_frozen_in(model, torch.bfloat16)
    fuse_lora(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_adamw(params, lr=cpu_sft.LR, weight_decay=0.0)
    loss_fn = functools.partial(causal_lm_loss_sum, fused=fused_head,
                                share=PrefixSharing() if args.workload == "squad" else None)
    collators = {"A": PadCollator(pad_token_id=tok.pad_token_id),
                 "B": PadCollator(pad_token_id=tok.pad_token_id, pad_to_multiple_of=args.multiple)}

    def step(which: str, batch_rows: list[int]) -> tuple[float, int]:
        batch = collators[which]([feats[i] for i in batch_rows])
        c0 = time.process_time()
        with training_rows(0, 1, batch_rows), flush_denormals(torch.device("cpu")):
            with torch.autocast("cpu", dtype=torch.bfloat16), SavedActivationsIn():
                loss, n = loss_fn(model, batch)
            (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.process_time() - c0, batch["input_ids"].numel()

    plan = step_batches(lengths, cpu_sft.BATCH, 0, 1)
    step("A", plan[0])  # warm-up, untimed
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    padded = {"A": 0, "B": 0}
    for i, batch_rows in enumerate(plan):
        for which in ("AB" if i % 2 == 0 else "BA"):
            s, cells = step(which, batch_rows)
            cpu[which].append(s)
            padded[which] += cells
    ratios = [b / a for a, b in zip(cpu["A"], cpu["B"], strict=True)]
    record = {"workload": args.workload, "rows": len(feats), "multiple": args.multiple, "steps": len(plan),
              "tokens": sum(lengths), "padded_cells": padded, "cpu_s": {k: round(sum(v), 2) for k, v in cpu.items()},
              "epoch_ratio_B_over_A": round(sum(cpu["B"]) / sum(cpu["A"]), 4),
              "median_step_ratio": round(statistics.median(ratios), 4),
              "per_step_cpu_s": {k: [round(x, 2) for x in v] for k, v in cpu.items()}}
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
