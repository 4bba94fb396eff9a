"""The command line of a finished run: ``report``, ``eval``, ``predict`` and ``export`` (``cli/__init__.py`` has training)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_finished_run_commands(sub: Any) -> None:
    """``report``, ``eval``, ``predict`` and ``export``: they read a finished run folder (finished.py, then the task
    module)."""
    report = sub.add_parser("report", allow_abbrev=False, help="(re)build curves.svg and report.html of a run folder",
                            description="Draw OUTPUT/curves.svg and write OUTPUT/report.html (config, memory plan, "
                            "doctor findings, metrics, curves, sample predictions) from a finished, interrupted or "
                            "running run folder.")
    report.add_argument("--run", required=True, metavar="OUTPUT", help="the run's --output_dir")
    def run_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run", required=True, metavar="OUTPUT", help="a finished run: the --output_dir of surefit train")
        # A run folder is data: the code its config.yaml names runs only when this command line says so.
        p.add_argument("--allow_code", "--allow-code", dest="allow_code", action="store_true",
                       help="run the code the run's config.yaml names (a head, a model or data factory, remote code)")
        p.add_argument("--trust_remote_code", "--trust-remote-code", dest="trust_remote_code", action="store_true",
                       help="let the run's model folder run its own Python code when loading")

    def field_args(p: argparse.ArgumentParser, what: str) -> None:
        for name, help_text in (("input_field", "sft: field holding the input (default: the run's)"),
                                ("target_field", "sft: field holding the target (default: the run's)"),
                                ("text_field", "classify: field holding the text (default: the run's)"),
                                ("text_pair_field", "classify: field holding the second text of a pair"),
                                ("label_field", "classify: field holding the label (default: the run's)")):
            if what == "predict" and name in ("target_field", "label_field"):
                continue
            p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, metavar="NAME", help=help_text)

    def batch_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=int, metavar="N",
                       help="rows per batch (default: the run's evaluation batch)")
        p.add_argument("--max_new_tokens", "--max-new-tokens", dest="max_new_tokens", type=int, metavar="N",
                       help="sft: longest generated answer (default: the run's, as in its evaluation)")

    ev = sub.add_parser("eval", allow_abbrev=False, help="evaluate a finished run",
                        description="Evaluate a finished run on its validation split, re-derived exactly as training "
                        "did (the numbers match the last epoch of metrics.jsonl), or on --data. Prints a table; "
                        "--json prints JSON instead, --out writes it to a file.")
    run_arg(ev)
    ev.add_argument("--data", metavar="FILE", help="evaluate on this file (a tensor folder for custom runs)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    ev.add_argument("--out", metavar="FILE.json", help="also write the result as JSON to this file")
    ev.add_argument("--predictions", metavar="FILE.jsonl", help="write every row's prediction to this file")
    batch_args(ev)
    field_args(ev, "eval")
    pr = sub.add_parser("predict", allow_abbrev=False, help="predict with a finished sft or classify run",
                        description="sft: generate the response with the run's prompt format; classify: the label "
                        "and its probabilities. One JSON object per line, to stdout as each batch finishes, or to "
                        "--out FILE.")
    run_arg(pr)
    pr.add_argument("--input", action="append", metavar="TEXT", help="a text to predict on (repeatable)")
    pr.add_argument("--file", metavar="ROWS", help="rows (JSONL, JSON, CSV, TSV, Parquet) holding the input field")
    pr.add_argument("--out", metavar="FILE.jsonl", help="write the predictions here instead of stdout")
    batch_args(pr)
    field_args(pr, "predict")
    ex = sub.add_parser("export", allow_abbrev=False, help="export a finished run's model (merged with --merge)",
                        description="Copy a run's final model to --to. --merge folds a LoRA adapter into the base "
                        "weights and saves a full model (safetensors) + tokenizer that plain transformers loads.")
    run_arg(ex)
    ex.add_argument("--to", required=True, metavar="DIR", help="the folder to write (new or empty)")
    ex.add_argument("--merge", action="store_true", help="merge the LoRA adapter into the base weights")
    ex.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --to")


def run_finished_run_command(command: str, ns: argparse.Namespace) -> int:
    """One call per command; progress goes to stderr so that stdout holds only the result."""
    import surefit.api.use_run as api

    def err(message: str) -> None:
        print(message, file=sys.stderr)

    if command == "report":
        api.report(ns.run)
        return 0
    names = ("input_field", "target_field", "text_field", "text_pair_field", "label_field")
    fields = {k: getattr(ns, k) for k in names if getattr(ns, k, None) is not None}
    code = {"allow_code": ns.allow_code, "trust_remote_code": ns.trust_remote_code}
    if command == "eval":
        api.evaluate(ns.run, ns.data, out=ns.out, predictions=ns.predictions, say=err, **code,
                     options=api.UseOptions(ns.batch_size, ns.max_new_tokens, fields, "json" if ns.json else "table"))
    elif command == "predict":
        api.predict(ns.run, ns.input, ns.file, out=ns.out, say=err, **code,
                    options=api.UseOptions(ns.batch_size, ns.max_new_tokens, fields,
                                           stream=None if ns.out else sys.stdout, collect=False))
    else:
        api.export(ns.run, ns.to, merge=ns.merge, overwrite=ns.overwrite, say=err, **code)
    return 0
