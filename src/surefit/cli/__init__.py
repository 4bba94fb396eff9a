"""Command line: parse -> config -> one function per command. Nothing else lives here.

Flags are generated from the config dataclasses, so every setting is reachable as ``--lora_r`` and ``--lora-r``,
and ``--help`` shows each field's help text. Flags that are not typed are left out of the parsed namespace
(``argparse.SUPPRESS``) so that a YAML ``--config`` value is only overridden by a flag the user actually gave.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from surefit.cli.finished_commands import add_finished_run_commands, run_finished_run_command
from surefit.config import TrainConfig, field_kind
from surefit.config.task_configs import TASK_CONFIGS
from surefit.config.yaml_files import load_yaml
from surefit.errors import SurefitError


def _add_config_flags(parser: argparse.ArgumentParser, classes: list[type[TrainConfig]]) -> None:
    """One flag per setting across every task's dataclass; help shows each task's default where they differ."""
    seen: dict[str, Any] = {}
    for cls in classes:
        for f in fields(cls):
            seen.setdefault(f.name, f)
    for name, f in seen.items():
        if name == "task":
            continue
        base, optional, choices = field_kind(f.type)
        names = [f"--{name}"]
        if "_" in name:
            names.append(f"--{name.replace('_', '-')}")
        defaults: dict[str, Any] = {}
        for cls in classes:
            match = next((g for g in fields(cls) if g.name == name), None)
            if match is not None and match.default is not MISSING:
                defaults[str(cls.__dataclass_fields__["task"].default)] = match.default
        help_text = f.metadata.get("help", "")
        shown = {v for v in defaults.values()}
        if len(shown) == 1 and None not in shown:
            help_text += f" (default: {next(iter(shown))})"
        elif len(shown) > 1:
            help_text += " (default: " + ", ".join(f"{task} {value}" for task, value in defaults.items()) + ")"
        if len(defaults) < len(classes):
            help_text += f" [{', '.join(defaults)} only]"
        if choices:
            help_text += f" [choices: {', '.join(map(str, choices))}]"
        # argparse %-formats help strings: a literal % (e.g. "~30% slower") must be doubled.
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if base is bool:
            # `--chat_template` alone means true; `--chat_template false` is accepted too (and YAML-style values).
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif "const" in f.metadata:  # e.g. `--resume` alone means "latest"
            kwargs.update(nargs="?", const=f.metadata["const"], metavar=name.upper())
        else:
            kwargs["metavar"] = name.upper()
        parser.add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="surefit",
        allow_abbrev=False,
        description="Fine-tune language models and PyTorch models without the classic data-pipeline bugs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model (--task sft)",
        description="Train a model. Settings come from defaults < --config FILE.yaml < flags; "
        "the resolved config is saved to OUTPUT_DIR/config.yaml.",
    )
    train.add_argument(
        "--task", default=argparse.SUPPRESS, choices=sorted(TASK_CONFIGS),
        help="training path: sft (instruction tuning of a causal LM), classify (sequence classification) or custom "
        "(any nn.Module on tensor data); default sft",
    )
    train.add_argument("--config", default=None, metavar="FILE.yaml", help="YAML file of settings; flags override it")
    from surefit.cli.launch import add_launch_flags  # here, not at the top: `python -m surefit.cli.launch` runs it

    add_launch_flags(train)
    doctor = sub.add_parser("doctor", allow_abbrev=False, help="check a training setup before step 1 (same flags as train)",
                            description="Build the run's setup exactly as `surefit train` would and report every "
                            "problem found; exit code 1 if any is an error. Takes the same flags as `train`.")
    doctor.add_argument("--list", action="store_true", help="list every finding code and what it catches")
    inspect = sub.add_parser("inspect", allow_abbrev=False, help="describe tensor data, and which layer consumes each input; "
                             "--task sft: what training supervises",
                             description="Name, shape, dtype, value range and footprint of every array; with --model, "
                             "which layer first consumes each input and whether the shapes agree. With --task sft "
                             "--data FILE [--limit N] [--out FILE.jsonl] [--show N] (and any train flag): the first "
                             "examples with their supervised spans marked, counts per role, and the encoded examples.")
    inspect.add_argument("--data", required=True, help="a folder of shards, or a dataset factory module:make")
    inspect.add_argument("--model", "--model-factory", dest="model", help="model factory module:build or file.py:build")
    inspect.add_argument("--model_args", "--model-args", dest="model_args", help="JSON keyword arguments for the factory")
    inspect.add_argument("--max_memory_gb", "--max-memory-gb", dest="max_memory_gb", type=float, default=None,
                         help="RAM the data may take while scanning")
    add_finished_run_commands(sub)
    # Every task's flags are registered so that `--help` lists them; the chosen task's dataclass validates them.
    _add_config_flags(train, list(TASK_CONFIGS.values()))
    return parser


def _task_of(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--task" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--task="):
            return a.split("=", 1)[1]
    return None


def _pull(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """``argv`` without ``flag VALUE`` (or ``flag=VALUE``), and the value."""
    rest, value, skip = [], None, False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == flag and i + 1 < len(argv):
            value, skip = argv[i + 1], True
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, value


def parse_train_config(argv: list[str]) -> Any:
    """argv of ``surefit train ...`` (without the command) -> a validated config."""
    ns, unknown = build_parser().parse_known_args(["train", *argv])
    from surefit.cli.launch import LAUNCH_SETTINGS

    given = {k: v for k, v in vars(ns).items() if k not in {"command", "config", *LAUNCH_SETTINGS}}
    # Unknown flags join the other problems (with a did-you-mean) instead of argparse exiting on the first one.
    from surefit.config.aliases import build_with_aliases, unknown_flags

    extra = unknown_flags(unknown)
    config_path = ns.config
    if given.get("resume") and not config_path:
        # `surefit train --resume --output_dir OUT` continues the run with the config it was started with.
        for task_cls in TASK_CONFIGS.values():
            out = Path(given.get("output_dir") or str(task_cls.__dataclass_fields__["output_dir"].default))
            if (out / "config.yaml").is_file():
                config_path = str(out / "config.yaml")
                break
    yaml_values = load_yaml(config_path) if config_path else {}
    task = given.pop("task", None) or yaml_values.get("task") or "sft"
    cls = TASK_CONFIGS.get(str(task))
    if cls is None:
        from surefit.errors import ConfigError, Problem

        raise ConfigError(Problem(f"unknown task {task!r}", "--task", f"use one of: {', '.join(sorted(TASK_CONFIGS))}"))
    yaml_values = {k: v for k, v in yaml_values.items() if k != "task"}
    return build_with_aliases(cls, yaml_values, {**given, **extra}, yaml_name=str(config_path))


def main(argv: list[str] | None = None) -> int:
    """Run ``surefit ARGV``; returns the exit code. A run's start-up counts from this call (or from the process start
    under :func:`run`)."""
    from surefit.startup import command

    with command():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from surefit.threads import configure_threads

    configure_threads()  # before torch is imported: OpenMP reads its wait policy once (threads.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in {"-h", "--help"}:
        parser.print_help()
        return 0
    command = argv[0]
    try:
        if command == "train":
            from surefit.cli.launch import launch, split_launch
            from surefit.training.processes import finish, world_size

            flags, rest = split_launch(argv[1:])  # every launch problem, then every config problem, before any start
            cfg = parse_train_config(rest)
            if flags is not None and flags.launches:
                return launch(flags, ["train", *rest])
            from surefit.training.heap import collector_off_for_set_up, imports_done

            if world_size() > 1:
                from surefit.training.lost_worker import register_node

                register_node()  # several machines: this node's host, so that a lost node can be named
            try:
                with collector_off_for_set_up():  # from the imports to the training loop (heap.py says why)
                    from surefit.api import train

                    imports_done()
                    train(cfg)
            except Exception as e:
                from surefit.training.lost_worker import lost_here, peer_gone
                from surefit.training.processes import process_index

                if world_size() > 1 and peer_gone(e):  # a collective found another process of the run gone
                    import signal

                    # The launcher stops the survivors with SIGTERM once it sees the lost process. The loop, left on
                    # an error, ignores it from then on (training/loop.py: _StopSignal); a collective outside the
                    # loop gets here with the default action: without this the report (a checkpoint verified first)
                    # can be cut off.
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    raise lost_here(e, process_index(), world_size(), cfg.output_dir) from e
                raise
            finish()
            return 0
        if command == "doctor":
            if "--list" in argv:
                from surefit.doctor import CODES

                print("\n".join(f"{code:26} {what}" for code, what in CODES.items()))
                return 0
            cfg = parse_train_config(argv[1:])
            from surefit.api import doctor

            report = doctor(cfg)
            return 1 if report.has_errors else 0
        if command == "inspect" and _task_of(argv[1:]) in ("sft", "dpo"):
            from surefit.api import inspect_sft

            rest, out = _pull(argv[1:], "--out")
            rest, show = _pull(rest, "--show")
            inspect_sft(parse_train_config(rest), out, int(show) if show else 2)
            return 0
        if command == "inspect":
            from surefit.api import inspect_data

            ns = parser.parse_args(argv)
            inspect_data(ns.data, ns.model, ns.model_args, ns.max_memory_gb)
            return 0
        if command in ("report", "eval", "predict", "export"):
            return run_finished_run_command(command, parser.parse_args(argv))
        parser.parse_args(argv)  # unknown command: argparse prints usage and exits 2
        return 2
    except SurefitError as e:
        _print_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _print_error(e: SurefitError) -> None:
    """Several processes: an error every process meets alike (settings, data, the doctor's verdict, a stop signal) is
    printed once, by the main process; any other names the process it happened on."""
    from surefit.training.processes import is_main_process, process_index

    if is_main_process():
        print(e.render(), file=sys.stderr)
        return
    from surefit.doctor.gate import DoctorRefused
    from surefit.errors import ConfigError, DataError, ModelError
    from surefit.training.loop import TrainingInterrupted

    if not isinstance(e, (ConfigError, DataError, ModelError, DoctorRefused, TrainingInterrupted)):
        print(f"[process {process_index()}] {e.render()}", file=sys.stderr)


def run() -> None:
    """The ``surefit`` command (``python -m surefit`` too): :func:`main`, then the end of the process.

    The interpreter's teardown frees a trained model's objects one by one, which took 5-7 s after a 50 s run on a
    loaded 2-core machine and writes nothing. So the process ends right after the exit handlers (``atexit``: logging,
    temporary files, trackers) have run and the output is flushed, without it. A thread that is still working (not a
    daemon) gets Python's ordinary exit instead. A process of a several-process run ends the same way: under load the
    teardown once aborted a process of a 2-process run that had succeeded (SIGABRT, "terminate called without an
    active exception": a C++ thread of torch's destroyed while still running).
    """
    from surefit.startup import command, process_start

    with command(process_start()):  # the user waits from the process start: imports count
        code = main()
    exit_now(code)


def exit_now(code: int) -> None:
    """Run the exit handlers, flush stdout and stderr, and end the process with ``code``: the end of :func:`run`."""
    import atexit
    import os
    import threading

    working = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if working:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
