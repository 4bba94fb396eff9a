"""Generate the custom example's tensor shards: one-hot token features [N, 20, vocab] float32 and labels [N] int64.

    python examples/custom/make_shards.py                 # runs/custom-data/{train,val}, vocab 271 (fits the model)
    python examples/custom/make_shards.py --vocab 4000 --out runs/custom-data-wrong   # the seed's mismatch

The label is the class (0-3) whose signal token appears most often in the sequence, so a model that projects and
pools the positions can learn it. Written as .npy shards (streamed by rows, so --max_memory_gb bounds the RAM).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def make(n: int, vocab: int, seq: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(4, vocab, size=(n, seq))
    labels = rng.integers(0, 4, size=n)
    for i, label in enumerate(labels):
        positions = rng.choice(seq, size=6, replace=False)
        tokens[i, positions[:4]] = label  # the winning signal token, 4 times
        tokens[i, positions[4:]] = rng.choice([c for c in range(4) if c != label], size=2)  # noise: other classes once
    one_hot = np.zeros((n, seq, vocab), dtype=np.float32)
    np.put_along_axis(one_hot, tokens[..., None], 1.0, axis=-1)
    return one_hot, labels.astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/custom-data")
    ap.add_argument("--vocab", type=int, default=271)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--val", type=int, default=400)
    ap.add_argument("--shard_rows", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    for split, n in (("train", args.train), ("val", args.val)):
        folder = Path(args.out) / split
        folder.mkdir(parents=True, exist_ok=True)
        for i, start in enumerate(range(0, n, args.shard_rows)):
            x, y = make(min(args.shard_rows, n - start), args.vocab, 20, rng)
            np.save(folder / f"inputs_embeds-{i:05d}.npy", x)
            np.save(folder / f"labels-{i:05d}.npy", y)
        print(f"wrote {n} examples to {folder} (inputs_embeds [{n}, 20, {args.vocab}] float32, labels [{n}] int64)")


if __name__ == "__main__":
    main()
