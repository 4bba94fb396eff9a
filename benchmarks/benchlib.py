"""Shared pieces of the side-by-side CPU benchmarks (``cpu_sft.py``, ``cpu_classify.py``).

Every configuration runs in its own Python process (``SCRIPT --worker NAME --workdir DIR``), so that one library's
imports, caches and allocator state never count against another, and peak RSS is that configuration's own. The parent
prepares the data once, starts the workers one after the other, reads each worker's JSON result and writes the report.

Nothing here changes how a library trains. The Trainer-based workers get three pieces of bookkeeping only:
:class:`EpochTimer` (a callback: seconds from ``on_epoch_begin`` to ``on_epoch_end``), :class:`CountingCollator`
(wraps the trainer's own collator and counts real, padded and supervised tokens) and :func:`recording` (a subclass
whose ``compute_loss`` calls the original and records ``loss x items`` so the epoch loss can be token-weighted, as
surefit's ``train_loss`` is).
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

T_PROCESS = time.perf_counter()  # imported first thing by every worker: the "setup" clock starts here


# ------------------------------------------------------------------------------------------------- machine & memory


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (``ru_maxrss``, KiB on Linux), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _vm_hwm_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


class PhasePeaks:
    """Exact peak RSS per phase of a worker (setup, warmup, train, eval, after).

    At each switch the kernel's high-water mark (``VmHWM``) is read as the ending phase's peak, then reset by writing
    5 to ``/proc/self/clear_refs`` (Linux), so the next phase starts counting from the RSS at that moment. A reset also
    lowers ``ru_maxrss``, so the whole-process peak is the largest phase peak (:func:`write_result` does that).
    """

    def __init__(self) -> None:
        self.phase = "setup"
        self.peaks: dict[str, float] = {}
        self.resets = True

    def switch(self, phase: str) -> None:
        hwm = _vm_hwm_mb()
        if hwm is None:
            return
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), hwm)
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.resets = False  # peaks are then cumulative: each phase's figure includes the earlier ones
        self.phase = phase

    def result(self) -> dict[str, float]:
        self.switch(self.phase)
        return {k: round(v, 1) for k, v in self.peaks.items()}


PHASES = PhasePeaks()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    except OSError:
        pass
    return []


def _mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """Cores, CPU, memory, library versions: recorded with every result."""
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("torch", "transformers", "peft", "accelerate", "datasets", "trl", "surefit"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "mem_total_gb": _mem_total_gb(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "cuda": torch.cuda.is_available(),
    }


def _cpu_busy_seconds() -> float | None:
    """CPU seconds all processes on the machine have spent busy since boot (/proc/stat), or None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ------------------------------------------------------------------------------------------------- worker plumbing


def read_files(folder: Path) -> int:
    """Read every file under ``folder`` once (into the page cache), so that the job after it starts as warm as any
    other; returns the bytes read."""
    total = 0
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    total += len(chunk)
    return total


def kept_surefit_settings(work: Path, out: Path, **extra: Any) -> dict[str, Any]:
    """``surefit.train`` settings of ``cpu_sft.py``'s surefit job on a work folder it kept (``--keep``: train.jsonl,
    val.jsonl, spec.json), writing to ``out``, with no start-up cache (the doctor and the planner run as on a cold
    start); ``extra`` adds or overrides settings."""
    spec = json.loads((work / "spec.json").read_text(encoding="utf-8"))
    return {"task": "sft", "data": str(work / "train.jsonl"), "val_data": str(work / "val.jsonl"), "epochs": 1,
            "batch_size": 4, "max_seq_length": 384, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lr": 2e-4,
            "warmup_ratio": 0.05, "seed": 0, "output_dir": str(out), "template": spec["template"], "no_cache": True,
            **extra}


def run_worker(script: Path, name: str, workdir: Path, timeout: float, extra: list[str] | None = None) -> dict[str, Any]:
    """Run ``script --worker name --workdir workdir`` in a fresh process; return its JSON result (or the failure)."""
    log = workdir / f"{name}.log"
    out = workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--worker", name, "--workdir", str(workdir), *(extra or [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DISABLE_MLFLOW_INTEGRATION": "TRUE",
           "WANDB_DISABLED": "true"}
    load_before = loadavg()
    busy0 = _cpu_busy_seconds()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log.open("w", encoding="utf-8") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    busy1 = _cpu_busy_seconds()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Contention: CPU the rest of the machine used while this worker ran, in cores (0 = quiet machine). The machine's
    # busy time minus the worker's own user + system time (a finished child's rusage), over the wall time.
    own = (children1.ru_utime - children0.ru_utime) + (children1.ru_stime - children0.ru_stime)
    others = ((busy1 - busy0 - own) / wall) if busy0 is not None and busy1 is not None and wall > 0 else None
    if rc == 0 and out.is_file():
        result = json.loads(out.read_text(encoding="utf-8"))
    else:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
        result = {"name": name, "error": f"worker exit {rc}", "log_tail": tail}
    result.update(process_seconds=round(wall, 1), load_before=load_before, load_after=loadavg(), log=str(log),
                  worker_cpu_cores=round(own / wall, 2) if wall > 0 else None,
                  others_cpu_cores=round(max(others, 0.0), 2) if others is not None else None)
    return result


def write_result(workdir: Path, name: str, record: dict[str, Any]) -> None:
    """The worker's last act: its result, with its peak RSS measured now (after everything it did), overall and per
    phase."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    phases = PHASES.result()
    record = {**record, "name": name, "peak_rss_mb": round(max([peak_rss_mb(), *phases.values()]), 1),
              "peak_rss_by_phase_mb": phases, "phase_peaks_exact": PHASES.resets,
              "process_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1)}
    (workdir / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")


def median_records(runs: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """One record from repeated runs of a configuration: the fastest run's, with the median of each other numeric
    key."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    # Training time: the fastest run (the one least slowed by other work on the machine, as timeit does); every other
    # number: the median.
    merged = dict(min(ok, key=lambda r: r.get("train_seconds") or float("inf")))
    for k in keys:
        vals = [r[k] for r in ok if isinstance(r.get(k), (int, float))]
        if vals and k != "train_seconds":
            merged[k] = statistics.median(vals)
    merged["repeats"] = len(ok)
    if len(ok) > 1:
        merged["train_seconds_all"] = [r.get("train_seconds") for r in ok]
    return merged


# ------------------------------------------------------------------------------------------------- Trainer helpers


def make_epoch_timer():
    """A TrainerCallback measuring the training epoch: ``on_epoch_begin`` to ``on_epoch_end``.

    That interval holds data loading and collation, forward, backward, clipping, optimizer and scheduler steps and the
    trainer's logging, but not the optimizer creation, model preparation or anything after the loop; it is the
    counterpart of surefit's ``time_per_epoch`` (the sum of its step times, collation included).
    """
    from transformers import TrainerCallback

    class EpochTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: float | None = None
            self.end: float | None = None
            self.train_begin: float | None = None

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.train_begin = time.perf_counter()

        def on_epoch_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.begin = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kw):  # noqa: ANN001
            self.end = time.perf_counter()

        @property
        def seconds(self) -> float:
            assert self.begin is not None and self.end is not None, "the epoch callbacks did not run"
            return self.end - self.begin

    return EpochTimer()


class CountingCollator:
    """Wraps a collator and counts what reaches the model: real (attention_mask) tokens, padded tokens (the batch's
    ``input_ids`` size), supervised tokens (labels != -100 after the causal shift, or examples for a classifier)."""

    def __init__(self, inner: Any, causal: bool = True) -> None:
        self.inner = inner
        self.causal = causal
        self.reset()

    def reset(self) -> None:
        self.real = 0
        self.padded = 0
        self.supervised = 0
        self.batches = 0
        self.longest = 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(features)
        ids = batch["input_ids"]
        self.padded += int(ids.numel())
        self.longest = max(self.longest, int(ids.shape[-1]))
        mask = batch.get("attention_mask")
        self.real += int(mask.sum()) if mask is not None else int(ids.numel())
        labels = batch.get("labels")
        if labels is not None:
            self.supervised += int((labels[:, 1:] != -100).sum()) if self.causal else int(labels.shape[0])
        self.batches += 1
        return batch

    def counts(self) -> dict[str, int]:
        return {"tokens_real": self.real, "tokens_padded": self.padded, "tokens_supervised_seen": self.supervised,
                "batches": self.batches, "longest_batch": self.longest}


def recording(trainer_cls: type, causal: bool = True) -> type:
    """A subclass of ``trainer_cls`` whose ``compute_loss`` also records the training loss, weighted by items.

    A Trainer step's loss is ``sum / num_items_in_batch`` (or the mean over the micro-batch's items when the model
    takes no loss kwargs); ``loss x that count`` is the step's loss sum, so ``sum of sums / sum of items`` over the
    epoch is the token-weighted (classifier: example-weighted) mean, the same definition as surefit's ``train_loss``.
    """

    class Recording(trainer_cls):  # type: ignore[misc, valid-type]
        bench_sum = 0.0
        bench_items = 0
        bench_steps = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            labels = inputs.get("labels")
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            if model.training and labels is not None:
                loss = out[0] if return_outputs else out
                if causal:
                    n = int((labels[:, 1:] != -100).sum())
                else:
                    n = int(labels.shape[0])
                # A causal LM's loss is sum / num_items_in_batch when the trainer passes that count (else the
                # micro-batch's token mean); a classifier's is the batch mean whatever the trainer counts.
                denom = float(num_items_in_batch) if causal and num_items_in_batch is not None else float(n)
                self.bench_sum += float(loss.detach().float()) * denom
                self.bench_items += n
                self.bench_steps += 1
            return out

        def bench_reset(self) -> None:
            self.bench_sum, self.bench_items, self.bench_steps = 0.0, 0, 0

        @property
        def bench_loss(self) -> float | None:
            return self.bench_sum / self.bench_items if self.bench_items else None

    Recording.__name__ = f"Recording{trainer_cls.__name__}"
    return Recording


def warm_up(trainer: Any, bf16: bool) -> float:
    """One forward + backward on the first training batch before the timed epoch, then every trace of it is undone
    (gradients zeroed, RNG states restored, counters reset by the caller). surefit's timed epoch follows its doctor
    dry run and its epoch-0 evaluation, which already ran the model; this gives the anchors the same warm start (kernel
    and allocator set-up) so that the first step's one-time costs do not count against them. Returns its seconds."""
    import numpy as np
    import torch

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if cuda else None)
    model = trainer.model
    model.train()
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in next(iter(trainer.get_train_dataloader())).items() if hasattr(v, "to")}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = trainer.compute_loss(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if cuda:
        torch.cuda.set_rng_state_all(states[3])
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------- report helpers


def command_line(script: str, args: Any) -> str:
    """The command that reproduces a run of ``script`` with these parsed arguments (the ones that change results)."""
    parts = [f".venv/bin/python benchmarks/{script}", f"--rows {args.rows}"]
    if getattr(args, "workload", None):
        parts.append(f"--workload {args.workload}")
    if getattr(args, "quick", False):
        parts.append("--quick")
    if getattr(args, "only", None):
        parts.append(f"--only {args.only}")
    if getattr(args, "repeats", 1) > 1:
        parts.append(f"--repeats {args.repeats}")
    if not getattr(args, "warmup", True):
        parts.append("--no-warmup")
    if getattr(args, "out", None):
        parts.append(f"--out {args.out}")
    return " ".join(parts)


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def ratio_line(label: str, value: float | None, goal: float, higher_is_better: bool, detail: str) -> tuple[str, bool | None]:
    """A markdown table row for one goal and whether it passed (None: not measurable in this run)."""
    if value is None:
        return f"| {label} | - | {'>=' if higher_is_better else '<='} {goal} | not measured | {detail} |", None
    ok = value >= goal if higher_is_better else value <= goal
    return (f"| {label} | {value:.2f}x | {'>=' if higher_is_better else '<='} {goal}x | "
            f"{'PASS' if ok else 'FAIL'} | {detail} |"), ok


def machine_lines(machine: dict[str, Any], loads: list[list[float]], others: list[float | None] | None = None) -> list[str]:
    v = machine["versions"]
    peak_load = max((x[0] for x in loads if x), default=None)
    cores = machine["cpus_usable"]
    lines = [
        f"Machine: {machine['cpu_count']} cores ({cores} usable; torch uses {machine['torch_threads']} threads), "
        f"{machine['cpu_model']} ({', '.join(machine['cpu_flags']) or 'no AVX-512'}), {machine['mem_total_gb']} GB RAM, "
        f"{machine['platform']}, Python {machine['python']}.",
        f"Versions: torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, accelerate "
        f"{v['accelerate']}, datasets {v['datasets']}, trl {v['trl']}, surefit {v['surefit']}.",
    ]
    busy_others = [x for x in (others or []) if x is not None]
    if busy_others:
        worst = max(busy_others)
        lines.append(
            f"Other work on the machine while each worker ran (CPU cores busy outside the worker, from /proc/stat): "
            f"{', '.join(f'{x:.1f}' for x in busy_others)} (max {worst:.1f} of {cores}). "
            + ("**Contended run: other processes shared the cores, so absolute times are inflated, unevenly from "
               "row to row (a worker's threads stall when another process holds a core), and the ratios are noisy.**"
               if worst > 0.25 else "The machine was otherwise quiet.")
        )
    elif peak_load is not None:
        busy = peak_load > cores + 0.5
        lines.append(
            f"Load average (1 min) seen at the start/end of the workers: up to {peak_load:.2f} on {cores} cores "
            f"(a benchmark worker itself accounts for about {min(cores, machine['torch_threads'])}). "
            + ("**Contended run: other work shared the cores, so absolute times are inflated and ratios are noisy.**"
               if busy else "No sign of other heavy work on the machine.")
        )
    return lines


def goal_rows(ok: dict[str, dict[str, Any]], anchors_default: list[str], anchors_all: list[str],
              unit: str = "tok/s", speed_goal: float = 2.5, bf16_goal: float = 2.0, rss_goal: float = 0.7,
              bf16_anchor: str | None = None) -> tuple[list[str], dict[str, bool | None]]:
    """The issue's goal lines, from finished results (each with ``tokens_per_s``, ``peak_rss_mb``, ``final_loss``).

    - speed at defaults: surefit (its defaults) >= ``speed_goal`` (2.5x) the fastest anchor at the anchor's own
      defaults;
    - speed given bf16: the best surefit run (defaults or surefit_*) >= ``bf16_goal`` (2x) the fastest anchor run of
      all (bf16 ones included); with ``bf16_anchor``, also surefit (defaults) against that anchor run;
    - memory: surefit (defaults) peak RSS <= ``rss_goal`` (0.7x) the leanest anchor run;
    - loss: surefit's final training loss within the anchors' noise (heuristic, stated in the row).
    """
    def best(names: list[str], key: str, pick: Any) -> tuple[str | None, float | None]:
        have = [(ok[n][key], n) for n in names if n in ok and ok[n].get(key) is not None]
        if not have:
            return None, None
        v, n = pick(have)
        return n, v

    sf = ok.get("surefit")
    variants = [ok[n] | {"name": n} for n in ok if n.startswith("surefit_")]  # e.g. surefit_fp32
    rows: list[str] = []
    verdicts: dict[str, bool | None] = {}
    fd_name, fd = best(anchors_default, "tokens_per_s", max)
    line, verdicts["speed_defaults"] = ratio_line(
        "surefit (defaults) tokens/s vs the fastest anchor at its defaults",
        sf["tokens_per_s"] / fd if sf and fd else None, speed_goal, True, f"fastest: {fd_name} ({fmt(fd, 0)} {unit})")
    rows.append(line)
    fa_name, fa = best(anchors_all, "tokens_per_s", max)
    best_sf = max([r for r in [sf, *variants] if r], key=lambda r: r["tokens_per_s"], default=None)
    line, verdicts["speed_bf16"] = ratio_line(
        f"surefit (best of its runs: {best_sf['name'] if best_sf else '-'}) tokens/s vs the fastest anchor, bf16 "
        "runs included", best_sf["tokens_per_s"] / fa if best_sf and fa else None, bf16_goal, True,
        f"fastest: {fa_name} ({fmt(fa, 0)} {unit})")
    rows.append(line)
    if bf16_anchor:
        b = ok.get(bf16_anchor, {}).get("tokens_per_s")
        line, verdicts["speed_bf16_anchor"] = ratio_line(
            f"surefit (defaults) tokens/s vs {bf16_anchor}", sf["tokens_per_s"] / b if sf and b else None, bf16_goal,
            True, f"{bf16_anchor}: {fmt(b, 0)} {unit}")
        rows.append(line)
    for sb in variants:
        if fa:
            rows.append(ratio_line(f"({sb['name']} tokens/s vs the same)", sb["tokens_per_s"] / fa, bf16_goal, True,
                                   f"{sb.get('precision')} against the fastest anchor")[0])
    ln_name, ln = best(anchors_all, "peak_rss_mb", min)
    line, verdicts["rss"] = ratio_line(
        "surefit (defaults) peak RSS vs the leanest anchor", sf["peak_rss_mb"] / ln if sf and ln else None, rss_goal,
        False, f"leanest: {ln_name} ({fmt(ln, 0)} MB)")
    rows.append(line)
    for sb in variants:
        if ln:
            rows.append(ratio_line(f"({sb['name']} peak RSS vs the same)", sb["peak_rss_mb"] / ln, rss_goal, False,
                                   "")[0])
    # Loss "within noise": the anchor runs spread by some amount (different initialisation of the new weights, batch
    # order, kernels, precision); surefit's runs must sit within that spread of the anchors' mean, or within 5% of it,
    # whichever is wider. A proper noise estimate needs repeated seeds; this is a heuristic and says so.
    losses = [ok[n]["final_loss"] for n in anchors_all if n in ok and ok[n].get("final_loss") is not None]
    verdicts["loss"] = None
    row = "| surefit final training loss vs the anchors' | - | within noise | not measured | |"
    ours = [r for r in [sf, *variants] if r and r.get("final_loss") is not None]
    if ours and losses:
        mean = sum(losses) / len(losses)
        tol = max(max(losses) - min(losses), 0.05 * mean)
        worst = max(abs(r["final_loss"] - mean) for r in ours)
        verdicts["loss"] = worst <= tol
        mine = ", ".join(f"{r['final_loss']:.4f}" for r in ours)
        row = (f"| surefit final training loss vs the anchors' | {mine} vs mean {mean:.4f} (anchors "
               f"{min(losses):.4f}-{max(losses):.4f}) | gap <= max(anchor range, 5% of mean) = {tol:.4f} | "
               f"{'PASS' if verdicts['loss'] else 'FAIL'} | largest gap {worst:.4f}; heuristic: one seed per "
               "configuration |")
    rows.append(row)
    # The same against the fp32 anchors only: bf16 autocast raises the anchors' own loss (their adapters' updates
    # are rounded away early on), which widens the band above; fp32 is the reference for "the same learning".
    fp32 = [ok[n]["final_loss"] for n in anchors_all if n in ok and ok[n].get("final_loss") is not None
            and ok[n].get("precision") == "fp32"]
    if ours and fp32:
        mean = sum(fp32) / len(fp32)
        tol = max(max(fp32) - min(fp32), 0.05 * mean)
        worst = max(abs(r["final_loss"] - mean) for r in ours)
        mine = ", ".join(f"{r['final_loss']:.4f}" for r in ours)
        rows.append(f"| (the same against the fp32 anchors only) | {mine} vs mean {mean:.4f} ({min(fp32):.4f}-{max(fp32):.4f}) | gap <= {tol:.4f} | "
                    f"{'PASS' if worst <= tol else 'FAIL'} | largest gap {worst:.4f} |")
    return rows, verdicts
