"""Where a surefit training step's wall time goes, timed by the clock around its parts (no profiler), 1 and 2 threads.

Why not torch.profiler: on the 2-core VMs of this project it stretched a 6 s chat step to 10-16 s and moved the
shares around (``profile_step.py`` still lists what runs, by operator and shape). Here the step is the real one as
``benchmarks/row_chunks_step.py`` builds it: the embedded SmolLM2-135M-Instruct with LoRA r=16 (alpha 32, dropout 0.05,
seeded masks) on every linear layer, fused LoRA forward, frozen weights in bf16, bf16 autocast, activations saved in
bf16, the fused LM head; one micro-batch of ``--rows`` x ``--length`` random tokens, the first quarter of each row
unsupervised (the chat workload's shape: its longest batch is 4 x 347). Clocks around:

- ``lora_<out>``: the fused LoRA layers (``_LoraMixed``) by output width, forward and backward (their frozen matmul
  included);
- ``mlp``: the gated MLP with its LoRA ``down_proj`` (``_SwiGLUDown``), forward and backward;
- ``norm``: the RMSNorms; ``head``: the fused LM head and cross-entropy (its forward computes the gradients too);
- ``attention``: ``scaled_dot_product_attention``'s forward (its backward runs inside autograd's, in ``rest``).

``frozen_matmuls`` is the floor no elementwise work can go under: the same step's frozen bf16 matmuls alone (each
layer's seven in the forward and their input gradients in the backward, the head's two on the supervised rows), with
the model's weights, timed in the same rounds.

Variants: ``--threads`` (torch's intra-op threads) times ``--attention`` (``fp32``: training's attention on fp32 q/k/v,
surefit's default on a CPU; ``bf16``: autocast's copies, ``lora_fast.FP32_ATTENTION_ON_CPU`` off) times ``--gate-up``
(``16``: gate_proj and up_proj hand the MLP 16-bit outputs, the default; ``32``: fp32 sums, ``lora_fast.GATE_UP_16``
off). Rounds alternate the order; medians of wall seconds; where a thread count has two variants, their paired
differences.

    .venv/bin/python benchmarks/step_parts.py --threads 2 --attention fp32 --gate-up 32,16 --alone-repeats 0

    .venv/bin/python benchmarks/step_parts.py --out results/epyc_zen4/step_parts   # .json and .md
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2,1", help="comma-separated torch thread counts")
    ap.add_argument("--attention", default="bf16,fp32", help="comma-separated: bf16 (autocast's), fp32")
    ap.add_argument("--gate-up", default="16", help="comma-separated: 16 (16-bit gate/up outputs), 32 (fp32 sums)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=347)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None, help="results path without suffix (.json and .md are written)")
    ap.add_argument("--alone-repeats", type=int, default=5, help="rounds of the attention-alone comparison (0: none)")
    ap.add_argument("--report", default=None, help="a result's .json: write its .md again and stop")
    args = ap.parse_args()
    if args.report:
        rec = json.loads(Path(args.report).read_text())
        Path(args.report).with_suffix(".md").write_text(_markdown(rec) + "\n")
        return

    import benchlib
    import torch
    import torch.nn.functional as F
    import transformers.integrations.sdpa_attention as sdpa_module
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import surefit.training.dropout as seeded
    import surefit.training.speedups.fused_head as fused_head
    import surefit.training.speedups.lora_fast as lf
    from surefit.models import model_folder, resolve_model
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.precision import store_frozen_in

    torch.set_flush_denormal(True)  # as surefit's training does on a CPU (training/precision.py)
    model = AutoModelForCausalLM.from_pretrained(model_folder(resolve_model(None)), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"))
    seeded.seed_dropout(model)
    lf.fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    model.train()

    clock: dict[str, float] = collections.defaultdict(float)

    def timed(cls: Any, key: Any) -> None:
        forward, backward = cls.forward, cls.backward

        def fwd(ctx: Any, *a: Any) -> Any:
            t = time.perf_counter()
            out = forward(ctx, *a)
            clock[(key(a) if callable(key) else key) + ".forward"] += time.perf_counter() - t
            ctx._surefit_bench_key = key(a) if callable(key) else key
            return out

        def bwd(ctx: Any, *a: Any) -> Any:
            t = time.perf_counter()
            out = backward(ctx, *a)
            clock[ctx._surefit_bench_key + ".backward"] += time.perf_counter() - t
            return out

        cls.forward, cls.backward = staticmethod(fwd), staticmethod(bwd)

    timed(lf._LoraMixed, lambda a: f"lora_{a[2].shape[0]}")
    timed(lf._SwiGLUDown, "mlp")
    timed(lf._RmsNormCpu, "norm")
    timed(fused_head._FusedLinearCrossEntropy, "head")
    plain_sdpa = F.scaled_dot_product_attention

    def sdpa(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = plain_sdpa(*a, **kw)
        clock["attention.forward"] += time.perf_counter() - t
        return out

    sdpa_module.torch.nn.functional.scaled_dot_product_attention = sdpa  # the module transformers calls it from

    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.length))
    labels = ids.clone()
    labels[:, : args.length // 4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def step() -> dict[str, float]:
        clock.clear()
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with seeded.training_rows(0, 1, list(range(args.rows))):
            with torch.autocast("cpu", dtype=torch.bfloat16), lf.SavedActivationsIn():
                loss, n = causal_lm_loss_sum(model, batch, fused=fused_head)
            t1 = time.perf_counter()
            (loss / n).backward()
        t2 = time.perf_counter()
        parts = dict(clock)
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t2 - t0, "loss": (loss / n).item(), **parts}

    # The floor: the step's frozen matmuls alone, the model's own bf16 weights, the step's shapes.
    tokens = args.rows * args.length
    supervised = int((labels[:, 1:] != -100).sum())
    linears = [m.base_layer.weight for m in model.modules() if lf.is_lora_linear(m)]
    head_w = model.get_output_embeddings().weight.to(torch.bfloat16)
    x_by_width = {w: torch.randn(tokens, w).bfloat16() for w in {int(x.shape[1]) for x in linears}}
    g_by_width = {w: torch.randn(tokens, w).bfloat16() for w in {int(x.shape[0]) for x in linears}}
    hs, gs = torch.randn(supervised, head_w.shape[1]).bfloat16(), torch.randn(supervised, head_w.shape[0]).bfloat16()

    def frozen_matmuls() -> float:
        t = time.perf_counter()
        for w in linears:
            F.linear(x_by_width[int(w.shape[1])], w)
            g_by_width[int(w.shape[0])] @ w
        F.linear(hs, head_w)
        gs @ head_w
        return time.perf_counter() - t

    gate_up = args.gate_up.split(",")
    variants = list(itertools.product([int(t) for t in args.threads.split(",")], args.attention.split(","), gate_up))

    def label(t: int, a: str, g: str) -> str:  # the names of runs before --gate-up existed, where it is not varied
        return f"{t}T_{a}" if len(gate_up) == 1 else f"{t}T_{a}_gu{g}"

    runs: dict[str, list[dict[str, float]]] = {label(*v): [] for v in variants}
    floors: dict[int, list[float]] = {t: [] for t, _, _ in variants}

    def run(t: int, a: str, g: str) -> dict[str, float]:
        torch.set_num_threads(t)
        lf.FP32_ATTENTION_ON_CPU = a == "fp32"
        lf.GATE_UP_16 = g == "16"
        return step()

    for v in variants:  # warm-up: oneDNN's kernels for these shapes, the allocator's heap
        run(*v)
        frozen_matmuls()
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            runs[label(*v)].append(run(*v))
            floors[v[0]].append(frozen_matmuls())
    summary: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        keys = sorted({k for x in rs for k in x})
        summary[name] = {k: round(statistics.median(x.get(k, 0.0) for x in rs), 6 if k == "loss" else 4) for k in keys}
        summary[name]["frozen_matmuls"] = round(statistics.median(floors[int(name.split("T_")[0])]), 4)
        print(name, json.dumps(summary[name]))
    alone = attention_alone(args.rows, args.length, args.alone_repeats) if args.alone_repeats else {}
    record = {"benchmark": "step_parts", "machine": benchlib.machine_info(), "rows": args.rows, "length": args.length,
              "supervised_tokens": supervised, "rounds": args.rounds, "medians_s": summary, "attention_alone_ms": alone,
              "runs": runs, "command": ".venv/bin/python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        out.with_suffix(".md").write_text(_markdown(record) + "\n")
        print(f"wrote {out.with_suffix('.md')} and .json")


def attention_alone(rows: int, length: int, repeats: int) -> dict[str, dict[str, float]]:
    """One layer's attention of the step's shape (SmolLM2: 9 query and 3 key/value heads of 64, causal), forward and
    backward, 2 threads: torch's kernel on bf16 and on fp32 inputs, and plain bf16 matmuls with an fp32 softmax (a lead
    once noted in docs/performance.md); milliseconds (best of each round, median of rounds) and the output's and
    gradients' relative error against fp64."""
    import math

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    torch.manual_seed(0)
    heads, kv, dim = 9, 3, 64
    q0, k0 = torch.randn(rows, heads, length, dim) * 1.5, torch.randn(rows, kv, length, dim) * 1.5
    v0, go = torch.randn(rows, kv, length, dim), torch.randn(rows, heads, length, dim)
    above = torch.ones(length, length, dtype=torch.bool).triu(1)

    def kernel(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def matmuls(q: Any, k: Any, v: Any) -> Any:
        g = heads // kv
        s = torch.matmul(q.reshape(rows, kv, g * length, dim), k.transpose(-1, -2)).view(rows, kv, g, length, length)
        p = torch.softmax(s.float().mul_(1 / math.sqrt(dim)).masked_fill_(above, float("-inf")), -1).to(q.dtype)
        return torch.matmul(p.view(rows, kv, g * length, length), v).view(rows, heads, length, dim)

    refs = [t.double().requires_grad_() for t in (q0, k0, v0)]
    out = kernel(*refs)
    out.backward(go.double())
    ref = (out.detach(), *(t.grad for t in refs))
    variants = {"kernel_bf16": (torch.bfloat16, kernel), "kernel_fp32": (torch.float32, kernel),
                "matmuls_bf16_softmax_fp32": (torch.bfloat16, matmuls)}

    def once(dtype: Any, f: Any) -> tuple[float, float, tuple]:
        ins = [t.to(dtype).clone().requires_grad_() for t in (q0, k0, v0)]
        t0 = time.perf_counter()
        o = f(*ins)
        t1 = time.perf_counter()
        o.backward(go.to(dtype))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, (o.detach(), *(t.grad for t in ins))

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for dtype, f in variants.values():  # warm-up
        once(dtype, f)
    for r in range(repeats):
        for name, (dtype, f) in (list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]):
            best = min((once(dtype, f)[:2] for _ in range(3)), key=sum)
            times[name].append(best)
    result = {}
    for name, (dtype, f) in variants.items():
        got = once(dtype, f)[2]
        errors = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, ref, strict=True)]
        result[name] = {"forward_ms": round(1e3 * statistics.median(t[0] for t in times[name]), 2),
                        "backward_ms": round(1e3 * statistics.median(t[1] for t in times[name]), 2),
                        "error_out": errors[0], "error_dq": errors[1], "error_dk": errors[2], "error_dv": errors[3]}
        print("attention alone", name, json.dumps(result[name]))
    return result


def _markdown(rec: dict[str, Any]) -> str:
    med = rec["medians_s"]
    names = list(med)
    parts = sorted({k for m in med.values() for k in m if "." in k})
    lines = [f"# step_parts: one chat-shaped training step, {rec['rows']} x {rec['length']} tokens "
             f"({rec['supervised_tokens']} supervised), wall seconds (medians of {rec['rounds']} alternating rounds)", "",
             "| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in ["step", "forward", "backward", "frozen_matmuls", *parts]:
        lines.append(f"| {key} | " + " | ".join(f"{med[n].get(key, 0.0):.3f}" for n in names) + " |")
    lines.append("| loss | " + " | ".join(f"{med[n]['loss']:.6f}" for n in names) + " |")
    for t in sorted({n.split("T_")[0] for n in names}, reverse=True):
        pair = [n for n in names if n.split("T_")[0] == t]
        if len(pair) != 2:
            continue
        if pair == [f"{t}T_fp32", f"{t}T_bf16"]:
            pair.reverse()
        (na, a), (nb, b) = ((n, rec["runs"][n]) for n in pair)
        what = f"{nb} minus {na}" if "_gu" in nb else "fp32 attention minus bf16"
        faster = nb if "_gu" in nb else "fp32"
        lines += ["", f"Paired rounds, {t} thread(s), {what} (negative: {faster} faster): " + "; ".join(
            f"{key} median {statistics.median(y[key] - x[key] for x, y in zip(a, b, strict=True)):+.3f} s, "
            f"{faster} faster in {sum(y[key] < x[key] for x, y in zip(a, b, strict=True))} of {len(a)}"
            for key in ("step", "forward", "backward"))]
    if rec.get("attention_alone_ms"):
        lines += ["", "One layer's attention alone at this shape (9 query, 3 key/value heads of 64, causal), 2 threads, "
                  "milliseconds, and relative error against fp64:", "",
                  "| variant | forward ms | backward ms | output error | dq error | dk error | dv error |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in rec["attention_alone_ms"].items():
            lines.append(f"| {name} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['error_out']:.1e} | "
                         f"{r['error_dq']:.1e} | {r['error_dk']:.1e} | {r['error_dv']:.1e} |")
    lines += ["", "`frozen_matmuls`: the step's frozen bf16 matmuls alone (forward and input gradients, the head's on "
              "the supervised rows), timed in the same rounds. `lora_<out>` and `mlp` include their frozen matmul. "
              "`attention.forward` only: its backward runs inside autograd's and is part of `backward`.", "",
              f"Command: `{rec['command']}`", "", _machine_line(rec["machine"])]
    return "\n".join(lines)


def _machine_line(m: dict[str, Any]) -> str:
    flags = ", ".join(f for f in m["cpu_flags"] if f.startswith(("avx512_bf16", "amx")) or f == "avx2")
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    return f"Machine: {m['cpus_usable']} usable cores, {m['cpu_model']} ({flags}), {m['mem_total_gb']} GB; {versions}."


if __name__ == "__main__":
    main()
