"""Dropout masks that do not depend on how an optimizer step is split into micro-batches.

Why: when a micro-batch runs out of memory the loop splits it and redoes the step (``training/memory.py``). With
torch's dropout the redone step draws other masks (the generator has moved on, and a mask's shape is the micro-batch's
padded shape), so the update differs. Here each element's mask is a hash of (run seed, optimizer step, the example's
index in the training set, the dropout module, the position in the sequence, the feature), so an example gets the
same masks whichever rows share its micro-batch, and a split step computes the same update. Deterministic masks are
also the same when gradient checkpointing recomputes a forward pass.

How: the loop sets the micro-batch's example indices (:func:`training_rows`) around each forward and backward pass;
:class:`SeededDropout` (which replaces the model's ``nn.Dropout`` modules, LoRA's included: :func:`seed_dropout`) and
the fused LoRA forward (``speedups/lora_fast.py``) ask :func:`keep_mask` for their masks. Keys are per (row, position):
a tensor ``[batch, length, ...]`` gets element ``(b, t, f)``'s bit from ``hash(key[b, t], module, f)``; with right
padding ``(t, f)`` does not depend on the padded length. A ``[batch, features]`` tensor (a pooled output) uses one key
per row. Outside a training micro-batch (no rows set: evaluation, a user calling the model) and for tensors of any
other layout, :class:`SeededDropout` is ``nn.Dropout`` exactly (torch's generator; such layouts are counted in
:data:`UNKEYED`).

Shared prompt prefixes (``speedups/prefixes.py``) compute a prefix once for several rows, so those rows share its
masks; to make that independent of the grouping too, under ``--share_prefixes`` a position before a row's first
supervised token is keyed by the tokens up to it (rows of a step with the same first tokens share the masks there, as
they share the hidden states) rather than by the example.

The hash is integer mixing in int64 (values below 2^32, products below 2^59: no overflow), vectorised in torch: the
same masks on every device (a CPU runs the mask's last round in int32 words, whose wrapping product has the same low
32 bits: tested bit for bit). The keys salted by a module are computed for all modules at once, once per micro-batch
(:meth:`_Rows.salted_keys`): per module call a mask is then four operations (kernel launches on a GPU).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: a product with a 32-bit value stays below 2^63
_POSITION, _FEATURE, _CONTENT = 0x2545F491, 0x6A09E667, 0x3C6EF372  # domain separation

# Names of dropout modules that met, inside a training micro-batch, a tensor whose layout has no per-row key (not
# ``[batch, length, ...]`` or ``[batch, features]``): they drew from torch's generator. name -> times.
UNKEYED: dict[str, int] = {}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash of ``x`` (int64 values in [0, 2^32)), in place."""
    x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def _hash_ints(*values: int | str) -> int:
    """A 32-bit hash of a few Python values (stable across processes and runs, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=4).digest(), "little")


def module_salt(name: str) -> int:
    """The 32-bit salt of a dropout module, from its qualified name in the model."""
    return _hash_ints("module", name)


class _Rows:
    """The keys of the micro-batch in progress: one per (row, position)."""

    def __init__(self, seed: int, step: int, rows: Sequence[int], device: torch.device | str | None):
        self.seed, self.step = seed, step
        self.base = torch.tensor([_hash_ints(seed, step, int(r)) for r in rows], dtype=torch.int64)
        self.content = _hash_ints("prefix", seed, step)
        self._explicit: torch.Tensor | None = None
        self._cache: dict[tuple[int, Any], torch.Tensor] = {}
        # (length, device) -> ({salt: row of the table}, the salted keys of a group of modules, [salts, batch, length])
        self._salted: dict[tuple[int | None, str], tuple[dict[int, int], torch.Tensor]] = {}

    @property
    def explicit(self) -> torch.Tensor | None:
        """Keys set by :func:`share_prefix_keys` or :func:`relayout` in place of the examples' own, if any."""
        return self._explicit

    @explicit.setter
    def explicit(self, keys: torch.Tensor | None) -> None:
        self._explicit = keys
        self._salted.clear()  # salted from the keys they replace

    def _position_hashes(self, length: int, device: Any) -> torch.Tensor:
        return _mix(torch.arange(length, dtype=torch.int64, device=device).add_(_POSITION))

    def example_keys(self, length: int, device: Any) -> torch.Tensor:
        """``[rows, length]``: each row's key at each position, from its example alone."""
        key = (length, str(device))
        if key not in self._cache:
            base = self.base.to(device)
            self._cache[key] = _mix(base[:, None] ^ self._position_hashes(length, device)[None, :])
        return self._cache[key]

    def keys(self, batch: int, length: int | None, device: Any) -> torch.Tensor | None:
        """``[batch, length]`` keys, or ``[batch, 1]`` (each row's first position) for ``length`` None."""
        if self.explicit is not None:
            k = self.explicit
            if length is None:
                return k[:, :1].to(device) if k.shape[0] == batch else None
            return k.to(device) if tuple(k.shape) == (batch, length) else None
        if length is None:
            length = 1
        if batch != self.base.numel():
            return None
        return self.example_keys(length, device)

    def salted_keys(self, batch: int, length: int | None, salt: int, device: Any) -> torch.Tensor | None:
        """``_mix(keys(batch, length) ^ salt)``: the keys of a module, salted by it.

        Why a table: this is the same for every module call of the micro-batch but for the salt, so it is computed
        for the live modules' salts at once (up to :data:`SALTED_ELEMENTS` values), in the order they were created
        (the model's), rather than in eleven small operations per call; elementwise, so the values are the same."""
        keys = self.keys(batch, length, device)
        if keys is None:
            return None
        ck = (length, str(device))
        hit = self._salted.get(ck)
        if hit is None or salt not in hit[0]:
            salts = live_salts()
            if salt not in salts:
                salts = [salt]
            per = max(1, SALTED_ELEMENTS // max(keys.numel(), 1))
            start = salts.index(salt) // per * per
            group = salts[start : start + per]
            table = _mix(keys[None] ^ torch.tensor(group, dtype=torch.int64, device=keys.device)[:, None, None])
            hit = ({s: i for i, s in enumerate(group)}, table)
            self._salted[ck] = hit  # one group at a time: at most SALTED_ELEMENTS values held
        return hit[1][hit[0][salt]]


# The most salted keys a micro-batch holds (int64: 32 MB): all modules at once for SmolLM2-135M or Qwen3-0.6B at batch
# 8 x 512 tokens (0.3 and 0.8 million), groups of modules for longer sequences.
SALTED_ELEMENTS = 1 << 22
# Every SeededDropout made, in creation order (the model's module order), for salted_keys' table.
_LIVE: weakref.WeakKeyDictionary[SeededDropout, None] = weakref.WeakKeyDictionary()


def live_salts() -> list[int]:
    """The salts of the live :class:`SeededDropout` modules in training mode that draw masks, without repeats."""
    return list(dict.fromkeys(m.salt for m in list(_LIVE.keys()) if m.training and 0 < m.p < 1))


_current: list[_Rows | None] = [None]  # module-level, not a contextvar: a backward pass may run in another thread


@contextmanager
def training_rows(seed: int, step: int, rows: Sequence[int], device: Any = None) -> Iterator[None]:
    """Within this context the model's forward and backward passes run the micro-batch whose rows are the training
    examples ``rows`` (dataset indices, in batch order) of optimizer step ``step``: dropout masks are keyed by them."""
    previous = _current[0]
    _current[0] = _Rows(seed, step, rows, device)
    try:
        yield
    finally:
        _current[0] = previous


def active() -> bool:
    """Whether a training micro-batch's rows are set."""
    return _current[0] is not None


def share_prefix_keys(input_ids: torch.Tensor, caps: Sequence[int]) -> None:
    """Key positions ``t < caps[b]`` of row ``b`` by its tokens up to ``t`` (right-padded ``input_ids``), so rows of a
    step that begin alike draw the same masks there whether or not a micro-batch computes their prefix once."""
    rows = _current[0]
    if rows is None or input_ids.dim() != 2 or input_ids.shape[0] != rows.base.numel():
        return
    n, length = input_ids.shape
    dev = input_ids.device
    pos = rows._position_hashes(length, dev)
    # A sum of per-(token, position) hashes: each below 2^32, so a running sum stays below 2^63; equal prefixes give
    # equal sums, and different ones collide with probability about 2^-32.
    terms = _mix(_mix(input_ids.to(torch.int64).add(_CONTENT)) ^ pos[None, :])
    summed = terms.cumsum(1)
    content = _mix(((summed & _M32) ^ (summed >> 32) ^ rows.content) & _M32)
    own = rows.example_keys(length, dev)
    before = torch.arange(length, device=dev)[None, :] < torch.tensor(list(caps), device=dev)[:, None]
    rows.explicit = torch.where(before, content, own)


def relayout(src_row: torch.Tensor, src_pos: torch.Tensor) -> None:
    """The micro-batch was laid out anew (shared prefixes): position ``(i, j)`` of the new layout is position
    ``src_pos[i, j]`` of row ``src_row[i, j]`` of the collated batch."""
    rows = _current[0]
    if rows is None:
        return
    old = rows.explicit
    if old is None:
        old = rows.example_keys(int(src_pos.max()) + 1 if src_pos.numel() else 1, src_pos.device)
    # Padding of the new layout may have positions past the collated length: their masks act on nothing kept.
    rows.explicit = old.to(src_pos.device)[src_row, src_pos.clamp(max=old.shape[1] - 1)]


def effective_p(p: float) -> float:
    """The drop probability the keyed masks use: ``p`` rounded to a multiple of 2^-16 (as the fused LoRA forward's)."""
    return round(p * _SPAN) / _SPAN


_SPAN = 1 << 16
_LOWEST = -(1 << 15)
CONTIGUOUS_WORDS_ON = {"cpu"}  # devices where keep_mask hashes in int32 words, compared contiguously (see there)
_features: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}


def _feature_hashes(pairs: int, device: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    key = (pairs, str(device), dtype)
    if key not in _features:
        # int32: the same low 32 bits (the values are below 2^32; those above 2^31 wrap to negative numbers)
        _features[key] = _mix(torch.arange(pairs, dtype=torch.int64, device=device).add_(_FEATURE)).to(dtype)
    return _features[key]


def keep_mask(shape: Sequence[int], p: float, salt: int, device: Any) -> torch.Tensor | None:
    """Boolean mask of ``shape``, True where kept (each element with probability ``1 - effective_p(p)``), from the
    micro-batch's keys; None outside a training micro-batch or when ``shape`` has no per-row key.

    One 32-bit hash per two elements (each takes 16 bits): the (row, position) key mixed with the module's salt, XORed
    with the feature pair's hash, then one multiply-xorshift round, which is a bijection of 32 bits, so each half is
    uniform; the cost is a few passes over half the elements (benchmarks/seeded_dropout_speed.py)."""
    rows = _current[0]
    if rows is None or len(shape) < 2:
        return None
    batch = int(shape[0])
    length: int | None = None
    if len(shape) == 2:  # [batch, features]: one key per row (position 0's)
        per, width = (batch, 1), int(shape[1])
    else:
        length = int(shape[1])
        per = (batch, length)
        width = 1
        for s in shape[2:]:
            width *= int(s)
    salted = rows.salted_keys(batch, length, salt, device)
    if salted is None:
        return None
    pairs = (width + 1) // 2
    # One multiply-xorshift round on the low 32 bits, y = h * _MUL mod 2^32, as halves: (y ^ y >> 16) & 0xFFFF and
    # y >> 16.
    if salted.device.type in CONTIGUOUS_WORDS_ON:
        # In int32: the xor's and the product's low 32 bits are those of int64 (the product wraps modulo 2^32), at half
        # the bytes per pass, and the comparison below reads y's two 16-bit words contiguously, which a CPU vectorises
        # (over int64's strided words it took 1.6x as long).
        h = salted.reshape(per).to(torch.int32)[..., None] ^ _feature_hashes(pairs, device, torch.int32)
        h.mul_(_MUL)
        halves = h.view(torch.int16).view(*per, pairs, 2)
    else:  # each extra operation is a kernel launch on a GPU, and strided reads cost it nothing
        h = salted.reshape(per)[..., None] ^ _feature_hashes(pairs, device)
        h.mul_(_MUL)  # below 2^59, exact in int64: its 16-bit words 0 and 1 (little-endian) are y's
        halves = h.view(torch.int16).view(*per, pairs, 4)[..., :2]
    halves[..., 0].bitwise_xor_(halves[..., 1])
    keep = (halves >= _LOWEST + round(p * _SPAN)).reshape(*per, 2 * pairs)
    if 2 * pairs != width:
        keep = keep[..., :width]
    return keep.reshape(tuple(int(s) for s in shape))


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` whose masks, inside a training micro-batch, are fixed by the examples (see the module docstring);
    elsewhere exactly ``nn.Dropout``. Scales kept elements by ``1 / (1 - p)``, with ``p`` rounded to a multiple of
    2^-16 inside a training micro-batch (:func:`effective_p`)."""

    def __init__(self, p: float = 0.5, inplace: bool = False, name: str = ""):
        super().__init__(p, inplace)
        self.name = name
        self.salt = module_salt(name)
        _LIVE[self] = None

    def keep(self, shape: Sequence[int], device: Any) -> torch.Tensor | None:
        """This module's mask for a tensor of ``shape`` in the micro-batch in progress, or None (then torch's
        generator draws it)."""
        if not self.training or self.p <= 0 or self.p >= 1 or _current[0] is None:
            return None
        mask = keep_mask(shape, self.p, self.salt, device)
        if mask is None:
            UNKEYED[self.name] = UNKEYED.get(self.name, 0) + 1
        return mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.keep(x.shape, x.device)
        if mask is None:
            return F.dropout(x, self.p, self.training, self.inplace)
        return x.mul(mask.view(torch.uint8).to(x.dtype)).mul_(1.0 / (1.0 - effective_p(self.p)))

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, seeded by example"


def seed_dropout(model: nn.Module) -> int:
    """Replace every ``nn.Dropout`` of ``model`` (LoRA's ``lora_dropout`` included) by a :class:`SeededDropout` with
    the same ``p``, salted by its qualified name; returns how many. Weights and saved files are unchanged.

    For models whose tensors have the batch as their first dimension (transformers models in the sft and classify
    tasks). Dropout applied inside an attention kernel (a float ``p`` passed to it, e.g. BERT's attention dropout) is
    not a module and keeps torch's generator.
    """
    n = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                setattr(parent, child_name, SeededDropout(child.p, child.inplace, name=name))
                n += 1
    return n
