"""An evaluation on a sliding-window model, before and after generation gave such models a full-length cache.

The embedded SmolLM2-135M-Instruct's weights loaded into ``MistralForCausalLM`` with ``sliding_window`` 4096
(Mistral-7B-v0.1's window; Mistral is Llama with a window, so the numbers are SmolLM2's where the window does not
bite), a random-B LoRA adapter (r 16, every linear layer) on surefit's fused forward, fp32, one torch thread.
The prompts and gold answers are ``benchmarks/generation.py``'s SQuAD rows.

- ``before``: the model's own cache (transformers' sliding-window layers): no loss in the prompts' forward (the
  evaluation ran the loss pass apart), no stacked prefill, no reserved cache.
- ``after``: the evaluation as it runs now: the loss computed in the prompts' forward, the reserved cache.

Both must give the same answers and the same loss (fp32). Timed in CPU seconds of this process, the two
alternating ``--repeats`` times; the fastest repeat of each.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sliding_window_eval.py [--rows 16] [--batch 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[1] / ".." / "shared" / "data"))
    ap.add_argument("--out", default="benchmarks/results/epyc/sliding_window_eval.json")
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from generation import _prompts  # the same rows, encoded as evaluation encodes them

    from surefit.data.collate import PadCollator
    from surefit.eval import generate
    from surefit.eval.generate import Decode, LossPass, greedy_generate
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.tasks.sft.train_sft import eos_token_ids, head_loss
    from surefit.training.loop import evaluate_loss
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import make_accelerator
    from surefit.training.speedups import fused_head
    from surefit.training.speedups.lora_fast import fuse_lora
    from surefit.training.speedups.lora_generate import lean_lora

    source = resolve_model(None)
    path = model_folder(source, log=lambda _: None)
    tok, _ = load_tokenizer(path, source)
    llama = load_causal_lm(path, source)
    fields = {k: v for k, v in llama.config.to_dict().items() if k in MistralConfig().to_dict()}
    fields.update(sliding_window=4096, architectures=["MistralForCausalLM"], model_type="mistral")
    model = MistralForCausalLM(MistralConfig(**fields))
    missing = model.load_state_dict(llama.state_dict(), strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"lm_head.weight"}, missing
    if "lm_head.weight" in missing.missing_keys:
        model.tie_weights()
    del llama
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    fuse_lora(model)
    model.eval()
    acc = make_accelerator("fp32", lora=True)
    eos = sorted(set(eos_token_ids(model, tok)) | {t for t in tok.convert_tokens_to_ids(["<|im_end|>"]) if t is not None})
    prompts, longest, feats = _prompts("squad", args.rows, Path(args.shared), tok)
    max_new = min(longest + 4, 256)
    own_cache = generate._own_cache

    def before() -> tuple[list[list[int]], float]:
        generate._own_cache = lambda m, arg: {}  # type: ignore[assignment]
        try:
            loss = evaluate_loss(model, feats, [len(f["input_ids"]) for f in feats],
                                 loss_fn=functools.partial(causal_lm_loss_sum, fused=fused_head),
                                 collate=PadCollator(pad_token_id=tok.pad_token_id), batch_size=args.batch,
                                 accelerator=acc, say=lambda _: None)
            out = greedy_generate(model, prompts, Decode(pad_token_id=tok.pad_token_id, eos_token_ids=eos,
                                                         max_new_tokens=max_new, batch_size=args.batch),
                                  lora_context=lean_lora)
        finally:
            generate._own_cache = own_cache  # type: ignore[assignment]
        return out, float(loss)

    def after() -> tuple[list[list[int]], float]:
        one = LossPass(feats, functools.partial(head_loss, fused=True))
        out = greedy_generate(model, prompts, Decode(pad_token_id=tok.pad_token_id, eos_token_ids=eos,
                                                     max_new_tokens=max_new, batch_size=args.batch, loss_pass=one),
                              lora_context=lean_lora)
        return out, one.loss_sum / max(1, one.tokens)

    runs: dict[str, list[dict]] = {"before": [], "after": []}
    answers: dict[str, list[list[int]]] = {}
    losses: dict[str, float] = {}
    for r in range(args.repeats):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            cpu, wall = time.process_time(), time.perf_counter()
            with torch.no_grad():
                answers[name], losses[name] = (before if name == "before" else after)()
            runs[name].append({"cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2),
                               "load": round(os.getloadavg()[0], 2)})
    best = {k: min(x["cpu_s"] for x in v) for k, v in runs.items()}
    result = {"rows": args.rows, "batch": args.batch, "max_new_tokens": max_new, "threads": torch.get_num_threads(),
              "runs": runs, "best_cpu_s": best, "speed_up": round(best["before"] / best["after"], 3),
              "answers_equal": answers["before"] == answers["after"],
              "loss": losses, "loss_rel_diff": abs(losses["before"] - losses["after"]) / abs(losses["before"])}
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
