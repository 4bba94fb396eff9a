"""The doctor on chat training built by other tools: degenerate TRL masks, masked scaffolding, a swapped template."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from test_shipped_templates import shipped_tokenizer  # noqa: E402

from conftest import build_tiny_lm  # noqa: E402
from surefit.doctor import check  # noqa: E402


def _row(tok, think_trained: bool):
    """One Qwen3 conversation, labelled the way TRL's assistant_only_loss labels it with (or without) the think
    block in the {% generation %} span."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                     add_generation_prompt=True)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    answer = tok("Blue.<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = p + think + answer
    mask = [0] * len(p) + [int(think_trained)] * len(think) + [1] * len(answer)
    return {"input_ids": ids, "assistant_masks": mask,
            "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]}


@pytest.fixture(scope="module")
def qwen3():
    tok = shipped_tokenizer("qwen3")
    return tok, build_tiny_lm(tok)


def test_a_masked_think_block_is_named_with_its_row_and_token(qwen3):
    tok, model = qwen3
    rows = [_row(tok, True), _row(tok, False)]
    report = check(model, tokenizer=tok, train_dataset=rows, task="sft")
    [f] = [f for f in report.findings if f.code == "scaffold-masked"]
    assert "'<think>\\n\\n</think>\\n\\n'" in f.message and "row 1" in f.message and "'<think>'" in f.message
    assert f.where.startswith("train_dataset row 1, token ")
    assert "scaffold-masked" not in check(model, tokenizer=tok, train_dataset=[_row(tok, True)], task="sft").codes()


def test_assistant_masks_of_all_ones_or_all_zeros(qwen3):
    tok, model = qwen3
    good = _row(tok, True)
    ones = dict(good, assistant_masks=[1] * len(good["input_ids"]))
    zeros = dict(good, assistant_masks=[0] * len(good["input_ids"]))
    report = check(model, tokenizer=tok, train_dataset=[good, ones, zeros], task="sft")
    texts = [f.message for f in report.findings if f.code == "assistant-mask-degenerate"]
    assert any("is 1 at every token of row 1" in t for t in texts)
    assert any("is 0 at every token of row 2" in t for t in texts)
    assert "assistant-mask-degenerate" not in check(model, tokenizer=tok, train_dataset=[good], task="sft").codes()


def test_a_chat_template_other_than_the_models_own_is_named(qwen3, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = qwen3
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    swapped = AutoTokenizer.from_pretrained(tmp_path)
    assert "chat-template-differs" not in check(loaded, tokenizer=swapped, task="sft").codes()
    swapped.chat_template = tok.chat_template.replace("<think>\\n\\n</think>", "<think></think>")
    [f] = [f for f in check(loaded, tokenizer=swapped, task="sft").findings if f.code == "chat-template-differs"]
    assert "differs from the model's own" in f.message and f.severity == "warning"
