"""Chat templates render in a sandbox with a time and an output-size limit; messages reach them as a model's own
tooling passes them; reasoning fields are read from the rows."""

import pytest

from conftest import chat_tokenizer
from surefit.data import chat_render
from surefit.data.conversation_shapes import RowProblems, messages_from_openai
from surefit.data.encode import ChatEncodeSettings, chat_format, encode_conversations, render_chat
from surefit.data.formats import detect_format, field_table
from surefit.data.rows import Row
from surefit.errors import ConfigError

ROW = Row({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "train": True}],
           "tools": None}, "chat.jsonl line 1", 0)
TAIL = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"


def _encode(source: str):
    return encode_conversations([ROW], chat_tokenizer("chatml"), chat_format(source, "runaway.jinja"),
                                ChatEncodeSettings(512))


def test_a_template_whose_loops_never_return_is_stopped_and_named(monkeypatch):
    monkeypatch.setattr(chat_render, "RENDER_SECONDS", 1.0)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + TAIL
    with pytest.raises(ConfigError) as e:
        _encode(loops)
    text = str(e.value)
    assert "chat template (runaway.jinja) stopped: it ran past the 1 s limit of a render" in text
    assert "--chat_format" in text


@pytest.mark.parametrize("build", [
    "{{ 'x' * 100000000000 }}",  # one huge string: would abort the process in the allocator
    "{% set ns = namespace(s='xy') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}",  # 10 MB of output, piece by piece
])
def test_a_template_that_builds_a_huge_string_is_stopped_before_the_tokenizer_sees_it(build):
    with pytest.raises(ConfigError) as e:
        _encode(build + TAIL)
    assert "chat template (runaway.jinja) stopped:" in str(e.value) and "limit of a render" in str(e.value)


def test_messages_reach_the_template_without_keys_they_do_not_have():
    # Templates test `'tool_calls' in message` (DeepSeek) or iterate message.tool_calls: a None there breaks them.
    probe = ("{% for m in messages %}{{ m.role }}:{{ 'tool_calls' in m }}:{{ 'reasoning_content' in m }}:"
             "{{ 'train' in m }}|{% endfor %}")
    tok = chat_tokenizer("chatml")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": True}]
    assert render_chat(tok, chat_format(probe, "probe"), msgs, None, False) == \
        "user:False:False:False|assistant:False:False:False|"


@pytest.mark.parametrize("message, reasoning, content", [
    ({"role": "assistant", "content": "42", "reasoning_content": "six sevens"}, "six sevens", "42"),
    ({"role": "assistant", "content": "42", "reasoning": "six sevens"}, "six sevens", "42"),
    ({"role": "assistant", "content": "42", "thinking": "six sevens"}, "six sevens", "42"),
    ({"role": "assistant", "content": "<think>\nsix sevens\n</think>\n\n42"}, "six sevens", "42"),
    ({"role": "assistant", "content": "42"}, None, "42"),
])
def test_reasoning_is_read_from_each_field_models_use(message, reasoning, content):
    [m] = messages_from_openai([message], RowProblems(), "messages")
    assert m.get("reasoning") == reasoning and m["content"] == content


def test_the_template_gets_reasoning_in_the_field_it_reads():
    tok = chat_tokenizer("chatml")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r", "train": True}]
    for field in ("reasoning_content", "thinking", "reasoning"):
        src = "{% for m in messages %}[{{ m." + field + " }}]{% endfor %}"
        assert render_chat(tok, chat_format(src, "t"), msgs, None, False) == "[][r]"
    # a template that reads none gets it inline, where such models read it
    assert render_chat(tok, chat_format("{% for m in messages %}[{{ m.content }}]{% endfor %}", "t"), msgs, None,
                       False) == "[q][<think>\nr\n</think>\n\na]"


def test_the_field_table_shows_the_reasoning_field():
    rows = [Row({"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a", "reasoning_content": "r", "mood": "x"}]},
                f"f line {i}", i) for i in range(3)]
    table = field_table(rows, detect_format(rows, "f"))
    by = {t["column"]: t for t in table}
    assert by["messages[].reasoning_content"]["status"] == "kept"
    assert "reasoning of 3 assistant turns" in by["messages[].reasoning_content"]["why"]
    assert by["messages[].mood"]["status"] == "dropped"
