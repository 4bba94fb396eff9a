"""Whole-shard loads per epoch for --task custom on .npz shards under --max_memory_gb: the plain shuffled order
against the shard-aware order the custom task uses (``TensorData.epoch_order``).

    .venv/bin/python benchmarks/shard_reads.py [--shards 16] [--cache_shards 4] [--out benchmarks/results/shard_reads]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from surefit.data.sampling import step_batches
from surefit.data.shards import TensorData
from surefit.units import GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--rows", type=int, default=64, help="rows per shard")
    ap.add_argument("--cache_shards", type=int, default=4, help="the bound, in shards")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for s in range(args.shards):
            np.savez(Path(tmp) / f"part-{s:03d}.npz", x=rng.random((args.rows, 256), dtype=np.float32))
        shard_bytes = args.rows * 256 * 4
        bound = (args.cache_shards + 0.5) * shard_bytes / GiB
        result = {"shards": args.shards, "rows_per_shard": args.rows, "cache_shards": args.cache_shards,
                  "batch_size": args.batch_size, "loads_per_epoch": {}}
        for name in ("shuffled", "shard_aware"):
            td = TensorData(tmp, max_memory_gb=bound)
            loads = []
            for epoch in range(1, args.epochs + 1):
                if name == "shuffled":
                    batches = step_batches([1] * len(td), args.batch_size, 0, epoch)
                else:
                    order = td.epoch_order([0, epoch])
                    batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
                before = td.shard_loads
                for b in batches:
                    td.batch(b)
                loads.append(td.shard_loads - before)
            result["loads_per_epoch"][name] = loads
            print(f"{name:12s} whole-shard loads per epoch: {loads} ({args.shards} shards, cache holds "
                  f"{args.cache_shards})")
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
