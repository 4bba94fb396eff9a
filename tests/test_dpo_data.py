"""Preference pairs: every shape read with no flag, the shared prompt's tokens identical in both sequences, labels by
position, and bad pairs refused or excluded and counted."""

import json

import pytest

from surefit.data.encode import BUILTIN_CHAT_TEMPLATES, chat_format
from surefit.data.pairs import PairCollator, detect_pair_format, encode_pairs, to_pairs
from surefit.data.readers import Rejected
from surefit.data.rows import Row


def rows_of(items):
    return [Row(fields=dict(f), where=f"pairs.jsonl line {i + 1}", index=i) for i, f in enumerate(items)]


def read(items):
    rows = rows_of(items)
    choice = detect_pair_format(rows, "pairs.jsonl")
    problems = []
    out = to_pairs(rows, choice, "pairs.jsonl", problems)
    return choice, out, problems


CHATML = chat_format(BUILTIN_CHAT_TEMPLATES["chatml"], "chatml")
SYS = {"role": "system", "content": "Be brief."}
U1, A1 = {"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Germany?"}


@pytest.mark.parametrize("name,row,prompt,chosen,rejected", [
    ("explicit_prompt", {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, "Q: 2+2?\nA:", " 4", " 5"),
    ("explicit_prompt", {"prompt": [SYS, U1], "chosen": [{"role": "assistant", "content": "Paris."}],
                         "rejected": [{"role": "assistant", "content": "Lyon."}]}, [SYS, U1], "Paris.", "Lyon."),
    ("implicit_prompt", {"chosen": [U1, A1, U2, {"role": "assistant", "content": "Berlin."}],
                         "rejected": [U1, A1, U2, {"role": "assistant", "content": "Bonn."}]},
     [U1, {**A1, "train": False}, U2], "Berlin.", "Bonn."),
    ("sharegpt_pairs", {"conversations": [{"from": "system", "value": "Be brief."},
                                          {"from": "human", "value": "What is the capital of France?"}],
                        "chosen": {"from": "gpt", "value": "Paris."}, "rejected": {"from": "gpt", "value": "Lyon."}},
     [SYS, U1], "Paris.", "Lyon."),
    ("alpaca_pairs", {"instruction": "What is the capital of France?", "input": "", "system": "Be brief.",
                      "chosen": "Paris.", "rejected": "Lyon."}, [SYS, U1], "Paris.", "Lyon."),
    ("anthropic_hh", {"chosen": "\n\nHuman: What is the capital of France?\n\nAssistant: Paris.",
                      "rejected": "\n\nHuman: What is the capital of France?\n\nAssistant: Lyon."},
     [U1], "Paris.", "Lyon."),
])
def test_each_pair_shape_is_detected_and_read_into_one_form(name, row, prompt, chosen, rejected):
    choice, out, problems = read([row, row])
    assert choice.name == name and not problems and len(out) == 2
    f = out[0].fields
    assert f["pair_prompt"] == prompt
    if isinstance(f["pair_chosen"], str):
        assert (f["pair_chosen"], f["pair_rejected"]) == (chosen, rejected)
    else:
        assert [m["content"] for m in f["pair_chosen"]] == [chosen]
        assert [m["content"] for m in f["pair_rejected"]] == [rejected]
        assert all(m["role"] == "assistant" and m["train"] for m in f["pair_chosen"] + f["pair_rejected"])


def test_fields_that_are_no_pair_shape_name_what_the_rows_have():
    problem = detect_pair_format(rows_of([{"input": "a", "target": "b"}]), "pairs.jsonl")
    assert "its fields are 'input', 'target'" in problem.what and "chosen" in problem.fix


def test_bad_pairs_are_refused_with_row_and_reason_and_skipped_when_asked():
    items = [{"prompt": "Q1", "chosen": " same", "rejected": " same "},
             {"prompt": "Q2", "chosen": "   ", "rejected": " b"},
             {"prompt": "Q3", "chosen": " a", "rejected": " b"},
             {"prompt": "Q4", "chosen": " a"}]
    _, out, problems = read(items)
    assert len(out) == 1
    text = "\n".join(str(p) for p in problems)
    assert "1 pair has chosen equal to rejected: line 1" in text
    assert "1 pair has an empty answer or turn: line 2 the chosen answer is empty" in text
    assert "line 4 'rejected' missing" in text
    rows = rows_of(items)
    rejects: list[Rejected] = []
    problems = []
    kept = to_pairs(rows, detect_pair_format(rows, "pairs.jsonl"), "pairs.jsonl", problems, rejects)
    assert not problems and len(kept) == 1
    assert [r.where for r in rejects] == ["pairs.jsonl line 1", "pairs.jsonl line 2", "pairs.jsonl line 4"]


def test_text_prompt_ending_inside_a_bpe_merge_is_tokenised_once_and_shared():
    from conftest import build_tokenizer

    tok = build_tokenizer()
    # "Paris" / "France" are whole tokens of this vocabulary: a prompt ending inside them would merge with the answer
    # if prompt + answer were tokenised together.
    prompt, chosen, rejected = "the capital of France is Par", "is", "ks"
    together = tok(prompt + chosen, add_special_tokens=False)["input_ids"]
    alone = tok(prompt, add_special_tokens=False)["input_ids"]
    assert together[: len(alone)] != alone  # the merge really crosses the boundary
    _, rows, _ = read([{"prompt": prompt, "chosen": chosen, "rejected": rejected}])
    [ex], report, failures, _ = encode_pairs(rows, tok, None, max_seq_length=64)
    assert not failures and report.encoded == 1
    assert ex.prompt_len == len(alone)
    assert ex.chosen_ids[: ex.prompt_len] == ex.rejected_ids[: ex.prompt_len] == alone
    eos = tok.eos_token_id
    assert ex.chosen_labels == [-100] * len(alone) + tok(chosen, add_special_tokens=False)["input_ids"] + [eos]
    assert ex.rejected_labels == [-100] * len(alone) + tok(rejected, add_special_tokens=False)["input_ids"] + [eos]


def test_chat_pairs_share_the_prompt_and_train_answer_plus_terminator_only():
    from conftest import chat_tokenizer

    tok = chat_tokenizer("chatml")
    _, rows, _ = read([{"prompt": [SYS, U1, A1, U2], "chosen": "Berlin is the capital.", "rejected": "Bonn."}])
    [ex], _, failures, terms = encode_pairs(rows, tok, CHATML, max_seq_length=256)
    assert not failures
    p = ex.prompt_len
    assert ex.chosen_ids[:p] == ex.rejected_ids[:p]
    assert tok.decode(ex.chosen_ids[:p]).endswith("<|im_start|>assistant\n")
    for ids, labels, answer in ((ex.chosen_ids, ex.chosen_labels, "Berlin is the capital."),
                                (ex.rejected_ids, ex.rejected_labels, "Bonn.")):
        trained = [t for t in labels if t != -100]
        assert tok.decode(trained) == answer + "<|im_end|>"
        assert labels[:p] == [-100] * p  # the earlier assistant turn (Paris.) is prompt, not trained
        assert labels[-1] == ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert terms == {tok.convert_tokens_to_ids("<|im_end|>")}


def test_long_pairs_lose_prompt_from_the_left_never_an_answer_and_are_counted():
    from conftest import build_tokenizer

    tok = build_tokenizer()
    long_prompt = " ".join(["the cat sat on the mat"] * 20) + " Question: where?"
    items = [{"prompt": long_prompt, "chosen": " mat", "rejected": " park"},
             {"prompt": "Q: where?", "chosen": " " + "the dog ran " * 30, "rejected": " park"}]
    _, rows, _ = read(items)
    examples, report, failures, _ = encode_pairs(rows, tok, None, max_seq_length=40)
    assert not failures and len(examples) == 1 and report.truncated == 1
    ex = examples[0]
    assert len(ex.chosen_ids) <= 40 and tok.decode(ex.chosen_ids[: ex.prompt_len]).endswith("Question: where?")
    assert tok.decode([t for t in ex.chosen_labels if t != -100]) == " mat</s>"
    assert report.excluded[0][0] == "pairs.jsonl line 2" and "answers alone need" in report.excluded[0][1]
    examples, report, _, _ = encode_pairs(rows, tok, None, max_seq_length=40, truncation="exclude")
    assert not examples and len(report.excluded) == 2 and "--truncation exclude" in report.excluded[0][1]


def test_chat_pairs_too_long_drop_the_oldest_exchange_first():
    from conftest import chat_tokenizer

    tok = chat_tokenizer("chatml")
    old = [{"role": "user", "content": "the cat sat on the mat " * 8}, {"role": "assistant", "content": "ok"}]
    _, rows, _ = read([{"prompt": [SYS, *old, U2], "chosen": "Berlin.", "rejected": "Bonn."}])
    full, _, _, _ = encode_pairs(rows, tok, CHATML, max_seq_length=1024)
    [ex], report, _, _ = encode_pairs(rows, tok, CHATML, max_seq_length=len(full[0].chosen_ids) - 5)
    text = tok.decode(ex.chosen_ids[: ex.prompt_len])
    assert "Be brief." in text and "And of Germany?" in text and "cat" not in text
    assert report.truncated == 1 and report.tokens_cut == 2  # two turns dropped


def test_answers_identical_once_tokenised_are_failures_not_trained():
    from conftest import build_tokenizer

    tok = build_tokenizer()
    rows = rows_of([{"pair_prompt": "Q: where?", "pair_chosen": " mat", "pair_rejected": " mat", "tools": None}])
    examples, _, failures, _ = encode_pairs(rows, tok, None, max_seq_length=64)
    assert not examples and failures == [("pairs.jsonl line 1", "chosen and rejected are the same tokens once "
                                                                "rendered and tokenised")]


def test_collator_pads_chosen_rows_then_rejected_rows_and_nothing_else():
    batch = PairCollator(pad_token_id=0)([
        {"chosen_ids": [5, 6, 2], "chosen_labels": [-100, 6, 2], "rejected_ids": [5, 7], "rejected_labels": [-100, 7],
         "reference_logps": [-1.5, -2.5]},
        {"chosen_ids": [8, 9], "chosen_labels": [-100, 9], "rejected_ids": [8, 3, 4, 2],
         "rejected_labels": [-100, 3, 4, 2], "reference_logps": [-3.0, -4.0]}])
    assert batch["input_ids"].tolist() == [[5, 6, 2, 0], [8, 9, 0, 0], [5, 7, 0, 0], [8, 3, 4, 2]]
    assert batch["labels"].tolist() == [[-100, 6, 2, -100], [-100, 9, -100, -100], [-100, 7, -100, -100],
                                        [-100, 3, 4, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["reference_logps"].tolist() == [[-1.5, -2.5], [-3.0, -4.0]]


def test_file_reading_through_the_task_prints_format_and_splits_by_prompt(tmp_path):
    from surefit.config.dpo_config import DPOConfig
    from surefit.tasks.dpo import load_pairs

    path = tmp_path / "pairs.jsonl"
    items = [{"prompt": f"Q{i % 10}: where?", "chosen": " mat", "rejected": f" park {i}"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    said = []
    train, val, report = load_pairs(DPOConfig(data=str(path), val_fraction=0.2), said.append)
    assert report.format == "explicit_prompt" and len(train) + len(val) == 40
    assert not {r.fields["pair_prompt"] for r in train} & {r.fields["pair_prompt"] for r in val}
    assert said[0].startswith("format: explicit_prompt (prompt / chosen / rejected)")


def test_sft_settings_a_dpo_run_does_not_read_are_refused_not_ignored():
    from surefit.config.dpo_config import DPOConfig

    cfg = DPOConfig(data="pairs.jsonl", eval_generate=True, metric="rouge_l", loss="ipo", beta=0.0)
    text = "\n".join(str(p) for p in cfg.problems())
    assert "--eval_generate True does nothing in a dpo run" in text and "--metric rouge_l does nothing" in text
    assert "--beta" in text and "must be > 0 (got 0.0)" in text
    assert not DPOConfig(data="pairs.jsonl").problems()



def test_implicit_text_pairs_split_where_the_texts_part_before_a_space():
    _, out, problems = read([{"chosen": "Q: where did it sit? A: on the mat", "rejected": "Q: where did it sit? A: on a sofa"}])
    assert not problems
    f = out[0].fields
    assert (f["pair_prompt"], f["pair_chosen"], f["pair_rejected"]) == ("Q: where did it sit? A: on", " the mat", " a sofa")
