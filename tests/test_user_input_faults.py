"""Sensible use that used to end in a traceback or a refusal, and silent cases, each in the user's terms: a metric
module in the working directory, objects given as data to the Python API, a start-up cache path that is a file, a
warmup longer than the run, broken tool-call arguments, rows skipped by ``inspect``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import surefit
from conftest import qa_rows
from surefit.errors import ConfigError

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_metric_module_in_the_working_directory_is_found_for_that_option_only(tmp_path, monkeypatch):
    from surefit.tasks.sft.train_sft import score

    (tmp_path / "mymetric_33b.py").write_text(
        "def score(predictions, references):\n"
        "    return {'same': sum(p == r for p, r in zip(predictions, references)) / len(predictions)}\n")
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path) not in sys.path and "" not in sys.path  # as under the `surefit` console script
    assert score("mymetric_33b:score", ["a", "b"], [["a"], ["c"]]) == {"eval_same": 0.5}
    assert score("mymetric_33b.py:score", ["a"], [["a"]]) == {"eval_same": 1.0}
    assert str(tmp_path) not in sys.path  # the working directory was on the lookup path for that import only
    with pytest.raises(ConfigError, match="cannot load metric 'nosuchmetric:score'"):
        score("nosuchmetric:score", ["a"], [["a"]])


def test_the_console_script_finds_a_metric_in_the_working_directory(tmp_path, tiny_lm_dir):
    (tmp_path / "mymetric.py").write_text("def score(p, r):\n    return {'n': float(len(p))}\n")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa_rows(12)))
    # sys.path[0] is the script's folder, as for the installed `surefit` command; the cwd is not on the path.
    script = "import sys; sys.path[0] = '/nonexistent'; from surefit.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", script, "train", "--model", str(tiny_lm_dir), "--data", "d.jsonl",
                          "--metric", "mymetric:score", "--epochs", "1", "--lora_r", "2", "--max_seq_length", "128",
                          "--max_new_tokens", "2", "--val_fraction", "0.25", "--output_dir", "run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_n"] for r in records if r.get("type") == "epoch"] == [3.0, 3.0]


@pytest.mark.parametrize("make, kind", [
    (lambda: __import__("pandas").DataFrame(qa_rows(4)), "got pandas.DataFrame"),
    (lambda: __import__("datasets").Dataset.from_list(qa_rows(4)), "got datasets.Dataset"),
    (lambda: qa_rows(4), "got a list of 4 dicts"),
])
def test_objects_given_as_data_to_the_python_api_are_refused_by_kind_with_the_line_that_saves_them(make, kind,
                                                                                                    tmp_path):
    with pytest.raises(ConfigError) as e:
        surefit.train(data=make(), output_dir=str(tmp_path / "run"))
    (problem,) = e.value.problems  # not also "no training data given", and no "File name too long"
    assert problem.where == "data" and kind in problem.what
    assert "df.to_json('train.jsonl', orient='records', lines=True)" in problem.what
    assert not (tmp_path / "run").exists()


def test_a_startup_cache_path_that_is_a_file_turns_the_cache_off_with_a_note(tmp_path):
    from surefit.startup.cache import StartupCache

    file = tmp_path / "cache"
    file.write_text("not a folder")
    for folder in (file, file / "below"):
        said: list[str] = []
        cache = StartupCache(folder, said.append)
        cache.put("doctor", {"k": 1}, {"v": 1})  # a real write that would hit ENOTDIR
        assert cache.get("doctor", {"k": 1}) is None and cache.status({"k": 1}, False) == "off"
        assert said == [f"note: the start-up cache is off for this run: {folder if folder == file else file}"
                        f"{' is a file, not a folder' if folder == file else f', above {folder}, is a file'} "
                        "(set SUREFIT_STARTUP_CACHE to a folder, or unset it)"]
    assert file.read_text() == "not a folder"


def test_a_warmup_longer_than_the_run_is_said_with_a_fix():
    from surefit.training.schedule import Warmup, plan_schedule

    plan = plan_schedule(n_examples=32, batch_size=4, epochs=1, lr=2e-4, warmup=Warmup(50))
    assert plan.warmup_steps == 8 and plan.warmup_asked == 50
    assert ("warning: --warmup 50 is longer than the run (8 optimizer steps), so the learning rate only rises, to "
            "0.000175 at the last step (--lr 0.0002 is never reached) (fix: --warmup 1, or a ratio such as "
            "--warmup 0.1)") in plan.describe()
    assert "warning" not in plan_schedule(n_examples=32, batch_size=4, epochs=1, lr=2e-4, warmup=Warmup(8)).describe()


def _conversation(arguments: str) -> dict:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}]}


def test_tool_call_arguments_that_are_not_json_are_reported_with_row_and_turn():
    from surefit.data.formats import detect_format, to_conversations
    from surefit.data.rows import Row

    rows = [Row(fields=_conversation('{"city": "Paris"}'), where="d.jsonl line 1", index=0),
            Row(fields=_conversation('{"city": "Par'), where="d.jsonl line 2", index=1),
            Row(fields=_conversation("[" * 40 + "]" * 40), where="d.jsonl line 3", index=2)]
    problems: list = []
    choice = detect_format(rows, "d.jsonl")
    kept = to_conversations(rows, choice, "d.jsonl", problems)
    assert [r.where for r in kept] == ["d.jsonl line 1"]
    (problem,) = problems
    assert problem.what.startswith("2 rows have a malformed conversation: ")
    assert ("line 2 turn 2: the 'arguments' of tool call 'get_weather' are not valid JSON (Unterminated string "
            "starting at: line 1 column 10 (char 9))") in problem.what
    assert "line 3 turn 2: the 'arguments' of tool call 'get_weather' are not valid JSON (nested more than 32" \
        in problem.what


def test_inspect_with_skip_lists_the_rows_it_left_out(tiny_lm_dir, tmp_path):
    from surefit.config import build_config
    from surefit.config.task_configs import SFTConfig
    from surefit.tasks.sft.use_sft import inspect

    rows = [json.dumps(r) for r in qa_rows(6)]
    rows.insert(2, '{"input": "broken')
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows) + "\n")
    said: list[str] = []
    cfg = build_config(SFTConfig, None, {"model": str(tiny_lm_dir), "data": str(data), "on_bad_rows": "skip",
                                         "output_dir": str(tmp_path / "run")})
    counts = inspect(cfg, say=said.append)
    assert counts["rejected"] == 1 and counts["rows"] == 6
    assert "--on_bad_rows skip: 1 row rejected and left out:" in said
    assert any(s.startswith(f"  {data} line 3: not valid JSON") for s in said)


def test_a_max_seq_length_below_the_template_is_refused_naming_the_template_not_the_targets(tiny_lm_dir, tmp_path):
    from surefit.errors import DataError

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(12)), encoding="utf-8")
    with pytest.raises(DataError) as e:
        surefit.train(model=str(tiny_lm_dir), data=str(data), max_seq_length=8, output_dir=str(tmp_path / "run"))
    text = str(e.value)
    assert re.search(r"no train rows left after encoding: none of its \d+ rows fits --max_seq_length 8: the "
                     r"prompt template alone is \d+ tokens", text), text
    assert "no validation rows left" in text and "targets are longer" not in text, text
    assert "keeps every row whole, input included" in text, text
