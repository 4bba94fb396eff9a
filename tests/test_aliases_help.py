"""Other tools' setting names, the help of every command, and errors worded for the Python API."""

import argparse

import pytest

import surefit
from surefit.cli import build_parser, main, parse_train_config
from surefit.config import SFTConfig
from surefit.config.aliases import ALIASES, build_with_aliases
from surefit.config.yaml_files import load_yaml
from surefit.errors import ConfigError


def test_trainer_names_are_read_as_surefit_settings_and_noted_once():
    argv = ("--learning_rate 1e-4 --num_train_epochs 2 --gradient_accumulation_steps 2 --model_name_or_path m --bf16 "
            "--max_length 128 --warmup_steps 10 --lr_scheduler_type warmup_stable_decay --eval_steps 5 --save_steps 7 "
            "--logging_steps 3 --seed 5 --output_dir o --weight_decay 0.1 --max_steps 9 --data d").split()
    cfg = parse_train_config(argv)
    assert (cfg.lr, cfg.epochs, cfg.grad_accum, cfg.model, cfg.precision, cfg.max_seq_length) == (1e-4, 2, 2, "m",
                                                                                                   "bf16", 128)
    assert (cfg.warmup, cfg.lr_scheduler, cfg.eval_every, cfg.save_every, cfg.log_every) == (10, "wsd", 5, 7, 3)
    assert (cfg.seed, cfg.output_dir, cfg.weight_decay, cfg.max_steps) == (5, "o", 0.1, 9)
    assert "--learning_rate is surefit's --lr: read as --lr 1e-4" in cfg.alias_notes
    assert "--bf16 is surefit's --precision: read as --precision bf16" in cfg.alias_notes
    assert len(cfg.alias_notes) == 11
    assert parse_train_config("--fp16 true --max_seq_length 64 --data d".split()).precision == "fp16"


def test_aliases_work_in_yaml_and_as_api_keywords(tmp_path):
    (tmp_path / "c.yaml").write_text("data: d.jsonl\nlearning_rate: 3.0e-4\nnum_train_epochs: 4\ntarget_modules: "
                                     "[q_proj, v_proj]\nmax_seq_len: 64\n")
    cfg = parse_train_config(["--config", str(tmp_path / "c.yaml")])
    assert (cfg.lr, cfg.epochs, cfg.lora_targets, cfg.max_seq_length) == (3e-4, 4, "q_proj,v_proj", 64)
    cfg = build_with_aliases(SFTConfig, None, {"data": "d", "learning_rate": 1e-3, "save_total_limit": 2}, keywords=True)
    assert (cfg.lr, cfg.keep_checkpoints) == (1e-3, 2)
    assert cfg.alias_notes[0] == "learning_rate is surefit's lr: read as lr=0.001"
    assert all(v in {f.name for f in __import__("dataclasses").fields(SFTConfig)} for v in ALIASES.values())


def test_alias_and_surefit_name_disagreeing_is_refused():
    with pytest.raises(ConfigError, match=r"--learning_rate 1e-3 and --lr 1e-4 both given"):
        parse_train_config("--learning_rate 1e-3 --lr 1e-4 --data d".split())


def test_per_device_batch_size_explains_the_difference_and_gives_the_flags():
    with pytest.raises(ConfigError) as e:
        parse_train_config("--per_device_train_batch_size 4 --gradient_accumulation_steps 2 --data d".split())
    text = e.value.render()
    assert "eval_batch_size" not in text  # no misleading did-you-mean
    assert "micro-batch on one process" in text and "--batch_size is the effective batch" in text
    assert "--batch_size 8 --grad_accum 2" in text


def test_trainer_settings_with_another_meaning_say_what_to_use():
    with pytest.raises(ConfigError) as e:
        parse_train_config("--load_best_model_at_end true --early_stopping_patience 3 --eval_strategy steps "
                           "--optim adamw_torch --data d".split())
    text = e.value.render()
    assert "4 problems" in text
    assert "--keep_best METRIC" in text and "--early_stopping eval_loss:3" in text and "--eval_every N" in text


def _every_parser():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [parser, *subs.choices.values()]


def test_every_command_help_renders_without_argparse_internals():
    for p in _every_parser():
        text = p.format_help()
        assert "option_strings" not in text and "%(" not in text, p.prog
    train = next(p for p in _every_parser() if p.prog.endswith("train")).format_help()
    assert "~30% slower" in train


def test_task_help_lists_all_three_tasks(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    task_help = out[out.index("--task") :]
    assert all(name in task_help[:400] for name in ("sft", "classify", "custom"))


def test_python_api_errors_name_the_keyword_argument():
    with pytest.raises(ConfigError) as e:
        surefit.train(data="d", lr=-1.0, batch_size=6, grad_accum=4, lorar=2)
    text = e.value.render()
    assert "lr: must be > 0" in text and "fix: e.g. lr=2e-4" in text
    assert "batch_size=6 is not divisible by grad_accum=4" in text
    assert "(in the arguments)" in text
    assert "--" not in text.replace("--help", "")


def test_yaml_loader_keeps_alias_keys_for_build_config(tmp_path):
    (tmp_path / "c.yaml").write_text("gradient-accumulation-steps: 2\n")
    assert load_yaml(tmp_path / "c.yaml") == {"gradient_accumulation_steps": 2}


def test_chat_template_takes_a_file_a_builtin_name_or_a_bool(tmp_path):
    """What people type: `--chat_template my.jinja` (TRL/Axolotl style), `chatml`, true/false, and the aliases."""
    from surefit.config import SFTConfig

    jinja = tmp_path / "my.jinja"
    jinja.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}")
    cfg = build_with_aliases(SFTConfig, None, {"data": "d", "chat_template": str(jinja)})
    assert cfg.chat_format == str(jinja) and cfg.chat_template is None
    assert any("read as --chat_format" in n for n in cfg.alias_notes), cfg.alias_notes
    assert build_with_aliases(SFTConfig, None, {"data": "d", "chat_template": "chatml"}).chat_format == "chatml"
    assert build_with_aliases(SFTConfig, None, {"data": "d", "chat_template": "false"}).chat_template is False
    assert build_with_aliases(SFTConfig, None, {"data": "d", "chat_template": "tokenizer_default"}).chat_template is True
    assert build_with_aliases(SFTConfig, {"data": "d", "chat_template_path": str(jinja)}, None).chat_format == str(jinja)
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    cfg = build_with_aliases(SFTConfig, {"data": "d", "chat_template": "jinja", "chat_template_jinja": inline}, None)
    assert cfg.chat_format == inline and cfg.chat_template is None
    with pytest.raises(ConfigError) as e:
        build_with_aliases(SFTConfig, None, {"data": "d", "chat_template": str(jinja), "chat_format": "llama3"})
    assert "both given" in str(e.value) and "--chat_format" in str(e.value)


def test_chat_template_file_reaches_the_template_choice(tmp_path):
    from conftest import build_tokenizer
    from surefit.data.encode import resolve_chat_template

    tok = build_tokenizer()
    jinja = tmp_path / "my.jinja"
    jinja.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}")
    fmt, why = resolve_chat_template(tok, None, str(jinja))
    assert fmt is not None and str(jinja) in why and tok.chat_template == jinja.read_text()
    fmt, why = resolve_chat_template(tok, None, "{{ messages[0].content }}")
    assert fmt.source == "{{ messages[0].content }}" and "Jinja text" in why
