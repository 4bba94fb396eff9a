"""The loss-only evaluation costs one forward per validation batch, whatever the size of the training set (issue 35).

Counted, not timed: the model's forward calls and the rows they carry, for the same validation file with a small and
a four times larger training file.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import qa_rows


def _evaluate_counting(tmp_path, tiny_lm_dir, train_rows: int) -> tuple[int, int, dict]:
    from surefit.config import SFTConfig, build_config
    from surefit.tasks.sft.train_sft import prepare

    rows = qa_rows(74)  # the same 10 validation rows (the last) for every training size
    train, val = tmp_path / f"train_{train_rows}.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:train_rows]), encoding="utf-8")
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[64:]), encoding="utf-8")
    cfg = build_config(SFTConfig, None, {"model": str(tiny_lm_dir), "data": str(train), "val_data": str(val),
                                         "eval_generate": False, "precision": "fp32", "lora_r": 4,
                                         "output_dir": str(tmp_path / f"out_{train_rows}")})
    p = prepare(cfg, say=lambda _: None)
    calls: list[int] = []  # rows per forward of the base model
    inner = p.model.get_base_model() if hasattr(p.model, "get_base_model") else p.model
    handle = inner.register_forward_pre_hook(lambda _m, args, kw: calls.append(
        int((kw.get("input_ids") if kw.get("input_ids") is not None else args[0]).shape[0])), with_kwargs=True)
    try:
        metrics = p.work.evaluate(p.model, 0, 4).metrics
    finally:
        handle.remove()
    return len(calls), sum(calls), metrics


def test_loss_only_evaluation_is_one_forward_per_batch_whatever_the_training_set(tmp_path, tiny_lm_dir):
    small = _evaluate_counting(tmp_path, tiny_lm_dir, 16)
    large = _evaluate_counting(tmp_path, tiny_lm_dir, 64)
    # 10 validation rows in batches of 4: 3 forwards (a batch of rows sharing a prompt prefix is packed into fewer
    # rows, never more forwards); the training set's size changes nothing the evaluation computes.
    assert small[0] == large[0] == math.ceil(10 / 4)
    assert small[1] == large[1] <= 10
    assert small[2]["eval_loss"] == pytest.approx(large[2]["eval_loss"], rel=1e-6)
