"""Where a chat training step's resident memory goes: saved tensors, the C heap, and what glibc keeps.

The embedded SmolLM2-135M-Instruct as surefit trains it by default on a CPU with bf16 (frozen weights stored in bf16,
LoRA r=16 alpha 32 dropout 0.05 on every block linear, fused LoRA forward, keyed dropout, activations saved in bf16,
the fused LM head and loss),
on the longest batch of 4 of the first 16 rows of the chat workload (benchmarks/cpu_sft.py --workload chat). It runs
one forward whose saved tensors are counted by kind, then --steps optimizer steps on the same batch, each with the
kernel's peak-RSS mark reset before it (``/proc/self/clear_refs``), and reports per step: peak RSS, RSS after, process
CPU time, minor page faults, and glibc's heap (``mallinfo2``: arena size, bytes in use, bytes free).

    .venv/bin/python benchmarks/step_memory.py                          # glibc's defaults
    .venv/bin/python benchmarks/step_memory.py --mmap-threshold 1048576  # every block >= 1 MB mapped on its own
    .venv/bin/python benchmarks/step_memory.py --byte-masks             # dropout masks saved a byte per element
    .venv/bin/python benchmarks/step_memory.py --trim                   # the heap's free pages given back per step
    .venv/bin/python benchmarks/step_memory.py --gate-up 32             # gate/up as fp32 sums (before 2026-12-03)

Prints one JSON object and writes it to --out (default: nothing written). Use one torch thread on a shared machine
(OMP_NUM_THREADS=1); compare CPU seconds rather than wall seconds when other work runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _heap(libc: Any) -> dict[str, float]:
    m = libc.mallinfo2()
    mb = 1 << 20
    return {"heap_mb": round(m.arena / mb), "heap_in_use_mb": round(m.uordblks / mb),
            "heap_free_mb": round(m.fordblks / mb), "mapped_blocks_mb": round(m.hblkhd / mb)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--mmap-threshold", type=int, default=None, help="glibc M_MMAP_THRESHOLD in bytes (fixed)")
    ap.add_argument("--byte-masks", action="store_true", help="save dropout masks a byte per element (as before)")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each step (training/heap.py)")
    ap.add_argument("--trim-every-mb", type=int, default=None,
                    help="also malloc_trim(0) every N MB of activations packed in the forward pass")
    ap.add_argument("--epoch", action="store_true",
                    help="train on the epoch's batches in order (step_batches of --rows rows, seed 0, epoch 1), the "
                         "first --steps of them, instead of one repeated longest batch: shows how batch shapes grow "
                         "the heap")
    ap.add_argument("--pad-multiple", type=int, default=None,
                    help="pad each batch's length up to a multiple of this (PadCollator.pad_to_multiple_of)")
    ap.add_argument("--mallopt", action="append", default=[],
                    help="NAME=VALUE, glibc mallopt at start (M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, "
                         "M_MMAP_MAX, M_ARENA_MAX); repeatable")
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="fp32: frozen weights in fp32, no autocast, nothing packed (a CPU without bf16: --precision "
                         "auto there)")
    ap.add_argument("--gate-up", choices=("16", "32"), default="16",
                    help="32: gate_proj and up_proj return fp32 sums (lora_fast.GATE_UP_16 off; 16, the default: 16-bit)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    libc = _libc()
    if args.mmap_threshold is not None:
        assert libc.mallopt(-3, ctypes.c_int(args.mmap_threshold)) == 1  # M_MMAP_THRESHOLD
    codes = {"M_TRIM_THRESHOLD": -1, "M_TOP_PAD": -2, "M_MMAP_THRESHOLD": -3, "M_MMAP_MAX": -4, "M_ARENA_MAX": -8}
    for item in args.mallopt:
        name, value = item.split("=")
        assert libc.mallopt(codes[name], ctypes.c_int(int(value))) == 1, item

    import tempfile

    import cpu_sft
    import torch
    from peft import LoraConfig, get_peft_model

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.data.sampling import step_batches
    from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
    from surefit.training.dropout import seed_dropout, training_rows
    from surefit.training.heap import release_free_memory
    from surefit.training.loop import make_adamw
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import flush_denormals, store_frozen_in
    from surefit.training.speedups import fused_head, lora_fast
    from surefit.training.speedups.lora_fast import Packed, SavedActivationsIn, fuse_lora, keep_saved

    lora_fast.PACK_MASKS = not args.byte_masks
    lora_fast.GATE_UP_16 = args.gate_up == "16"
    if args.trim_every_mb is not None:
        SavedActivationsIn.release_every = args.trim_every_mb << 20

    torch.manual_seed(0)
    source = resolve_model(None)
    path = model_folder(source, log=print)
    tok, _ = load_tokenizer(path, source)
    rows_file = cpu_sft.chat_rows(Path(args.shared) / "chat" / "glaive_toolcall_en_demo.json", tok,
                                  Path(tempfile.mkdtemp(prefix="step_memory-")))
    rows = read_rows(rows_file, [])[: args.rows]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=cpu_sft.MAX_LEN)
    feats = [e.features() for e in examples]
    lengths = [len(e.input_ids) for e in examples]
    big = max(step_batches(lengths, cpu_sft.BATCH, 0, 1), key=lambda b: sum(lengths[i] for i in b))
    model = get_peft_model(load_causal_lm(path, source), LoraConfig(
        r=cpu_sft.LORA_R, lora_alpha=cpu_sft.LORA_ALPHA, lora_dropout=cpu_sft.LORA_DROPOUT, task_type="CAUSAL_LM",
        target_modules=cpu_sft.LORA_TARGETS))
    seed_dropout(model)
    half = args.precision == "bf16"
    if half:
        store_frozen_in(model, torch.bfloat16)  # what surefit's planner does under bf16 + LoRA
    fuse_lora(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_adamw(params, lr=cpu_sft.LR, weight_decay=0.0)
    collate = PadCollator(pad_token_id=tok.pad_token_id, pad_to_multiple_of=args.pad_multiple)
    plan = step_batches(lengths, cpu_sft.BATCH, 0, 1)[: args.steps] if args.epoch else [big] * args.steps
    if args.epoch:  # the counted forward on the epoch's first batch, as a run starts (not its longest)
        big = plan[0]
    batch = collate([feats[i] for i in big])
    record: dict[str, Any] = {"batch": {"rows": len(big), "tokens": sum(lengths[i] for i in big),
                                        "padded": len(big) * max(lengths[i] for i in big)},
                              "epoch": args.epoch, "pad_multiple": args.pad_multiple, "mallopt": args.mallopt,
                              "mmap_threshold": args.mmap_threshold, "byte_masks": args.byte_masks,
                              "trim": args.trim, "precision": args.precision, "gate_up": args.gate_up, "trim_every_mb": args.trim_every_mb, "torch_threads": torch.get_num_threads(),
                              "rss_before_mb": round(_status_mb("VmRSS"))}

    # One forward with its saved tensors counted (distinct storages, parameters excluded), by kind.
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kinds: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()

    class Counting(SavedActivationsIn):
        def pack(self, t: torch.Tensor) -> Any:
            out = super().pack(t) if half else keep_saved(t)  # fp32 runs store nothing in bf16
            kept = out.tensor if isinstance(out, Packed) else t
            ptr = kept.untyped_storage().data_ptr()
            if ptr not in seen and ptr not in param_ptrs:
                seen.add(ptr)
                width = "x".join(str(s) for s in kept.shape[2:]) or "-"
                kinds[f"{str(kept.dtype).replace('torch.', '')} [..., {width}]"] += kept.untyped_storage().nbytes()
            return out

    Path("/proc/self/clear_refs").write_text("5")
    with training_rows(0, 1, big), flush_denormals(torch.device("cpu")):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half), Counting():
            loss, n = causal_lm_loss_sum(model, batch, fused=fused_head)
        record["first_forward"] = {"rss_after_mb": round(_status_mb("VmRSS")), **_heap(libc),
                                   "saved_mb": round(sum(kinds.values()) / 2**20),
                                   "saved_by_kind_mb": {k: round(v / 2**20, 1) for k, v in kinds.most_common()}}
        (loss / n).backward()
        del loss
        opt.zero_grad(set_to_none=True)
        if args.trim:
            release_free_memory()

        def step(rows: list[int]) -> float:
            batch = collate([feats[i] for i in rows])
            with training_rows(0, 1, rows):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half), \
                        (SavedActivationsIn() if half else contextlib.nullcontext()):
                    loss, n = causal_lm_loss_sum(model, batch, fused=fused_head)
                (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.trim:
                release_free_memory()
            return loss.item() / n

        record["steps"] = []
        for rows_of_step in plan:
            Path("/proc/self/clear_refs").write_text("5")
            t0, c0, r0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            loss_value = step(rows_of_step)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            width = max(lengths[i] for i in rows_of_step)
            if args.pad_multiple and width % args.pad_multiple:
                width += args.pad_multiple - width % args.pad_multiple
            record["steps"].append({"shape": [len(rows_of_step), width],
                                    "tokens": sum(lengths[i] for i in rows_of_step), "wall_s": round(time.perf_counter() - t0, 2),
                                    "cpu_s": round(time.process_time() - c0, 2),
                                    "sys_s": round(r1.ru_stime - r0.ru_stime, 2),
                                    "minor_faults": r1.ru_minflt - r0.ru_minflt,
                                    "peak_rss_mb": round(_status_mb("VmHWM")), "rss_after_mb": round(_status_mb("VmRSS")),
                                    **_heap(libc), "loss": round(loss_value, 6)})
    record["load_average"] = os.getloadavg()
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
