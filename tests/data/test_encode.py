import pytest

from surefit.data.collate import PadCollator
from surefit.data.encode import DEFAULT_TEMPLATE, build_prompt_format, encode_rows
from surefit.data.rows import Row


def _rows(*pairs):
    return [Row({"input": i, "target": t}, f"data.jsonl line {n + 1}", n) for n, (i, t) in enumerate(pairs)]


@pytest.fixture(scope="module")
def tok():
    from conftest import build_tokenizer

    return build_tokenizer()


def test_prompt_is_masked_target_and_eos_are_labels(tok):
    fmt = build_prompt_format(tok)
    [ex], rep = encode_rows(_rows(("the cat sat on the mat", "mat")), tok, fmt, max_seq_length=256)
    target = tok("mat", add_special_tokens=False)["input_ids"]
    prompt = tok(DEFAULT_TEMPLATE.replace("{input}", "the cat sat on the mat"), add_special_tokens=False)["input_ids"]
    assert ex.input_ids[-1] == tok.eos_token_id
    assert ex.labels == [-100] * ex.prompt_len + target + [tok.eos_token_id]
    assert ex.input_ids[ex.prompt_len :] == target + [tok.eos_token_id]
    # Pieces tokenized separately decode to the same prompt text as the template rendered whole.
    assert tok.decode(ex.prompt_ids) == tok.decode(prompt)
    assert rep.encoded == 1 and rep.supervised_tokens == len(target) + 1


def test_eos_label_survives_collation_when_pad_equals_eos(tok):
    assert tok.pad_token_id == tok.eos_token_id
    fmt = build_prompt_format(tok)
    exs, _ = encode_rows(_rows(("the cat", "mat"), ("the big red dog ran to the park", "park")), tok, fmt, max_seq_length=256)
    batch = PadCollator(tok.pad_token_id)([e.features() for e in exs])
    for row, ex in enumerate(exs):
        last = len(ex.input_ids) - 1
        assert batch["labels"][row, last].item() == tok.eos_token_id
        assert batch["labels"][row, last + 1 :].eq(-100).all()
    assert (batch["labels"] == tok.eos_token_id).sum().item() == 2  # exactly one EOS label per row


def test_truncation_cuts_the_input_never_the_target(tok):
    fmt = build_prompt_format(tok, template="Q: {input}\nA: ")
    long_input = " ".join(["the cat sat on the mat"] * 30) + " where is the cat ?"
    [ex], rep = encode_rows(_rows((long_input, "on the mat")), tok, fmt, max_seq_length=40)
    target = tok("on the mat", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(ex.input_ids) == 40
    assert ex.input_ids[-len(target) :] == target
    assert ex.labels[-len(target) :] == target
    assert ex.prompt_ids[: len(fmt.prefix_ids)] == fmt.prefix_ids  # the template survives whole
    assert ex.prompt_ids[-len(fmt.suffix_ids) :] == fmt.suffix_ids
    assert tok.decode(ex.prompt_ids).rstrip().endswith("where is the cat ?\nA:")  # left truncation keeps the question
    assert rep.truncated == 1 and rep.tokens_cut > 0


def test_row_whose_target_does_not_fit_is_excluded_and_reported_with_its_row(tok):
    fmt = build_prompt_format(tok, template="Q: {input}\nA: ")
    rows = _rows(("the cat", "mat"), ("the dog", " ".join(["park"] * 80)), ("the bird", "tree"))
    exs, rep = encode_rows(rows, tok, fmt, max_seq_length=48)
    assert [e.row.index for e in exs] == [0, 2]
    assert rep.rows == 3 and rep.encoded == 2
    assert len(rep.excluded) == 1 and rep.excluded[0][0] == "data.jsonl line 2"
    assert "--max_seq_length is 48" in rep.excluded[0][1]
    assert "1 rows excluded" in rep.summary()


def test_truncation_that_removes_the_answer_is_counted(tok):
    fmt = build_prompt_format(tok, template="{input}\n")
    inp = "Paris is the capital of France . " + " ".join(["the cat sat on the mat ."] * 20)
    _, rep = encode_rows(_rows((inp, "Paris")), tok, fmt, max_seq_length=30)
    assert rep.truncated == 1 and rep.answer_cut == 1


def test_chat_template_prompt_ends_with_assistant_header():
    from transformers import PreTrainedTokenizerFast

    from conftest import build_tokenizer

    tok: PreTrainedTokenizerFast = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    fmt = build_prompt_format(tok, chat_template=True)
    assert fmt.name == "chat" and fmt.prefix == "<s>user: " and fmt.suffix == "\nassistant: "
    [ex], _ = encode_rows(_rows(("the cat", "mat")), tok, fmt, max_seq_length=64)
    assert tok.decode(ex.prompt_ids) == "<s>user: the cat\nassistant: "


@pytest.mark.parametrize("state", ["plain", "truncation set", "split special tokens"])
def test_ids_read_from_the_rust_tokenizer_are_what_the_tokenizer_call_gives(state):
    """encode's fast path (the backend tokenizer) is taken only where it computes what the call computes."""
    from conftest import chat_tokenizer
    from surefit.data.encode import _ids

    tok = chat_tokenizer("chatml")
    if state == "truncation set":  # a tokenizer.json may ship with truncation on: the call turns it off
        tok.backend_tokenizer.enable_truncation(max_length=3)
    if state == "split special tokens":
        tok.split_special_tokens = True
    texts = ["<|im_start|>user\nwhere is the cat?<|im_end|>\n", "  two  spaces\n\ttab", "émoji 🙂", "a"]
    for text in texts:
        got = _ids(tok, text)
        assert got == list(tok(text, add_special_tokens=False)["input_ids"]), text
        assert len(got) > 3 or text == "a"  # the truncation the file set is not applied either way
    specials = set(tok.all_special_ids)
    assert (specials & set(_ids(tok, texts[0]))) == (set() if state == "split special tokens" else
                                                      specials & set(tok.convert_tokens_to_ids(["<|im_start|>",
                                                                                                "<|im_end|>"])))
