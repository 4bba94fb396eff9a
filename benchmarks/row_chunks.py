"""The gated MLP's backward and the RMSNorm on row chunks (CPU): the fused LoRA path's elementwise work before and after.

Both are memory-bound chains of elementwise operations over [tokens, width] fp32 tensors. Whole-tensor, each
operation streams its operands through memory; on row chunks of ``lora_fast.CPU_CHUNK_ELEMENTS`` the chain's
temporaries stay in the core's cache. Shapes of a SmolLM2-135M chat micro-batch (4 x 289 tokens, hidden 576, MLP
1536); ``--sets`` different input sets are cycled so that no input is in cache when it is read (as in a real step,
where each layer's tensors were written long before its backward).

- ``swiglu``: the backward of ``h = silu(gate) * up`` with dL/dh's two 16-bit paths summed in fp32 and the dropout
  mask applied: ``before`` is the whole-tensor sequence ``_SwiGLUDown.backward`` ran until 2026-11-27 (copied here),
  from ``gate`` and ``up`` turned back into fp32 whole (as the activation store gave them back), ``after`` is
  ``lora_fast._swiglu_backward`` on the bf16 ``gate`` and ``up`` that ``_SwiGLUDown`` now saves itself.
- ``rmsnorm``: forward + backward of transformers' RMSNorm: ``before`` is torch's ``rms_norm`` under autograd (what
  ``_rms_norm_forward`` ran on a CPU before), ``after`` is ``lora_fast._RmsNormCpu``.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/row_chunks.py --threads 1,2 --out results/row_chunks.json

Times: milliseconds per call (one layer), the best of ``--rounds`` rounds over all sets, wall clock.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def swiglu_before(gate: Any, up: Any, gw: Any, gx: Any, kf: Any) -> tuple[Any, Any, Any]:
    import torch

    g, u = gate.float(), up.float()  # (the saved bf16 gate and up, unpacked to fp32)
    sig = torch.sigmoid(g)
    silu = g * sig
    hd = torch.mul((silu * u).to(torch.bfloat16), kf, out=torch.empty(g.shape))
    grad_h = gw.float().add_(gx * kf)
    grad_up = grad_h * silu
    dsilu = sig.neg().add_(1).mul_(g).add_(1).mul_(sig)
    grad_gate = grad_h.mul_(u).mul_(dsilu)
    return hd, grad_gate, grad_up


def swiglu_after(gate: Any, up: Any, gw: Any, gx: Any, kf: Any) -> tuple[Any, ...]:
    import torch

    from surefit.training.speedups import lora_fast

    return lora_fast._swiglu_backward(gate, up, kf, (gw, gx), torch.bfloat16,  # saved in bf16, read chunk by chunk
                                      (True, torch.float32, torch.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sets", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    sys.path.insert(0, str(HERE))
    import benchlib

    from surefit.training.speedups import lora_fast

    rows, hidden, width = 4 * 289, 576, 1536
    g = torch.Generator().manual_seed(0)
    mlp = [(torch.randn(rows, width, generator=g).bfloat16(), torch.randn(rows, width, generator=g).bfloat16(),
            torch.randn(rows, width, generator=g).bfloat16(), (torch.randn(rows, width, generator=g) * 0.01).bfloat16(),
            (torch.rand(rows, width, generator=g) > 0.05).to(torch.bfloat16)) for _ in range(args.sets)]
    norm = LlamaRMSNorm(hidden).requires_grad_(False)
    acts = [(torch.randn(4, 289, hidden, generator=g), torch.randn(4, 289, hidden, generator=g))
            for _ in range(args.sets)]

    def norm_before(x: Any) -> Any:
        return norm.weight * F.rms_norm(x, (hidden,), eps=norm.variance_epsilon).to(x.dtype)

    def norm_after(x: Any) -> Any:
        return lora_fast._rms_norm_forward(norm, x)

    def time_it(fn: Any, sets: list, rounds: int) -> float:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for s in sets:
                fn(*s)
            best = min(best, (time.perf_counter() - t0) / len(sets) * 1e3)
        return round(best, 3)

    def norm_step(f: Any) -> Any:
        def run(x: Any, dy: Any) -> None:
            x = x.detach().requires_grad_()
            f(x).backward(dy)
        return run

    # the two sides agree (fp32 rounding)
    a, b = swiglu_before(*mlp[0]), swiglu_after(*mlp[0])
    agree = {"swiglu_max_rel": max(float((x.float() - y.float()).abs().max() / x.float().abs().max())
                                   for x, y in zip(a, b, strict=True))}
    results: list[dict[str, Any]] = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        row = {"threads": threads}
        for _ in range(2):  # alternating, twice: the best of each
            for name, fn, sets in (("swiglu_before", swiglu_before, mlp), ("swiglu_after", swiglu_after, mlp),
                                   ("rmsnorm_before", norm_step(norm_before), acts),
                                   ("rmsnorm_after", norm_step(norm_after), acts)):
                ms = time_it(fn, sets, args.rounds)
                row[name] = min(ms, row.get(name, float("inf")))
        results.append(row)
        print(json.dumps(row), flush=True)
    out = {"benchmark": "row_chunks", "machine": benchlib.machine_info(), "chunk_elements": lora_fast.CPU_CHUNK_ELEMENTS,
           "rows": rows, "sets": args.sets, "agreement": agree, "results": results,
           "command": "python " + " ".join(sys.argv)}
    print(json.dumps(agree))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
