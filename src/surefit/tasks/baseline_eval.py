"""The evaluation before training (epoch 0), reused from the start-up cache when nothing it reads has changed.

Epoch 0 scores the model as loaded: its result depends only on content (the model's files, the initial trainable
weights, the validation examples and rows, the evaluation settings, the device, the thread count and the code), not on
the learning rate, the seed or the number of epochs. A rerun with another of those finds the stored metrics and
prediction records and runs no forward (docs/startup.md, "The evaluation before training").

A task builds a :class:`BaselineReuse` in ``prepare`` (its ``inputs``: the content identities of what its evaluation
reads) and asks it for epoch 0 (:meth:`BaselineReuse.evaluation`); the runner arms it with the cache once the memory
plan is known. Unarmed (``--no_cache``, another command) it only computes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import surefit.startup.cache as startup_cache
from surefit.config import TrainConfig
from surefit.threads import thread_changes
from surefit.training.work import Evaluation

Say = Callable[[str], None]

KIND = "evaluation"  # the cache's folder for these entries, and startup.json's "cache" key

# Settings that cannot change epoch 0's numbers, over those that only steer the loop (startup_cache.NOT_IN_KEY):
# - seed: it draws the validation split (its rows are in the key), LoRA's A matrices (left out of the key only where
#   their B is all zeros, so the adapter adds exactly nothing) and a classifier's new head (its weights are in the key);
# - data, augmentation_factor: what the training split holds (the validation split's content is in the key);
# - batch_size, grad_accum: the training batch; the evaluation batch the plan resolved from them is in the key.
# Every other setting, evaluation and generation settings added later included, is part of the key.
NOT_IN_KEY = startup_cache.NOT_IN_KEY | {"seed", "data", "augmentation_factor", "batch_size", "grad_accum"}


def rows_digest(rows: list[Any]) -> str:
    """SHA-256 of validation rows as evaluation reads them (where each came from, its fields): gold answers and the
    text a prediction record shows come from there."""
    return startup_cache.digest([[getattr(r, "where", None), getattr(r, "fields", r)] for r in rows])


# Hashing the initial trainable weights is paid by every run, the first included; above this many bytes (a full
# fine-tune of a large model) it would cost as much as the evaluation it saves, so epoch 0 is computed instead.
MAX_HASHED_BYTES = 1 << 30


def trainable_bytes(model: Any) -> int:
    """Bytes of the weights ``initial_state`` would hash (trainable parameters and buffers)."""
    tensors = [p for p in model.parameters() if p.requires_grad] + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def initial_state(model: Any) -> str:
    """SHA-256 of what training will change from the loaded model: every trainable weight (and every buffer), by
    content.

    A LoRA A matrix whose B is all zeros is left out: the adapter then adds ``x @ A @ B = 0`` exactly, whatever A holds
    (A is drawn from the seed), and DoRA's norm of ``W + B @ A`` is the norm of ``W``. A non-zero B (a warm start, an
    init that is not the identity) puts A in the key too. Frozen weights are the model's files (in the key by content).
    """
    import torch

    params = dict(model.named_parameters())
    # Buffers too (small): a running statistic a train-mode forward (the doctor's dry run) moved is another model.
    tensors = {**{n: p for n, p in params.items() if p.requires_grad}, **{f"buffer:{n}": b for n, b in model.named_buffers()}}
    h = hashlib.sha256()
    for name in sorted(tensors):
        if ".lora_A." in name:
            b = params.get(name.replace(".lora_A.", ".lora_B."))
            if b is not None and not bool(b.detach().any()):
                continue
        t = tensors[name].detach().cpu().contiguous().view(-1)
        h.update(f"|{name}:{t.dtype}:{tuple(tensors[name].shape)}|".encode())
        # Bytes of a copy: numpy over the parameter's own storage would make it unresizable, and FSDP frees a
        # gathered parameter by resizing its storage to 0 (bf16 has no numpy dtype, hence the uint8 view).
        h.update(memoryview(t.view(torch.uint8).clone().numpy()) if t.numel() else b"")
    return h.hexdigest()


def plain(value: Any) -> Any:
    """``value`` as the run folder writes it (JSON, non-JSON values as their text), read back."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


def _stored(value: Any) -> Evaluation | None:
    """An entry's value as an :class:`Evaluation`, or ``None`` when it is not one (edited, checksum and all)."""
    if not isinstance(value, dict) or set(value) != {"metrics", "records"}:
        return None
    metrics, records = value["metrics"], value["records"]
    number = lambda v: type(v) in (int, float)  # noqa: E731
    # numbers, and the tables some tasks add (classify's per-class F1 and confusion matrix); the loss always
    if not isinstance(metrics, dict) or not number(metrics.get("eval_loss")) or not all(
            isinstance(k, str) and (number(v) or isinstance(v, list | dict)) for k, v in metrics.items()):
        return None
    if records is not None and not (isinstance(records, list) and all(isinstance(r, dict) for r in records)):
        return None
    return Evaluation(metrics, records)


@dataclass
class BaselineReuse:
    """What a task's epoch-0 evaluation reads, and the cache it is reused from.

    Attributes:
        inputs: the content identities of what the evaluation reads besides the settings (model files, tokenizer,
            validation examples and rows); ``None``: not cacheable (``why``: user code, a model not on disk).
        why: why it is not cacheable, in words.
        cache, key_base, statuses, say: set by :meth:`arm` (the runner); unarmed, :meth:`evaluation` only computes.
    """

    inputs: Callable[[], dict[str, Any]] | None
    why: str = ""
    cache: startup_cache.StartupCache | None = None
    key_base: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)
    say: Say = print
    armed: bool = False

    def arm(self, cache: startup_cache.StartupCache, cfg: TrainConfig, plan: Any, statuses: dict[str, str],
            say: Say) -> None:
        """Use ``cache`` for the next evaluation if it is epoch 0 (a resumed run's first evaluation is not)."""
        self.cache, self.statuses, self.say, self.armed = cache, statuses, say, True
        settings = {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_KEY}
        # What the plan decided that evaluation computes with (the eval batch, the frozen weights' dtype ...)
        planned = {k: getattr(plan, k, None) for k in ("precision", "frozen_dtype", "eval_batch_size", "quantized",
                                                        "sharding", "processes")}
        self.key_base = {"task": type(cfg).__name__, "settings": settings, "plan": planned}

    def key(self, model: Any, evaluation: dict[str, Any]) -> dict[str, Any] | None:
        """The entry's key: the armed base, the task's inputs, what the evaluation resolved (``evaluation``: batch
        sizes, generation length, stop ids, metric), the initial trainable weights, the threads and the code."""
        if self.inputs is None:
            return None
        size = trainable_bytes(model)
        if size > MAX_HASHED_BYTES:
            self.say(f"evaluation before training: not stored in the start-up cache (its key would hash "
                     f"{size / 2**30:.1f} GiB of trainable weights on every run, above {MAX_HASHED_BYTES / 2**30:g} GiB; "
                     "LoRA runs hash only the adapters)")
            return None
        import torch

        return {**self.key_base, "inputs": self.inputs(), "evaluation": evaluation, "initial": initial_state(model),
                "threads": torch.get_num_threads(), "code": startup_cache.code_identity()}

    def evaluation(self, epoch: int | float, model: Any, resolved: dict[str, Any],
                   compute: Callable[[], Evaluation]) -> Evaluation:
        """Epoch 0's evaluation from the cache (no forward), or ``compute()`` (then stored); any other evaluation,
        or an unarmed one, is ``compute()``."""
        first, self.armed = self.armed, False
        if not first or epoch != 0 or self.cache is None:
            return compute()
        cache = self.cache
        key = self.key(model, plain(resolved)) if cache.folder is not None else None
        value = cache.get(KIND, key)
        if value is not None:
            found = _stored(value)
            if found is None:
                self.say(f"note: ignored a start-up cache entry for the evaluation before training that is not an "
                         f"evaluation ({cache.entry_path(KIND, key)}); recomputing it")
            else:
                self.statuses[KIND] = "reused"
                self.say(f"evaluation before training: reused from the start-up cache {cache.entry_path(KIND, key)} "
                         "(same model, initial weights, validation data and evaluation settings; no forward run; "
                         "--no_cache recomputes)")
                return found
        changes = thread_changes()
        result = compute()
        stored = {"metrics": plain(result.metrics), "records": plain(result.records)}
        if _stored(stored) is None or thread_changes() != changes:
            # metrics of another shape (a user's own): computed every time; or computed partly on another thread
            # count than the key names (the machine's load changed it), whose last bits a rerun would not give
            key = None
        self.statuses[KIND] = cache.status(key, False)
        cache.put(KIND, key, stored)  # NaN and infinities are JSON to Python's reader too
        return result
