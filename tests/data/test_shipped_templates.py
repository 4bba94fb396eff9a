"""Every shipped chat template, reasoning models included, trained by position with no flag (or one kind of row
refused with its reason).

The templates are the ORIGINAL ones the model families ship, as kept (for identity comparison) by the ``trl`` package
in ``trl/chat_templates/`` (TRL is Apache-2.0; each template comes from its model's repository: Qwen2.5/Qwen3/Qwen3.5
from Qwen, DeepSeek-V3 and the R1 distills from deepseek-ai, gpt-oss from OpenAI, GLM-4.5 from zai-org, Phi-3/3.5
from Microsoft, Gemma 1/3 from Google, Llama 3.1/3.2 from Meta; see that folder's README.md). They are read from the
installed package, never copied here. Each is set on a tiny byte-level BPE tokenizer with the template's special tokens added as single
tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from surefit.data.encode import (
    ChatEncodeSettings,
    chat_format,
    chat_prompt,
    encode_conversations,
    special_texts,
    split_reasoning,
    template_traits,
)
from surefit.data.rows import Row

trl = pytest.importorskip("trl", reason="the shipped templates are read from the trl package (pip install -e .[dev])")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

# template -> (special tokens, added non-special tokens, bos, eos)
QWEN = (["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>",
         "</tools>"], None, "<|im_end|>")
SPEC = {
    "qwen2_5": QWEN, "qwen3": QWEN, "qwen3_5_think": QWEN, "qwen3_5_nothink": QWEN,
    "deepseekv3": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"], ["<think>", "</think>"],
                   "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "gptoss": (["<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                "<|constrain|>"], [], "<|startoftext|>", "<|return|>"),
    "glm4moe": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"],
                ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>", "<tool_response>", "</tool_response>"], None, "<|endoftext|>"),
    "phi3": (["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], [], "<s>",
             "<|endoftext|>"),
    "gemma": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], [], "<bos>", "<eos>"),
    "llama3_1": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>"),
}
SPEC["phi3_5"] = SPEC["phi3"]
SPEC["gemma3"] = SPEC["gemma"]
SPEC["llama3_2"] = SPEC["llama3_1"]
SPEC["deepseek_r1_distill"] = SPEC["deepseekv3"]
ALL = ["qwen2_5", "qwen3", "qwen3_5_think", "qwen3_5_nothink", "deepseekv3", "deepseek_r1_distill", "gptoss",
       "glm4moe", "phi3", "phi3_5", "gemma", "gemma3", "llama3_1", "llama3_2"]


def shipped_tokenizer(name: str):
    """A tiny tokenizer carrying the shipped template ``name`` and its special tokens as single tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, added, bos, eos = SPEC[name]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[*specials, "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["system user assistant tool weather Paris degrees clear the answer is"] * 3, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<pad>")
    out.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return out


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ROWS = {
    "single": [{"role": "user", "content": "What is two plus two?"},
               {"role": "assistant", "content": "Two plus two is four."}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    "three": [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello, how can I help?"},
              {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "And of Spain?"}, {"role": "assistant", "content": "Madrid."}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
              {"role": "tool", "content": '{"temp": 21}'},
              {"role": "assistant", "content": "It is 21 degrees."}],
    "reasoning": [{"role": "user", "content": "What is 6 times 7?"},
                  {"role": "assistant", "content": "42.", "reasoning": "Six sevens are forty-two."},
                  {"role": "user", "content": "And 6 times 8?"},
                  {"role": "assistant", "content": "48.", "reasoning": "Add six to forty-two."}],
}

# What each shipped template does with each kind of row: None trains; a text is the refusal's reason.
NO_TOOL_ROLE = "Conversation roles must alternate"  # Gemma has no tool role
EXPECT: dict[tuple[str, str], str] = {
    # R1-distill writes a tool call only for a turn whose content is null (and then no end after a single call)
    ("deepseek_r1_distill", "tools"): "the tool call get_weather is not in the trained span",
    ("qwen3_5_nothink", "reasoning"): "the generation prompt has '\\n</think>\\n\\n'",
    ("gemma", "tools"): NO_TOOL_ROLE, ("gemma3", "tools"): NO_TOOL_ROLE,
}
# Templates that rewrite earlier turns (drop their reasoning or their empty think block): one example per turn.
SPLITS = {("qwen3", "three"), ("qwen3", "tools"), ("qwen3", "reasoning"), ("qwen3_5_think", "three"),
          ("qwen3_5_think", "reasoning"), ("qwen3_5_nothink", "three"), ("gptoss", "three"), ("gptoss", "reasoning"),
          ("glm4moe", "reasoning"), ("deepseekv3", "three"), ("deepseekv3", "tools"), ("deepseekv3", "reasoning"),
          ("deepseek_r1_distill", "three"), ("deepseek_r1_distill", "reasoning")}


def _messages(kind: str) -> list[dict]:
    return [dict(m, train=True) if m["role"] == "assistant" else dict(m) for m in ROWS[kind]]


def _runs(ex) -> list[list[int]]:
    runs, cur = [], []
    for t, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != -100:
            assert label == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def _encode(name: str, kind: str, **settings):
    tok = shipped_tokenizer(name)
    fmt = chat_format(tok.chat_template, name)
    row = Row({"messages": _messages(kind), "tools": TOOLS if kind == "tools" else None}, f"{kind}.jsonl line 1", 0)
    return tok, fmt, row, encode_conversations([row], tok, fmt, ChatEncodeSettings(4096, **settings))


@pytest.mark.parametrize("kind", list(ROWS))
@pytest.mark.parametrize("name", ALL)
def test_shipped_template_trains_each_assistant_turn_and_nothing_else(name, kind):
    tok, fmt, row, (examples, rep, failures, stops) = _encode(name, kind)
    refused = EXPECT.get((name, kind))
    if refused:
        assert examples == [] and len(failures) == 1
        where, why = failures[0]
        assert where == f"{kind}.jsonl line 1" and f"chat template ({name})" in why and refused in why
        return
    assert failures == []
    messages = _messages(kind)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    closing = tok.eos_token if name.startswith("phi3") else None  # Phi-3 closes a render with EOS: trained last
    runs = [tok.decode(r, skip_special_tokens=False) for ex in examples for r in _runs(ex)]
    runs = [r for r in runs if r != closing]
    # One supervised span per assistant turn, in order: its reasoning (where it has one) and its content, then the
    # token that ends the turn, which generation stops on.
    assert len(runs) == len(turns)
    for text, k in zip(runs, turns, strict=True):
        m = messages[k]
        if m["content"]:
            assert m["content"] in text
        if m.get("reasoning"):
            assert m["reasoning"] in text
        if m.get("tool_calls"):
            assert "get_weather" in text or "Paris" in text
        assert any(text.endswith(tok.convert_ids_to_tokens(s)) for s in stops), (text, stops)
    supervised = "".join(runs)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] not in supervised, m
    assert "weather now" not in supervised
    assert tok.pad_token not in supervised
    # Prefix-stable templates keep one example per conversation; those that rewrite earlier turns make one per turn.
    if (name, kind) in SPLITS:
        assert len(examples) == len(turns) and rep.split_rows == 1 and rep.split_examples == len(turns)
    else:
        assert len(examples) == 1 and rep.split_rows == 0
    # Training = inference: the prompt generation builds for the example's last trained turn, then that turn's
    # trained span, is the start of the training example, token for token.
    per_turn = len(examples) == len(turns)
    for j, ex in enumerate(examples):
        k = turns[j] if per_turn else turns[-1]
        prompt = chat_prompt(tok, fmt, messages[:k], row.fields["tools"])
        assert ex.input_ids[: ex.prompt_len] == prompt
        span = _runs(ex)[-1 if ex.labels[-1] == -100 or closing is None else -2]
        assert ex.input_ids[ex.prompt_len: ex.prompt_len + len(span)] == span


def test_reasoning_template_report_names_the_rewrite_and_the_empty_think_block():
    tok, fmt, row, (examples, rep, failures, _) = _encode("qwen3", "three")
    assert failures == [] and len(examples) == 3
    assert ("1 conversations became 3 examples: the template rewrites earlier turns" in rep.summary())
    # each example is scored against its own turn's answer
    assert [e.row.fields["messages"][-1]["content"] for e in examples] == ["Hello, how can I help?", "Paris.", "Madrid."]
    assert rep.scaffold == {"<think>\n\n</think>\n\n": 3}
    assert "'<think>\\n\\n</think>\\n\\n' (3 turns)" in rep.thinking_line()


def test_thinking_switch_off_puts_the_empty_block_in_the_prompt():
    tok, fmt, row, (examples, rep, failures, _) = _encode("qwen3", "single", thinking="switch_off")
    [ex] = examples
    [run] = _runs(ex)
    assert tok.decode(run, skip_special_tokens=False) == "Two plus two is four.<|im_end|>"
    assert tok.decode(ex.input_ids[: ex.prompt_len], skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rep.thinking_rows == 1 and "--thinking switch_off" in rep.thinking_line()
    # inference prompts the same way
    assert chat_prompt(tok, fmt, _messages("single")[:1], None, "switch_off") == ex.input_ids[: ex.prompt_len]
    # a reasoning row keeps thinking on: its reasoning is trained
    _, _, _, (examples, rep, failures, _) = _encode("qwen3", "reasoning", thinking="switch_off")
    assert failures == [] and rep.thinking_rows == 0


def test_gemma_folds_a_system_turn_into_the_first_user_turn_or_refuses_when_asked():
    tok, fmt, row, (examples, rep, failures, _) = _encode("gemma", "system")
    assert failures == [] and rep.system_folded == 1
    assert "<start_of_turn>user\nYou are terse.\n\nName a colour.<end_of_turn>" in tok.decode(examples[0].input_ids)
    assert "system turns written at the start of the first user turn" in rep.summary()
    _, _, _, (examples, rep, failures, _) = _encode("gemma", "system", system_turn="refuse")
    assert examples == [] and "System role not supported" in failures[0][1]


def test_glm_without_an_end_of_turn_token_trains_the_next_role_token_and_stops_on_it():
    tok, fmt, row, (examples, rep, failures, stops) = _encode("glm4moe", "single")
    [ex] = examples
    assert tok.convert_ids_to_tokens(sorted(stops)) == ["<|user|>"]
    assert tok.decode(_runs(ex)[0], skip_special_tokens=False).endswith("four.<|user|>")
    assert ex.labels[-1] == ex.input_ids[-1]


def test_phi3_closing_eos_is_not_a_turn_and_is_trained_after_the_last_turn_only():
    tok, fmt, row, (examples, rep, failures, stops) = _encode("phi3", "three")
    [ex] = examples
    runs = [tok.decode(r, skip_special_tokens=False) for r in _runs(ex)]
    assert runs == ["Hello, how can I help?<|end|>", "Paris.<|end|>", "Madrid.<|end|>", "<|endoftext|>"]
    assert tok.convert_ids_to_tokens(sorted(stops)) == ["<|end|>"]


def test_gpt_oss_channel_header_and_analysis_are_trained_with_the_answer():
    tok, fmt, row, (examples, rep, failures, _) = _encode("gptoss", "reasoning")
    last = tok.decode(_runs(examples[-1])[-1], skip_special_tokens=False)
    assert last == ("<|channel|>analysis<|message|>Add six to forty-two.<|end|><|start|>assistant<|channel|>final"
                    "<|message|>48.<|return|>")
    _, _, _, (examples, rep, _, _) = _encode("gptoss", "single")
    assert rep.scaffold == {"<|channel|>final<|message|>": 1}


@pytest.mark.parametrize("name", ["deepseekv3", "deepseek_r1_distill"])
def test_deepseek_prefilled_think_block_is_prompt_and_the_rest_of_it_is_trained(name):
    # The generation prompt ends with "<think>\n", which the template's render of a turn never writes: it is prompt
    # (not supervised), and the model is taught to write the reasoning (or nothing), the close, the answer, EOS.
    tok, fmt, row, (examples, rep, failures, stops) = _encode(name, "reasoning")
    assert failures == [] and template_traits(tok, fmt).prefill == "<think>\n"
    texts = [(tok.decode(e.input_ids[: e.prompt_len], skip_special_tokens=False),
              [tok.decode(r, skip_special_tokens=False) for r in _runs(e)]) for e in examples]
    assert texts == [
        ("<｜begin▁of▁sentence｜><｜User｜>What is 6 times 7?<｜Assistant｜><think>\n",
         ["Six sevens are forty-two.\n</think>\n\n42.<｜end▁of▁sentence｜>"]),
        # history as the template renders it at inference: the earlier turn's reasoning dropped
        ("<｜begin▁of▁sentence｜><｜User｜>What is 6 times 7?<｜Assistant｜>\n\n42.<｜end▁of▁sentence｜><｜User｜>And 6 "
         "times 8?<｜Assistant｜><think>\n", ["Add six to forty-two.\n</think>\n\n48.<｜end▁of▁sentence｜>"])]
    assert tok.convert_ids_to_tokens(sorted(stops)) == ["<｜end▁of▁sentence｜>"]
    # a row without reasoning: the empty think block after the prefill is trained (--thinking train_empty)
    tok, fmt, row, (examples, rep, failures, _) = _encode(name, "single")
    [ex] = examples
    assert [tok.decode(r, skip_special_tokens=False) for r in _runs(ex)] == [
        "\n</think>\n\nTwo plus two is four.<｜end▁of▁sentence｜>"]
    assert tok.decode(ex.input_ids[: ex.prompt_len], skip_special_tokens=False).endswith("<｜Assistant｜><think>\n")
    assert rep.scaffold == {"\n</think>\n\n": 1}


def test_a_template_without_prefill_has_none():
    for name in ("qwen3", "qwen3_5_think", "qwen3_5_nothink", "gptoss", "llama3_1", "phi3"):
        tok = shipped_tokenizer(name)
        assert template_traits(tok, chat_format(tok.chat_template, name)).prefill == "", name


def test_no_template_is_left_untested():
    shipped = {p.stem for p in TEMPLATES.glob("*.jinja")}
    assert set(ALL) <= shipped


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_think", "gptoss", "glm4moe", "deepseekv3", "deepseek_r1_distill"])
def test_a_generated_turn_splits_into_reasoning_and_answer_where_the_template_marks_them(name):
    tok, fmt, row, (examples, _, _, _) = _encode(name, "reasoning")
    generated = tok.decode(_runs(examples[-1])[-1], skip_special_tokens=False)  # what the model is taught to write
    parts = split_reasoning(generated, template_traits(tok, fmt))
    for special in special_texts(tok):
        parts = {k: v.replace(special, "").strip() for k, v in parts.items()}
    assert parts == {"reasoning": "Add six to forty-two.", "answer": "48."}


REASONING_ROWS = [
    {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": f"{a + b}.", "reasoning_content": f"Add {a} and {b}."}]}
    for a in range(4) for b in range(4)]


def test_qwen3_template_end_to_end_trains_reasoning_and_predicts_it_apart(tmp_path, capsys):
    from conftest import build_tiny_lm
    from surefit.cli import main

    tok = shipped_tokenizer("qwen3")
    model_dir = tmp_path / "qwen3-tiny"
    build_tiny_lm(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "reasoning.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in REASONING_ROWS))
    out = tmp_path / "run"
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--max_seq_length", "256", "--output_dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "messages[].reasoning_content  kept" in text
    assert "assistant turns with reasoning (trained with the answer)" in text
    ask = tmp_path / "ask.jsonl"
    ask.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 1 plus 2?"}]}) + "\n")
    assert main(["predict", "--run", str(out), "--file", str(ask)]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert set(record) >= {"reasoning", "answer", "prediction"} and record["prediction"] == record["answer"]
    assert main(["inspect", "--task", "sft", "--model", str(model_dir), "--data", str(data), "--limit", "1",
                 "--show", "1"]) == 0
    shown = capsys.readouterr().out
    assert "<|im_start|>user\nWhat is 0 plus 0?<|im_end|>\n<|im_start|>assistant\n[[<think>\nAdd 0 and 0.\n</think>" \
           "\n\n0.<|im_end|>]]" in shown


def test_a_refused_row_is_counted_in_words_with_its_fix(tmp_path):
    from surefit.config import SFTConfig
    from surefit.errors import DataError
    from surefit.tasks.sft.train_sft import Encoder

    tok = shipped_tokenizer("qwen3_5_nothink")
    enc = Encoder(SFTConfig(data="x.jsonl", output_dir=str(tmp_path)), tok, "", chat=chat_format(tok.chat_template, "nothink"))
    row = Row({"messages": _messages("reasoning"), "tools": None}, "r.jsonl line 1", 0)
    with pytest.raises(DataError) as e:
        enc.encode([row], "all")
    text = str(e.value)
    assert "1 row cannot be rendered" in text and "all rows" not in text
    assert "r.jsonl line 1: chat template (nothink), turn 2" in text and "thinking off" in text


def test_switch_off_on_a_template_without_a_switch_says_the_block_stays_trained():
    tok, fmt, row, (examples, rep, failures, _) = _encode("deepseekv3", "single", thinking="switch_off")
    assert failures == [] and rep.thinking_rows == 0 and rep.scaffold == {"\n</think>\n\n": 1}
    assert "trained with the answer: --thinking switch_off moves it into the prompt only for rows without reasoning, " \
           "where the template has a thinking switch" in rep.thinking_line()
