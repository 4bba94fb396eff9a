"""A default system prompt the chat template adds by itself is found by rendering, counted, and can be replaced."""

from __future__ import annotations

import pytest

from conftest import chat_tokenizer
from surefit.config import SFTConfig
from surefit.data.encode import BUILTIN_CHAT_TEMPLATES
from surefit.data.rows import Row
from surefit.data.system_prompt import injected_system_prompt

# SmolLM2-Instruct's template, written out: a default system turn when the conversation has none.
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
        "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Another family's wording, to show the probe matches no string: a default only when the first turn is not system.
OTHER = ("{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}"
         "{% else %}{% set sys = 'Be a pirate. Always.' %}{% set rest = messages %}{% endif %}"
         "{{ '<|im_start|>system\n' + sys + '<|im_end|>\n' }}{% for m in rest %}"
         "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A header written whatever the system turn says (Llama 3.1's date lines): not a default a system turn replaces.
HEADER = ("{{ '<|im_start|>system\nToday: 1 Jan\n' }}{% if messages[0]['role'] == 'system' %}"
          "{{ messages[0]['content'] }}{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
          "{{ '<|im_end|>\n' }}{% for m in rest %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer("chatml")


def test_the_default_is_found_by_rendering_for_any_wording(tok):
    assert injected_system_prompt(tok, SMOL) == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert injected_system_prompt(tok, OTHER) == "Be a pirate. Always."
    assert injected_system_prompt(tok, BUILTIN_CHAT_TEMPLATES["chatml"]) is None  # adds no system turn
    assert injected_system_prompt(tok, HEADER) is None
    assert injected_system_prompt(tok, "{{ raise_exception('no system') }}") is None


def _encoder(tok, conversational: bool, **settings):
    from surefit.tasks.sft.train_sft import Encoder

    tok.chat_template = SMOL
    cfg = SFTConfig(data="d", **settings)
    return Encoder.build(cfg, tok, "messages" if conversational else "input_target", conversational)


def _rows(conversational: bool) -> list[Row]:
    if not conversational:
        return [Row({"input": f"where is the cat {i}", "target": "mat"}, f"rows.jsonl line {i + 1}", i) for i in range(3)]
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "ok"}],
             [{"role": "user", "content": "where"}, {"role": "assistant", "content": "Paris"}]]
    return [Row({"messages": m}, f"chat.jsonl line {i + 1}", i) for i, m in enumerate(chats)]


@pytest.mark.parametrize("conversational", [False, True])
def test_the_run_says_what_the_template_injects_and_system_prompt_none_removes_it(tok, conversational):
    rows = _rows(conversational)
    bare = 3 if not conversational else 2
    enc = _encoder(tok, conversational)
    line = enc.system_line(rows)
    assert f"to {bare} of 3 rows" in line and "named SmolLM" in line and "--system_prompt none" in line, line
    text = tok.decode(enc.encode(rows, "train")[0][0].input_ids)
    assert "named SmolLM" in text
    for setting, wanted in (("none", "<|im_start|>system\n<|im_end|>"), ("Answer in one word.", "Answer in one word.")):
        enc = _encoder(tok, conversational, system_prompt=setting)
        examples, _ = enc.encode(rows, "train")
        texts = [tok.decode(e.input_ids) for e in examples]
        assert not any("named SmolLM" in t for t in texts), texts
        assert sum(wanted in t for t in texts) == bare, texts
        assert f"{bare} of 3 rows" in enc.system_line(rows)
        if conversational:  # a row's own system turn stays
            assert "Be brief." in texts[1]


def test_a_split_no_row_fits_names_the_templates_share_a_whole_length_and_what_shortens_the_template(tok):
    """Rows whose targets are two tokens were reported as "all 3 targets are longer than --max_seq_length allows":
    the chat template (its default system turn included) was what left no room. The fix offered keeps every row
    whole (a length that cuts inputs would lose data), and names only the switches this run can use."""
    import re

    rows = _rows(False)
    enc = _encoder(tok, False)
    fixed = len(enc.prompt.prefix_ids) + len(enc.prompt.suffix_ids)
    for cap, says in ((fixed, f"the prompt template alone is {fixed} tokens"),
                      (fixed + 1, f"the prompt template takes {fixed} of them and every row's target with its EOS "
                                  "needs more than the other 1")):
        examples, rep = _encoder(tok, False, max_seq_length=cap).encode(rows, "train")
        assert not examples and len(rep.excluded) == 3
        what, fix = rep.nothing_fits(cap, "targets", enc.shorter())
        assert what.startswith(f"no train rows left after encoding: none of its 3 rows fits --max_seq_length {cap}: ")
        assert says in what, what
        assert "--system_prompt none leaves out" in fix and "--chat_template false" in fix, fix
    whole = int(re.search(r"--max_seq_length (\d+) keeps every row whole", fix).group(1))
    examples, rep = _encoder(tok, False, max_seq_length=whole).encode(rows, "train")
    assert len(examples) == 3 and rep.truncated == 0 and not rep.excluded
    _, rep = _encoder(tok, False, max_seq_length=whole - 1).encode(rows, "train")
    assert rep.truncated + len(rep.excluded) >= 1  # the least length that keeps them all
    assert "--system_prompt" not in _encoder(tok, False, system_prompt="none").shorter()
    assert _encoder(tok, False, chat_template=False).shorter() == ""  # the plain template: no switch to offer
