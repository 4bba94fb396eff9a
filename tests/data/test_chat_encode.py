"""Labels by position for three chat-template families, on multi-turn rows with system prompts and tool turns."""

import json

import pytest

from conftest import chat_tokenizer
from surefit.data.encode import (
    BUILTIN_CHAT_TEMPLATES,
    ChatEncodeSettings,
    chat_format,
    encode_conversations,
    resolve_chat_template,
)
from surefit.data.rows import Row

TERMINATOR = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": json.dumps(CALL), "train": True,
     "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 degrees and clear.", "train": True},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "I cannot tell tomorrow's weather.", "train": True},
]
TOOLS = [{"name": "get_weather", "description": "weather now", "parameters": {"type": "object"}}]


def _supervised_runs(ex):
    """The supervised token runs, each as a list of ids."""
    runs, cur = [], []
    for t, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != -100:
            assert label == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


@pytest.mark.parametrize("family", ["chatml", "llama3", "gemma"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_supervised_tokens_are_the_assistant_contents_plus_terminators(family, tools):
    tok = chat_tokenizer(family)
    fmt = chat_format(BUILTIN_CHAT_TEMPLATES[family], family)
    row = Row({"messages": CONVERSATION, "tools": tools}, "chat.jsonl line 1", 0)
    [ex], rep, failures, terminators = encode_conversations([row], tok, fmt, ChatEncodeSettings(max_seq_length=2048))
    assert failures == []
    runs = [tok.decode(r, skip_special_tokens=False) for r in _supervised_runs(ex)]
    assistants = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert runs == [a + TERMINATOR[family] for a in assistants]
    assert tok.convert_tokens_to_ids(TERMINATOR[family]) in terminators
    # Nothing of the system, user or tool turns (nor the tool schemas) is supervised.
    supervised = "".join(runs)
    for m in CONVERSATION:
        if m["role"] != "assistant":
            assert m["content"] not in supervised
    assert "weather now" not in supervised  # the tool schemas are context
    assert ex.num_supervised == sum(len(r) for r in _supervised_runs(ex))
    # The prompt for generation ends with the assistant header of the last turn.
    assert tok.decode(ex.prompt_ids, skip_special_tokens=False).endswith(
        {"chatml": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
         "gemma": "<start_of_turn>model\n"}[family])
    assert rep.roles == {"system": 1, "user": 2, "assistant": 3, "tool": 1}


def test_last_assistant_trains_only_the_final_turn():
    tok = chat_tokenizer("chatml")
    fmt = chat_format(BUILTIN_CHAT_TEMPLATES["chatml"], "chatml")
    row = Row({"messages": CONVERSATION, "tools": None}, "x line 1", 0)
    [ex], *_ = encode_conversations([row], tok, fmt, ChatEncodeSettings(2048, train_on="last_assistant"))
    runs = [tok.decode(r, skip_special_tokens=False) for r in _supervised_runs(ex)]
    assert runs == ["I cannot tell tomorrow's weather.<|im_end|>"]
    assert ex.input_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # the sequence ends on the terminator


def test_context_assistant_turns_are_not_trained():
    """Conversational prompt/completion: an assistant turn in the prompt is context (TRL #4147)."""
    tok = chat_tokenizer("chatml")
    fmt = chat_format(BUILTIN_CHAT_TEMPLATES["chatml"], "chatml")
    msgs = [dict(m) for m in CONVERSATION]
    msgs[4]["train"] = False
    [ex], *_ = encode_conversations([Row({"messages": msgs}, "x", 0)], tok, fmt, ChatEncodeSettings(2048))
    runs = [tok.decode(r, skip_special_tokens=False) for r in _supervised_runs(ex)]
    assert "It is 21 degrees and clear." not in "".join(runs) and len(runs) == 2


def test_long_conversations_drop_oldest_exchanges_keep_system_or_are_excluded():
    tok = chat_tokenizer("chatml")
    fmt = chat_format(BUILTIN_CHAT_TEMPLATES["chatml"], "chatml")
    row = Row({"messages": CONVERSATION, "tools": None}, "x line 4", 0)
    [full], *_ = encode_conversations([row], tok, fmt, ChatEncodeSettings(4096))
    limit = len(full.input_ids) - 5
    [ex], rep, _, _ = encode_conversations([row], tok, fmt, ChatEncodeSettings(limit))
    text = tok.decode(ex.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are terse.") and "Paris" not in text
    assert len(ex.input_ids) <= limit and rep.rows_shortened == [("x line 4", 4)] and rep.turns_dropped == 4
    exs, rep, _, _ = encode_conversations([row], tok, fmt, ChatEncodeSettings(limit, truncation="exclude"))
    assert exs == [] and rep.excluded[0][0] == "x line 4" and "--truncation exclude" in rep.excluded[0][1]
    exs, rep, _, _ = encode_conversations([row], tok, fmt, ChatEncodeSettings(10))
    assert exs == [] and "even with only its last exchange" in rep.excluded[0][1]


def test_a_template_whose_prefix_render_is_not_a_prefix_is_named_with_the_turn():
    tok = chat_tokenizer("chatml")
    # Writes a different header when the conversation ends on the assistant: prefix renders disagree.
    bad = ("{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}FINAL {% endif %}"
           "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fmt = chat_format(bad, "my.jinja")
    msgs = CONVERSATION[:2] + [CONVERSATION[4]]
    _, _, failures, _ = encode_conversations([Row({"messages": msgs}, "f.jsonl line 2", 0)], tok, fmt,
                                             ChatEncodeSettings(2048))
    assert failures and failures[0][0] == "f.jsonl line 2"
    assert "chat template (my.jinja)" in failures[0][1] and "turn 3" in failures[0][1] and "not the start of the training render" in failures[0][1]


def test_a_template_without_terminator_is_refused():
    tok = chat_tokenizer("chatml")
    fmt = chat_format("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}", "plain.jinja")
    _, _, failures, _ = encode_conversations([Row({"messages": CONVERSATION[1:2] + CONVERSATION[4:5]}, "l 1", 0)],
                                             tok, fmt, ChatEncodeSettings(2048))
    assert "writes no end-of-turn token" in failures[0][1] and "turn 2" in failures[0][1]


def test_the_model_template_is_the_default_and_a_builtin_is_saved_with_the_tokenizer(tmp_path):
    tok = chat_tokenizer("chatml")
    assert resolve_chat_template(tok, None, None)[0] is None  # a base model: the plain template, as today
    fmt, why = resolve_chat_template(tok, None, "llama3")
    assert fmt.name == "llama3" and "built-in 'llama3'" in why
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == BUILTIN_CHAT_TEMPLATES["llama3"]
    fmt, why = resolve_chat_template(AutoTokenizer.from_pretrained(tmp_path), None, None)
    assert fmt.name == "the model's own" and "the model's own" in why
    assert resolve_chat_template(AutoTokenizer.from_pretrained(tmp_path), False, None)[0] is None


def test_a_template_that_takes_tools_and_tool_calls_renders_them_itself(tmp_path):
    """A Jinja file given with --chat_format: tools go to the template, a tool call is written by it, and the call
    (not its JSON as content) is what is trained."""
    source = (
        "{% if tools %}<|im_start|>system\nTOOLS {{ tools | map(attribute='name') | join(',') }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}CALL {{ c['function']['name'] }}"
        "({{ c['function']['arguments'] | tojson }}){% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tmp_path / "tools.jinja"
    path.write_text(source)
    tok = chat_tokenizer("chatml")
    fmt, why = resolve_chat_template(tok, None, str(path))
    assert fmt.takes_tools and fmt.takes_tool_calls and str(path) in why
    row = Row({"messages": CONVERSATION[1:5], "tools": TOOLS}, "x line 1", 0)
    [ex], rep, failures, _ = encode_conversations([row], tok, fmt, ChatEncodeSettings(2048))
    assert failures == [] and rep.tools_rows == 1 and rep.tools_how == "passed to the chat template"
    runs = [tok.decode(r, skip_special_tokens=False) for r in _supervised_runs(ex)]
    assert runs == ['CALL get_weather({"city": "Paris"})<|im_end|>', "It is 21 degrees and clear.<|im_end|>"]
    assert tok.decode(ex.input_ids, skip_special_tokens=False).startswith("<|im_start|>system\nTOOLS get_weather")
