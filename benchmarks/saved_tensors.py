"""What autograd saves for the backward pass in surefit's measured forward, listed by shape, dtype and the operation
that made each tensor, and whether the bf16 activation store packed it (``->bf16``).

A Qwen3-0.6B-shaped model with 2 layers (``--small``: tiny widths) trains for 2 steps through ``surefit.train``; the
planner's measurement of saved activations is wrapped to list what it counts. Made to find why QLoRA saved more
than 16-bit LoRA on an H100 (results/h100/README.md): compare ``--quantize 4bit`` with ``--quantize none``.

    python benchmarks/saved_tensors.py --quantize 4bit             # CPU: bf16 is emulated, about 2 minutes
    python benchmarks/saved_tensors.py --quantize none --small     # seconds
    python benchmarks/saved_tensors.py --quantize none --arch smollm2 --precision fp32   # the default model's widths
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def build(folder: Path, small: bool, tokenizer: str | None, arch: str = "qwen3") -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from surefit.models import model_folder, resolve_model

    torch.manual_seed(0)
    dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16) \
        if small else dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128)
    if arch == "smollm2":  # SmolLM2-135M's widths (the embedded default model)
        dims = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, num_hidden_layers=2, tie_word_embeddings=True, **dims))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=49152, num_hidden_layers=2, tie_word_embeddings=True, **dims))
    tok = AutoTokenizer.from_pretrained(tokenizer or model_folder(resolve_model(None)))
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantize", choices=("none", "4bit", "8bit"), default="4bit")
    ap.add_argument("--small", action="store_true", help="tiny widths (seconds on a CPU)")
    ap.add_argument("--arch", choices=("qwen3", "smollm2"), default="qwen3",
                    help="Qwen3-0.6B's widths (default) or SmolLM2-135M's")
    ap.add_argument("--precision", default=None, help="default: bf16 on a CPU, the run's own default on a GPU")
    ap.add_argument("--data", default=str(HERE.parent.parent / "shared" / "data" / "squad" / "dev-v1.1-part-a.json"))
    ap.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer files (default: the embedded model's)")
    args = ap.parse_args()

    import surefit
    import surefit.training.plan as plan
    from surefit.training.speedups.lora_fast import Packed, SavedActivationsIn, keep_saved

    listings: list[tuple[int, list]] = []

    def listing_measure(model: Any, run_forward: Any, packer: Any = None) -> int:
        # plan.measure_saved_bytes, with each distinct storage's origin kept
        seen: dict[tuple[int, int], tuple[int, tuple]] = {}

        def pack(t: torch.Tensor) -> Any:
            made_by = type(t.grad_fn).__name__ if t.grad_fn else ("leaf" if t.is_leaf else "no grad_fn")
            what = (tuple(t.shape), str(t.dtype).replace("torch.", ""), made_by)
            if packer is not None:
                packed = packer.pack(t)
                if type(packed) is Packed:
                    s = packed.tensor.untyped_storage()
                    seen[(s.data_ptr(), s.nbytes())] = (s.nbytes(), what + ("->bf16",))
                    return packed
            s = t.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = (s.nbytes(), what + ("",))
            return keep_saved(t)

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, SavedActivationsIn.unpack):
            out = run_forward()
        del out
        if packer is not None:
            packer.forget()
        agg: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
        for (ptr, _), (n, what) in seen.items():
            if ptr not in params:
                agg[what][0] += n
                agg[what][1] += 1
        total = sum(v[0] for v in agg.values())
        listings.append((total, sorted(agg.items(), key=lambda kv: -kv[1][0])))
        return total

    plan.measure_saved_bytes = listing_measure  # looked up by name at each call inside plan.py
    tmp = Path(tempfile.mkdtemp())
    build(tmp / "model", args.small, args.tokenizer, args.arch)
    cuda = torch.cuda.is_available()
    out = tmp / "run"
    surefit.train(task="sft", model=str(tmp / "model"), data=args.data, limit=24, max_steps=2, batch_size=4,
                  max_seq_length=512, lora_r=16, lora_alpha=32, lora_dropout=0.05, seed=0, val_fraction=0.2,
                  output_dir=str(out), overwrite=True, quantize=args.quantize,
                  **({"precision": args.precision} if args.precision else {} if cuda else {"precision": "bf16"}))
    measured = json.loads((out / "memory_plan.json").read_text()).get("measured", {})
    print(f"\nquantize={args.quantize} small={args.small} device={'cuda' if cuda else 'cpu'}"
          + (f" peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB" if cuda else ""))
    print("planner:", json.dumps(measured.get("saved_activations")))
    for total, rows in listings:
        print(f"saved for the backward pass: {total:,} bytes")
        print(f"{'bytes':>12} {'count':>5}  shape dtype (->bf16: packed) made by")
        for (shape, dtype, made_by, packed), (n, count) in rows[:20]:
            print(f"{n:>12,} {count:>5}  {shape} {dtype}{packed} {made_by}")


if __name__ == "__main__":
    main()
