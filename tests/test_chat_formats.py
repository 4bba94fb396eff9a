"""Each conversational format file trains with no field flags; every bad-row kind is reported with file, line
and turn; --on_bad_rows skip counts them."""

import json

import pytest

from surefit.cli import main


@pytest.fixture(scope="module")
def chat_lm_dir(tmp_path_factory):
    """A tiny causal LM whose tokenizer ships a ChatML chat template (like the embedded SmolLM2)."""
    from conftest import build_tiny_lm, chat_tokenizer
    from surefit.data.encode import BUILTIN_CHAT_TEMPLATES

    folder = tmp_path_factory.mktemp("chat_lm")
    tok = chat_tokenizer("chatml")
    tok.chat_template = BUILTIN_CHAT_TEMPLATES["chatml"]
    build_tiny_lm(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _qa(i):
    return f"What is {i} plus one?", f"It is {i + 1}."


FILES = {
    "alpaca": lambda i: {"instruction": _qa(i)[0], "input": "" if i % 2 else "Think.", "output": _qa(i)[1],
                         "system": "Be brief."},
    "messages": lambda i: {"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": [{"type": "text", "text": _qa(i)[0]}]},
                                        {"role": "assistant", "content": _qa(i)[1]}]},
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": _qa(i)[0]}, {"from": "gpt", "value": _qa(i)[1]}]},
    "prompt_completion": lambda i: {"prompt": [{"role": "user", "content": _qa(i)[0]}],
                                    "completion": [{"role": "assistant", "content": _qa(i)[1]}]},
}


@pytest.mark.parametrize("name", list(FILES))
def test_each_format_trains_with_no_field_flags(name, chat_lm_dir, tmp_path, capsys):
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(FILES[name](i)) + "\n" for i in range(12)))
    out = tmp_path / "run"
    assert main(["train", "--model", str(chat_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--max_seq_length", "256", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"format: {name} (" in printed and "chat template: the model's own" in printed
    report = json.loads((out / "data_report.json").read_text())
    assert report["format"] == name and report["encoding"]["train"]["supervised_tokens"] > 0
    pred = json.loads((out / "predictions" / "epoch_1.jsonl").read_text().splitlines()[0])
    assert pred["gold"][0].startswith("It is ") and "eval_rouge_l" in json.loads(
        (out / "metrics.jsonl").read_text().splitlines()[-1]) | {"eval_rouge_l": 1}


def test_sharegpt_mapping_line_names_every_speaker(chat_lm_dir, tmp_path, capsys):
    row = {"conversations": [{"from": "human", "value": "weather?"}, {"from": "function_call",
           "value": '{"name": "w", "arguments": {}}'}, {"from": "observation", "value": "sunny"},
           {"from": "gpt", "value": "Sunny."}], "tools": '[{"name": "w"}]'}
    data = tmp_path / "s.json"
    data.write_text(json.dumps([row] * 6))
    main(["doctor", "--model", str(chat_lm_dir), "--data", str(data), "--output_dir", str(tmp_path / "r")])
    assert ("format: sharegpt (conversations / from / value): human -> user, function_call -> assistant tool call, "
            "observation -> tool, gpt -> assistant") in capsys.readouterr().out


BAD = [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
     "1 row has an unknown role: line 2 turn 2: unknown role 'bot'", "--role_map"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     "1 row has an empty turn: line 2 turn 2 (assistant) is empty", "fill in"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                   {"role": "assistant", "content": "b"}]},
     "1 row has an impossible turn order: line 2 turns 2-3: two assistant turns in a row", "alternates"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "and?"}]},
     "1 row has an impossible turn order: line 2 ends on a user turn (turn 3)", "ends on an assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], "tools": "[{oops"},
     "1 row has a bad 'tools' field: line 2 'tools' is not valid JSON", "json.dumps"),
]


@pytest.mark.parametrize("bad,message,fix", BAD, ids=["role", "empty", "two_assistant", "ends_on_user", "tools"])
def test_every_bad_row_kind_is_reported_with_line_and_turn(bad, message, fix, chat_lm_dir, tmp_path, capsys):
    good = FILES["messages"](0) if "messages" in bad else FILES["sharegpt"](0)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, bad, good, good]))
    out = tmp_path / "run"
    assert main(["train", "--model", str(chat_lm_dir), "--data", str(data), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and fix in err and str(data) in err
    assert not (out / "final").exists()


def test_bad_rows_together_and_skip_counts_them(chat_lm_dir, tmp_path, capsys):
    rows = [FILES["messages"](i) for i in range(10)] + [b for b, _, _ in BAD if "messages" in b]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "--model", str(chat_lm_dir), "--data", str(data), "--output_dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    for expected in ("line 11 turn 2 (assistant) is empty", "line 12 turns 2-3: two assistant turns in a row",
                     "line 13 ends on a user turn", "line 14 'tools' is not valid JSON"):
        assert expected in err
    out = tmp_path / "b"
    assert main(["train", "--model", str(chat_lm_dir), "--data", str(data), "--on_bad_rows", "skip", "--epochs", "1",
                 "--max_seq_length", "256", "--output_dir", str(out)]) == 0
    assert json.loads((out / "data_report.json").read_text())["rejected_rows"] == 4
    assert len((out / "rejected_rows.jsonl").read_text().splitlines()) == 4


def test_a_conversation_file_on_a_model_without_chat_template_names_the_fix(tiny_lm_dir, tmp_path, capsys):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(FILES["messages"](i)) + "\n" for i in range(6)))
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--output_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "need a chat template" in err and "--chat_format chatml" in err


def test_predict_continues_a_conversation(chat_lm_dir, tmp_path, capsys):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(FILES["messages"](i)) + "\n" for i in range(12)))
    out = tmp_path / "run"
    assert main(["train", "--model", str(chat_lm_dir), "--data", str(data), "--epochs", "1", "--max_seq_length", "256",
                 "--output_dir", str(out)]) == 0
    ask = tmp_path / "ask.jsonl"
    ask.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 3 plus one?"}]}) + "\n")
    capsys.readouterr()
    assert main(["predict", "--run", str(out), "--file", str(ask)]) == 0
    [rec] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rec["input"] == "What is 3 plus one?" and isinstance(rec["prediction"], str)
    # eval on another conversation file: read in the run's way, scored with the run's metrics
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(FILES["sharegpt"](i)) + "\n" for i in range(20, 24)))
    assert main(["eval", "--run", str(out), "--data", str(other), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 4 and set(result["metrics"]) == {"eval_loss", "eval_rouge_l", "eval_em"}


def test_inspect_marks_only_assistant_spans_and_writes_jsonl(chat_lm_dir, tmp_path, capsys):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(FILES["messages"](i)) + "\n" for i in range(3)))
    out = tmp_path / "enc.jsonl"
    assert main(["inspect", "--task", "sft", "--model", str(chat_lm_dir), "--data", str(data), "--limit", "2",
                 "--out", str(out), "--show", "1"]) == 0
    printed = capsys.readouterr().out
    assert "<|im_start|>assistant\n[[It is 1.<|im_end|>]]" in printed
    shown = printed.split("like this]]) ---\n")[1]
    assert "[[" not in shown.split("<|im_start|>assistant")[0]  # nothing of the system or user turn supervised
    assert "turns per role: system 2, user 2, assistant 2" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and {"where", "input_ids", "labels", "text"} <= records[0].keys()
    assert len(records[0]["input_ids"]) == len(records[0]["labels"]) and records[0]["text"].endswith("<|im_end|>")


def test_fill_template_leaves_an_empty_optional_paragraph_out():
    from surefit.data.formats import fill_template

    t = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    assert fill_template(t, {"instruction": "Reword.", "input": "It be good."}) == (
        "### Instruction:\nReword.\n\n### Input:\nIt be good.\n\n### Response:\n")
    assert fill_template(t, {"instruction": "Name a colour.", "input": ""}) == (
        "### Instruction:\nName a colour.\n\n### Response:\n")
    assert fill_template("{instruction}\n\n{input}", {"instruction": "Hi", "input": None}) == "Hi"
    assert fill_template("{input}\n\nQ: {q}", {"input": " ", "q": "Why?"}) == "Q: Why?"


def test_template_names_any_field_and_a_field_no_row_has_is_refused(tiny_lm_dir, tmp_path, capsys):
    rows = [{"instruction": f"Say {w}.", "context": "" if i % 2 else f"The word is {w}.", "response": w}
            for i, w in enumerate(["cat", "dog", "bird", "tree", "park", "city"] * 2)]
    data = tmp_path / "dolly.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    template = "{instruction}\n\nContext: {context}\n\nAnswer:"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--target_field", "response",
                 "--template", template, "--epochs", "1", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "format: input_target (instruction / context / response): --template fills the prompt" in printed
    assert [line.split() for line in printed.splitlines() if line.strip().startswith("context ")] == [
        ["context", "kept", "named", "in", "--template"]]
    assert "--template: 6 of 12 rows have no or an empty 'context'" in printed
    preds = [json.loads(line) for line in (out / "predictions" / "epoch_0.jsonl").read_text().splitlines()]
    assert all("{" not in p["input"] for p in preds)
    assert any(p["input"].startswith("Say ") and "Context:" not in p["input"] for p in preds) or all(
        "Context: The word" in p["input"] for p in preds)
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--target_field", "response",
                 "--template", "{instruction}\n{contxt}", "--output_dir", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "--template names {contxt}, a field no row of" in err and "'context'" in err


def test_alpaca_template_writes_the_user_turn(chat_lm_dir, tmp_path, capsys):
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps(FILES["alpaca"](i)) + "\n" for i in range(4)))
    assert main(["inspect", "--task", "sft", "--model", str(chat_lm_dir), "--data", str(data), "--show", "2",
                 "--template", "Task: {instruction}\n\nInput: {input}"]) == 0
    printed = capsys.readouterr().out
    assert "<|im_start|>user\nTask: What is 0 plus one?\n\nInput: Think.<|im_end|>" in printed
    assert "<|im_start|>user\nTask: What is 1 plus one?<|im_end|>" in printed  # empty input: left out cleanly


def test_a_base_model_with_a_builtin_template_saves_it_and_stops_at_its_end_of_turn(tmp_path, capsys):
    """Gemma style: EOS is <eos>, yet a turn ends with <end_of_turn>; generation must stop at both."""
    from transformers import AutoTokenizer

    from conftest import build_tiny_lm, chat_tokenizer
    from surefit.data.encode import BUILTIN_CHAT_TEMPLATES

    model_dir = tmp_path / "base"
    tok = chat_tokenizer("gemma")
    build_tiny_lm(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps(FILES["sharegpt"](i)) + "\n" for i in range(8)))
    out = tmp_path / "run"
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--chat_format", "gemma", "--epochs", "1",
                 "--max_seq_length", "128", "--max_new_tokens", "6", "--output_dir", str(out)]) == 0
    assert "chat template: built-in 'gemma' (--chat_format)" in capsys.readouterr().out
    report = json.loads((out / "data_report.json").read_text())
    assert {tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id} <= set(report["stop_ids"])
    assert AutoTokenizer.from_pretrained(out / "final").chat_template == BUILTIN_CHAT_TEMPLATES["gemma"]
    ask = tmp_path / "ask.jsonl"
    ask.write_text(json.dumps({"conversations": [{"from": "human", "value": "What is 2 plus one?"}]}) + "\n")
    capsys.readouterr()
    assert main(["predict", "--run", str(out), "--file", str(ask)]) == 0
    [rec] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rec["input"] == "What is 2 plus one?" and rec["stopped"] in ("end of turn", "max_new_tokens (6)")


def test_rows_of_no_known_shape_name_the_missing_field_and_the_shapes(tiny_lm_dir, tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(4)))
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--output_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"field 'input' not found in {data}" in err and "'question'" in err and "'messages', 'conversations'" in err


def test_split_keeps_whole_conversations_and_augmentation_never_touches_assistant_text(tmp_path):
    from surefit.config import SFTConfig
    from surefit.tasks.sft import conversation_key, load_data

    rows = [{"messages": [{"role": "user", "content": f"Hello there.\n\nQuestion: what is {i % 10} plus one?"},
                          {"role": "assistant", "content": f"It is {i % 10 + 1}."}]} for i in range(40)]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SFTConfig(data=str(data), augmentation_factor=3, val_fraction=0.25, output_dir=str(tmp_path / "o"))
    train, val, report = load_data(cfg, say=lambda *_: None)
    assert len(train) == 3 * (40 - len(val)) and report.format == "messages"
    val_keys = {conversation_key(r, "input") for r in val}
    assert not any(conversation_key(r, "input") in val_keys for r in train)  # duplicates stay on one side
    changed = [r for r in train if r.variant_of is not None]
    assert changed and all(r.fields["messages"][1]["content"] == rows[r.index]["messages"][1]["content"] for r in train)
    assert any(r.fields["messages"][0]["content"] != rows[r.index]["messages"][0]["content"] for r in changed)


def test_field_table_says_what_became_of_every_field():
    from surefit.data.formats import detect_format, field_table
    from surefit.data.rows import Row

    rows = [Row({"input": f"ctx {i}\n\nQuestion: q{i}?", "target": "a", "question": f"Question: q{i}?", "id": str(i),
                 "answers": ["a"]}, f"f line {i}", i) for i in range(3)]
    table = {r["column"]: (r["status"], r["why"]) for r in field_table(rows, detect_format(rows, "f"))}
    assert table == {"input": ("kept", "read by the input_target format"),
                     "target": ("kept", "read by the input_target format"),
                     "question": ("kept", "its text is part of 'input' already"),
                     "id": ("dropped", "not part of the input_target format; name it in --template to use it"),
                     "answers": ("kept", "gold answers for scoring")}


def test_string_prompt_completion_rows_use_the_prompt_as_written(tiny_lm_dir, tmp_path, capsys):
    rows = [{"prompt": f"Q: where is the {w}?\nA:", "completion": f" on the {w}"} for w in ("mat", "park", "tree") * 4]
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "enc.jsonl"
    assert main(["inspect", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "format: prompt_completion (prompt / completion): prompt -> prompt as written (no template)" in printed
    first = json.loads(out.read_text().splitlines()[0])
    assert first["text"] == "Q: where is the mat?\nA: on the mat</s>"
    assert first["labels"].count(-100) == len(first["input_ids"]) - sum(1 for x in first["labels"] if x != -100)


def test_metrics_rouge_l_and_a_user_metric_named_on_the_command_line(tmp_path, monkeypatch):
    from surefit.errors import ConfigError
    from surefit.eval.metrics import rouge_l
    from surefit.tasks.sft import score

    assert rouge_l("the cat sat on the mat", "a cat sat on a mat") == 1.0  # articles are normalised away
    assert rouge_l("cat mat sat", "cat sat mat") == pytest.approx(2 / 3)
    assert rouge_l("", "") == 1.0 and rouge_l("x", "") == 0.0
    assert score("rouge_l", ["It is 4."], [["it is 4"]]) == {"eval_rouge_l": 1.0, "eval_em": 1.0}
    (tmp_path / "my_metric.py").write_text("def length(predictions, references):\n"
                                           "    return {'len_ratio': len(predictions[0]) / len(references[0])}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score("my_metric:length", ["abcd"], [["ab"]]) == {"eval_len_ratio": 2.0}
    with pytest.raises(ConfigError) as e:
        score("my_metric:nope", ["a"], [["a"]])
    assert "cannot load metric 'my_metric:nope'" in e.value.render() and "--metric" in e.value.render()


def test_eval_generate_false_keeps_the_loss_only(chat_lm_dir, tmp_path, capsys):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(FILES["messages"](i)) + "\n" for i in range(12)))
    out = tmp_path / "run"
    assert main(["train", "--model", str(chat_lm_dir), "--data", str(data), "--epochs", "1", "--eval_generate", "false",
                 "--output_dir", str(out)]) == 0
    assert "eval computes the validation loss only (--eval_generate false)" in capsys.readouterr().out
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x]
    assert [set(r) & {"eval_loss", "eval_rouge_l", "eval_em"} for r in epochs if r["type"] == "epoch"] == [
        {"eval_loss"}, {"eval_loss"}]
    assert not (out / "predictions").exists() or not any((out / "predictions").iterdir())


def test_generation_reports_progress_per_batch():
    from conftest import tiny_llama
    from surefit.eval.generate import Decode, greedy_generate

    seen = []
    out = greedy_generate(tiny_llama(), [[1, 2, 3]] * 5, Decode(pad_token_id=0, eos_token_ids=[0], max_new_tokens=2, batch_size=2), progress=lambda done, total: seen.append((done, total)))
    assert len(out) == 5 and seen == [(2, 5), (4, 5), (5, 5)]


@pytest.mark.slow
def test_embedded_model_supervises_exactly_the_glaive_assistant_turns_and_im_end(tmp_path, capsys):
    """The done-when check on the real tokenizer: ShareGPT tool-call rows, the model's own ChatML template."""
    from pathlib import Path

    from surefit.models import load_tokenizer, model_folder, resolve_model

    data = Path(__file__).resolve().parents[1] / "examples" / "chat" / "glaive_toolcall_40.json"
    out = tmp_path / "enc.jsonl"
    assert main(["inspect", "--task", "sft", "--data", str(data), "--out", str(out), "--show", "0"]) == 0
    source = resolve_model(None)
    tok, _ = load_tokenizer(model_folder(source, log=lambda *_: None), source)
    rows = json.loads(data.read_text())
    spans = calls = 0
    for line, row in zip(out.read_text().splitlines(), rows, strict=True):
        rec = json.loads(line)
        runs, cur = [], []
        for t, label in zip(rec["input_ids"], rec["labels"], strict=True):
            if label != -100:
                cur.append(t)
            elif cur:
                runs, cur = runs + [cur], []
        runs += [cur] if cur else []
        texts = [tok.decode(r, skip_special_tokens=False) for r in runs]
        turns = [m["value"] + "<|im_end|>" for m in row["conversations"] if m["from"] in ("gpt", "function_call")]
        assert texts and texts == turns[len(turns) - len(texts):]  # the oldest turns may be dropped to fit
        spans += len(texts)
        calls += sum(t.startswith('{"name"') for t in texts)
    assert calls > 0 and spans > len(rows)


def _convert(rows, name="auto", role_map=None, complete=True):
    from surefit.data.formats import detect_format, parse_role_map, to_conversations
    from surefit.data.rows import Row

    rows = [Row(r, f"f.jsonl line {i}", i - 1) for i, r in enumerate(rows, 1)]
    roles, role_problems = parse_role_map(role_map)
    choice = detect_format(rows, "f.jsonl", name, role_map=roles)
    problems = list(role_problems)
    out = to_conversations(rows, choice, "f.jsonl", problems, complete=complete)
    return out, problems, choice


def test_alpaca_with_system_and_history_becomes_turns_in_order():
    [row], problems, choice = _convert([{"system": "Be kind.", "history": [["Hi", "Hello!"]], "instruction": "Add 2+2.",
                                         "input": "", "output": "4"}])
    assert problems == [] and choice.name == "alpaca"
    assert [(m["role"], m["content"]) for m in row.fields["messages"]] == [
        ("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Add 2+2."), ("assistant", "4")]


def test_conversations_stored_as_json_text_and_role_map():
    convo = json.dumps([{"from": "person", "value": "Hi"}, {"from": "bot", "value": "Hello!"}])
    [row], problems, choice = _convert([{"conversations": convo}], role_map="person=user,bot=assistant")
    assert problems == [] and "person -> user, bot -> assistant" in choice.line()
    _, problems, _ = _convert([{"conversations": convo}], role_map="bot:assistant")
    assert "cannot read 'bot:assistant': expected SPEAKER=ROLE" in problems[0].what and problems[0].where == "--role_map"


def test_a_conversation_must_start_with_a_user_turn_and_parts_must_be_text():
    _, problems, _ = _convert([{"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]},
                               {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                                             {"role": "assistant", "content": "A"}]}])
    text = " | ".join(p.what for p in problems)
    assert "line 1 turn 2: starts with an assistant turn" in text
    assert "line 2 turn 1: content is neither text nor a list of text parts" in text
    [row], problems, _ = _convert([{"messages": [{"role": "user", "content": "Hi"}]}], complete=False)
    assert problems == [] and row.fields["messages"][-1]["role"] == "user"  # predict: the model answers it


def test_a_template_that_refuses_a_row_is_reported_with_the_row(tmp_path, capsys):
    """A template that raises (like Gemma's 'roles must alternate') names the row and the template's own words."""
    from conftest import build_tiny_lm, chat_tokenizer

    model_dir = tmp_path / "m"
    tok = chat_tokenizer("chatml")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}"
                         "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    build_tiny_lm(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [FILES["messages"](i) for i in range(6)]
    rows[3]["messages"][2:2] = [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--val_fraction", "0.2",
                 "--output_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "row cannot be rendered and labelled by position" in err and "line 4" in err
    assert "no tool turns" in err and "--on_bad_rows skip" in err


def test_chat_settings_that_contradict_each_other_are_refused():
    from surefit.config import SFTConfig

    text = " | ".join(p.what for p in SFTConfig(chat_format="chatml", chat_template=False).problems())
    assert "--chat_format chatml and --chat_template false both given" in text
    assert any(p.where == "--metric" for p in SFTConfig(metric="bleu").problems())
