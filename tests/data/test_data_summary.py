"""data_report.json as a typed record: what a task's prepare found is written by ``DataSummary.to_json`` and read back
by ``DataSummary.from_json`` (eval, predict, export), which checks every value and names the file and key of each
wrong one instead of failing on it later."""

import json

import pytest

from surefit.data.readers import Rejected
from surefit.data.summary import ArrayFacts, ClassifyFacts, DataSummary, TextFacts
from surefit.errors import SurefitError
from surefit.run_folder.untrusted import SavedPlan

WHERE = "/runs/a/data_report.json"


def _sft() -> DataSummary:
    return DataSummary(
        notes=["split 40 rows -> 32 train / 8 validation"], rejected=[Rejected("train.jsonl line 41", "no 'target'")],
        format="messages", format_conversational=True, train_rows=32, val_rows=8,
        encoding={"train": {"rows": 32, "encoded": 32, "longest_target": 9, "roles": {"user": 32}},
                  "validation": {"rows": 8, "encoded": 7, "longest_target": 6}},
        facts=TextFacts(field_table=[{"column": "messages", "status": "kept", "why": "the conversation"}],
                        augmentation={"rows_before": 32, "rows_after": 32}, template="chatml (from --chat_format)",
                        stop_ids=[0, 7]))


def _through_a_file(summary: DataSummary) -> dict:
    return json.loads(json.dumps(summary.to_json()))


@pytest.mark.parametrize("summary,facts", [
    (_sft(), TextFacts),
    (DataSummary(notes=[], rejected=[], train_rows=30, val_rows=10,
                 facts=ClassifyFacts("single", {"neg": 0, "pos": 1}, "sentence", None, "label")), ClassifyFacts),
    (DataSummary(notes=[], train_rows=3, val_rows=1, facts=ClassifyFacts("regression", None, "a", "b", "score")),
     ClassifyFacts),
    (DataSummary(train_rows=6, val_rows=2, facts=ArrayFacts({"x": [8, 3], "y": [8]})), ArrayFacts),
])
def test_a_report_reads_back_as_it_was_written(summary, facts):
    saved = _through_a_file(summary)
    back = DataSummary.from_json(saved, WHERE, facts)
    assert back.to_json() == saved
    assert DataSummary.from_json(_through_a_file(back), WHERE, facts) == back  # the read-back record is a fixed point
    assert back.facts == summary.facts and back.rejected_rows == summary.rejected_rows
    assert back.encoding == summary.encoding and back.format == summary.format


def test_the_file_keeps_the_keys_runs_and_readers_know():
    saved = _sft().to_json()
    assert list(saved) == ["version", "notes", "rejected_rows", "format", "format_conversational", "train_rows",
                           "val_rows", "encoding", "field_table", "augmentation", "template", "stop_ids"]
    assert saved["rejected_rows"] == 1 and saved["version"] == 1
    regression = DataSummary(facts=ClassifyFacts("regression", None, "a", None, "score")).to_json()
    assert regression["label2id"] is None and regression["fields"] == {"text": "a", "pair": None, "label": "score"}


def test_typed_reads_of_the_counts():
    back = DataSummary.from_json(_through_a_file(_sft()), WHERE, TextFacts)
    assert back.encoded("train", "longest_target") == 9 and back.validation_examples == 7
    assert back.encoded("test", "encoded") is None and back.facts_as(TextFacts).stop_ids == [0, 7]


def test_an_old_report_without_facts_or_version_reads_with_empty_facts():
    back = DataSummary.from_json({"format": "input_target", "train_rows": 3}, WHERE, TextFacts)
    assert back.facts_as(TextFacts) == TextFacts() and back.format == "input_target"
    assert DataSummary.from_json({}, WHERE, ClassifyFacts).facts_as(ClassifyFacts).problem_type is None


def test_a_changed_report_names_every_wrong_value_with_its_key():
    saved = _through_a_file(_sft())
    saved["format_conversational"] = "yes"
    saved["stop_ids"] = [0, "7"]
    saved["encoding"]["train"]["longest_target"] = "9"
    saved["train_rows"] = True  # a bool is no row count
    with pytest.raises(SurefitError) as e:
        DataSummary.from_json(saved, WHERE, TextFacts)
    wheres = [p.where for p in e.value.problems]
    assert wheres == [f"{WHERE} 'encoding' 'train' 'longest_target'", f"{WHERE} 'format_conversational'",
                      f"{WHERE} 'train_rows'", f"{WHERE} 'stop_ids'"]
    text = str(e.value)
    assert "'format_conversational' is 'yes' (str); expected bool" in text
    assert "'stop_ids' is [0, '7'] (list); expected a list of int" in text
    assert "'longest_target' is '9' (str); expected int" in text
    assert "data_report.json was changed or cut after training" in text and "Traceback" not in text


@pytest.mark.parametrize("value,expected", [
    ([1, 2], "(what happened to the data) holds a list, not a JSON object"),
    ({"version": 2, "format": "messages"}, "is version 2; this surefit reads version 1"),
    ({"label2id": {"neg": "0"}}, "'label2id' maps labels to something other than class numbers"),
    ({"problem_type": "ordinal"}, "'problem_type' is 'ordinal' (str); expected single, multi or regression"),
    ({"fields": {"text": 3, "label": "y"}}, "'text' is 3 (int); expected str"),
])
def test_a_report_that_cannot_be_read_is_refused_by_name(value, expected):
    with pytest.raises(SurefitError) as e:
        DataSummary.from_json(value, WHERE, ClassifyFacts)
    assert expected in str(e.value) and WHERE in str(e.value)


def test_the_memory_plan_view_reads_what_training_wrote_and_refuses_the_rest():
    written = {"batch_size": 8, "micro_batch_size": 4, "precision": "bf16", "frozen_dtype": "bf16",
               "eval_batch_size": 16, "estimate": {"weights": 1}}
    plan = SavedPlan.from_json(written, "/runs/a/memory_plan.json")
    assert plan == SavedPlan(16, "bf16", "bf16") and SavedPlan.from_json(plan.to_json(), "p") == plan
    with pytest.raises(SurefitError) as e:
        SavedPlan.from_json({"eval_batch_size": 0, "precision": "fp64", "frozen_dtype": "fp8"}, "/runs/a/memory_plan.json")
    assert [p.where for p in e.value.problems] == [f"/runs/a/memory_plan.json '{k}'"
                                                  for k in ("eval_batch_size", "precision", "frozen_dtype")]
    assert "'frozen_dtype' is 'fp8' (str); expected bf16, fp16 or null" in str(e.value)
