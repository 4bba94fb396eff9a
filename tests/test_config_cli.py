import pytest
import yaml

from surefit.cli import main, parse_train_config
from surefit.config import SFTConfig, build_config, save_config
from surefit.errors import ConfigError


def test_seed_flag_spelling_is_accepted_as_typed_and_with_dashes():
    seeds = "--epochs 10 --augmentation_factor 3 --lora_r 16 --batch_size 4 --max_seq_length 512 --data d.jsonl".split()
    cfg = parse_train_config(seeds)
    assert (cfg.epochs, cfg.augmentation_factor, cfg.lora_r, cfg.batch_size, cfg.max_seq_length) == (10, 3, 16, 4, 512)
    dashed = parse_train_config("--augmentation-factor 2 --lora-r 8 --batch-size 6 --max-seq-length 128 --data d".split())
    assert (dashed.augmentation_factor, dashed.lora_r, dashed.batch_size, dashed.max_seq_length) == (2, 8, 6, 128)


def test_flags_override_yaml_and_resolved_config_round_trips(tmp_path):
    (tmp_path / "c.yaml").write_text("data: a.jsonl\nepochs: 5\nlora-r: 4\nlr: 0.001\nchat_template: true\n")
    cfg = parse_train_config(["--config", str(tmp_path / "c.yaml"), "--epochs", "2"])
    assert (cfg.epochs, cfg.lora_r, cfg.lr, cfg.chat_template, cfg.data) == (2, 4, 0.001, True, "a.jsonl")
    save_config(cfg, tmp_path / "resolved.yaml")
    again = parse_train_config(["--config", str(tmp_path / "resolved.yaml")])
    assert again == cfg
    assert yaml.safe_load((tmp_path / "resolved.yaml").read_text())["task"] == "sft"


def test_all_config_problems_reported_together_naming_flags():
    with pytest.raises(ConfigError) as e:
        parse_train_config("--epochs 0 --batch_size -4 --lr abc --lorar 3 --data d".split())
    text = e.value.render()
    assert "4 problems" in text
    assert "--epochs: must be >= 1 (got 0)" in text
    assert "--batch_size: must be >= 1 (got -4)" in text
    assert "--lr: expected a number, got 'abc'" in text
    assert "did you mean 'lora_r'?" in text


def test_batch_size_not_divisible_by_grad_accum_is_refused_with_divisors():
    with pytest.raises(ConfigError, match=r"(?s)--batch_size 6 is not divisible by --grad_accum 4.*1, 2, 3, 6"):
        build_config(SFTConfig, None, {"data": "d", "batch_size": 6, "grad_accum": 4})
    assert build_config(SFTConfig, None, {"data": "d", "batch_size": 8, "grad_accum": 4}).micro_batch_size == 2


def test_non_integer_for_int_flag_is_an_error_not_a_floor():
    with pytest.raises(ConfigError, match=r"--epochs: expected a whole number, got 2.5"):
        build_config(SFTConfig, {"epochs": 2.5, "data": "d"}, None)


def test_cli_exit_code_2_and_report_on_stderr(capsys):
    assert main(["train", "--epochs", "0", "--batch_size", "-1", "--data", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "configuration error (2 problems)" in err and "--epochs" in err and "--batch_size" in err


def test_help_lists_every_field_with_its_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--augmentation_factor" in out and "--lora-r" in out and "LoRA rank; 0 means full fine-tuning." in out


def test_public_train_function_survives_importing_the_training_modules():
    import surefit
    import surefit.training.loop  # noqa: F401  (a subpackage named `train` used to shadow surefit.train)

    assert callable(surefit.train)
