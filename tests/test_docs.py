"""The docs cannot rot: every ``console`` block of README.md and docs/*.md is run, and its output is compared.

A ``console`` block holds ``$ command`` lines (a trailing ``\\`` continues one), each followed by the output it
printed. The commands of one page run in order in one scratch folder that holds the shipped files only (git's
tracked files: a fresh clone, no untracked data or runs), so a page may train a run and then evaluate it. ``surefit``
is this checkout's CLI and ``python`` this interpreter. The shown
output must appear in the real output in order (other lines may come between: a page shows what matters), compared
after each run of digits is replaced by ``N``, so that timings and losses may move while every message, table and
column stays checked. A line ``...`` only marks that lines were left out.

A page that shows what another page's run left behind (outputs.md evaluates the runs that sft.md and classify.md
train) says so in a comment, ``<!-- tested after: sft.md classify.md -->``: its commands run after theirs in the same
folder, in one test, so that the same training does not run twice in the suite.

    python tests/test_docs.py docs/custom.md     # run a page's commands and write their real output under them
"""

from __future__ import annotations

import gc
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = ("examples", "src", "benchmarks")
_FENCE = re.compile(r"^```console[^\n]*\n(.*?)^```", re.S | re.M)
_NUMBER = re.compile(r"\d+")


@dataclass
class Command:
    line: int  # where the command starts in its page (1-based)
    text: str
    expected: list[str] = field(default_factory=list)


def commands_in(block: str, first: int = 1) -> list[Command]:
    """The ``$`` commands of one console block, each with the output lines shown after it."""
    out: list[Command] = []
    pending = ""
    for i, raw in enumerate(block.splitlines()):
        if pending or raw.startswith("$ "):
            pending += raw[2:] if not pending else raw.strip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " "
                continue
            out.append(Command(first + i, pending))
            pending = ""
        elif out and raw.strip() != "...":
            out[-1].expected.append(raw)
    return out


def commands(page: Path) -> list[Command]:
    """The commands of every console block of a page, in order."""
    text = page.read_text()
    return [cmd for block in _FENCE.finditer(text)
            for cmd in commands_in(block.group(1), text.count("\n", 0, block.start(1)) + 1)]


def _normal(line: str) -> str:
    return _NUMBER.sub("N", line.rstrip())


def run_command(cmd: Command, cwd: Path) -> tuple[int, str]:
    """Run one documented command as a user would type it, in ``cwd`` (a fresh clone: :func:`scratch`), with the
    clone's own source; returns (exit code, stdout + stderr)."""
    argv = shlex.split(cmd.text)
    if argv and argv[0] == "surefit":
        argv = [sys.executable, "-m", "surefit", *argv[1:]]
    elif argv and argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    src = cwd / "src" if (cwd / "src" / "surefit").is_dir() else REPO / "src"
    env = {**os.environ, "TQDM_DISABLE": "1", "COLUMNS": "120", "PYTHONPATH": str(src)}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr


def missing_lines(expected: list[str], actual: str) -> list[str]:
    """The expected lines not found, in order, among the actual output's lines (numbers compared as ``N``)."""
    got = [_normal(x) for x in actual.splitlines()]
    missing, at = [], 0
    for want in expected:
        norm = _normal(want)
        try:
            at = got.index(norm, at) + 1
        except ValueError:
            missing.append(want)
    return missing


def shipped_files() -> list[str]:
    """The files a fresh clone has (git's tracked files, as in the working tree); empty outside git."""
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    return [p for p in proc.stdout.split("\0") if p] if proc.returncode == 0 and proc.stdout else []


def scratch(tmp: Path) -> Path:
    """A fresh clone: every shipped file (and nothing else: no untracked data, no runs, no caches) linked in."""
    files = shipped_files()
    if not files:  # not a git checkout (an unpacked release): its folders are what ships
        for name in LINKED:
            (tmp / name).symlink_to(REPO / name)
        return tmp
    for rel in files:
        if (REPO / rel).is_file():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(REPO / rel)
    return tmp


PAGES_WITH_COMMANDS = [p for p in PAGES if commands(p)]
_AFTER = re.compile(r"<!-- tested after: ([\w.\- ]+?) -->")


def pages_first(page: Path) -> list[Path]:
    """The pages whose commands run before this page's, in its folder (the comment in the module docstring)."""
    found = _AFTER.search(page.read_text())
    return [page.parent / name for name in found.group(1).split()] if found else []


def chains() -> list[list[Path]]:
    """Each test's pages in order: a page that another page is tested after runs only in that page's chain."""
    first = {p for page in PAGES_WITH_COMMANDS for p in pages_first(page)}
    return [[*pages_first(page), page] for page in PAGES_WITH_COMMANDS if page not in first]


def test_every_page_with_commands_is_tested_once():
    """A misspelt name in a ``tested after`` comment would leave a page untested or test it twice."""
    runs = [page for chain in chains() for page in chain]
    assert sorted(runs) == sorted(PAGES_WITH_COMMANDS), [p.name for p in runs]
    assert any(len(chain) > 1 for chain in chains())  # outputs.md's, so that the branch above is exercised


def test_the_pages_hold_commands():
    """A page whose fence was mistyped would silently drop out: the ones known to hold commands must."""
    names = {p.name for p in PAGES_WITH_COMMANDS}
    assert {"classify.md", "custom.md", "sft.md", "outputs.md"} <= names, names


def _chain_id(chain: list[Path]) -> str:
    return "+".join(p.name for p in chain)


# A group each (tests/README.md): the chains are independent, some minutes long, so the test workers share them.
@pytest.mark.slow
@pytest.mark.parametrize("chain", [pytest.param(c, id=_chain_id(c), marks=pytest.mark.xdist_group(f"docs-{_chain_id(c)}"))
                                   for c in chains()])
def test_documented_commands_print_what_the_page_shows(chain, tmp_path):
    cwd = scratch(tmp_path)
    for page in chain:
        for cmd in commands(page):
            code, output = run_command(cmd, cwd)
            where = f"{page.relative_to(REPO)}:{cmd.line}: $ {cmd.text}"
            assert code == 0 or any("error" in line for line in cmd.expected), f"{where}\nexit {code}\n{output}"
            missing = missing_lines(cmd.expected, output)
            assert not missing, f"{where}\nnot in the output: {missing}\n--- real output ---\n{output}"


def test_the_comparison_checks_words_and_order_but_not_numbers():
    out = "epoch 1/2  eval_f1=0.6441\nnoise\nsaved to runs/x/final\n"
    assert not missing_lines(["epoch 1/2  eval_f1=0.7001", "saved to runs/x/final"], out)
    assert missing_lines(["saved to runs/x/final", "epoch 1/2  eval_f1=0.7001"], out)  # order matters
    assert missing_lines(["epoch 1/2  eval_em=0.6441"], out)  # a renamed metric is caught


def executed_modules(argv: list[str]) -> list[str]:
    """The surefit source files whose functions run during ``surefit ARGV`` (in this process), in the order each is
    first entered, as paths under ``src/surefit/``. Imports do not count (module and class bodies, and what they
    call): a module only imported is not read to follow the run."""
    import inspect

    from surefit.cli import main

    root = str(REPO / "src" / "surefit") + os.sep
    seen: dict[str, None] = {}
    importing = 0  # module and class bodies being run: what they call (decorators, constants) is import work

    def profile(frame, event, arg):
        nonlocal importing
        code = frame.f_code
        body = not code.co_flags & inspect.CO_NEWLOCALS
        if event == "call" and body:
            importing += 1
        elif event == "return" and body:
            importing -= 1
        elif event == "call" and not importing and code.co_filename.startswith(root) and code.co_name != "__del__":
            seen.setdefault(code.co_filename[len(root):].replace(os.sep, "/"), None)

    # A finalizer of an object an earlier test left (a shard reader's __del__, run when the collector gets to it) is
    # no part of this run: collect them first, and never count a __del__.
    gc.collect()
    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    assert code == 0, f"surefit {' '.join(argv)} exited {code}"
    return list(seen)


def walk_on_page(page: str) -> dict[str, str]:
    """The modules docs/architecture.md names in its walk of one run (its table's rows, in order), each with what the
    page says it does."""
    parts = page.split("## What one `surefit train` runs")
    section = parts[1].split("\n## ")[0] if len(parts) > 1 else ""
    return dict(re.findall(r"^\| \d+ \| `([\w/.]+\.py)` \| (.*?) \|$", section, re.M))


def test_the_architecture_page_walks_the_modules_a_tiny_run_executes(tmp_path, tiny_lm_dir, monkeypatch):
    """The walk in docs/architecture.md is what a tiny ``surefit train`` executes, module for module, in order."""
    from conftest import qa_rows

    monkeypatch.setenv("SUREFIT_STARTUP_CACHE", str(tmp_path / "cache"))  # a cold start, as a first run has
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(16)), encoding="utf-8")
    ran = executed_modules(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1",
                            "--batch_size", "4", "--max_seq_length", "128", "--output_dir", str(tmp_path / "run"),
                            "--precision", "fp32"])  # auto: bf16 or fp32 by the CPU, and another walk
    listed = walk_on_page((REPO / "docs" / "architecture.md").read_text())
    add, remove = [m for m in ran if m not in listed], [m for m in listed if m not in ran]
    table = "\n".join(f"| {i} | `{m}` | {listed.get(m, 'TODO: what it does in this run')} |" for i, m in enumerate(ran, 1))
    where = "docs/architecture.md, 'What one `surefit train` runs': "
    assert not add and not remove, (where + (f"add {', '.join(add)}; " if add else "")
                                    + (f"remove {', '.join(remove)}; " if remove else "")
                                    + "the table as the run executes it:\n" + table)
    assert list(listed) == ran, where + "the right modules, not in the order the run enters them:\n" + table


def _readme_first_example() -> list[str]:
    """The README's first command block after `make demo`: its activate line and the commands, comments cut."""
    text = (REPO / "README.md").read_text()
    after = text.split("## One example per task", 1)[1]
    block = re.search(r"```bash\n(.*?)```", after, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_first_example_runs_in_a_new_shell(tmp_path):
    """A fresh clone, a new shell (no PYTHONPATH, no activated environment), and the README's first commands as
    written: the activate line puts `surefit` on the PATH, and the first command runs."""
    lines = _readme_first_example()
    assert lines[0] == ". .venv/bin/activate" and lines[1].startswith("surefit "), lines
    if sys.prefix == sys.base_prefix:
        pytest.skip("not run from a virtual environment: there is no .venv to activate")
    clone = scratch(tmp_path)
    (clone / ".venv").symlink_to(sys.prefix)  # what `make demo` made in the clone
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    script = "\n".join(["set -e", "! command -v surefit", lines[0], lines[1]])
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[[" in proc.stdout and "2/2 rows encoded" in proc.stdout, proc.stdout


def test_the_readme_stays_an_overview():
    """The README says what surefit is, the two commands, an example per task and links; the manual is docs/."""
    text = (REPO / "README.md").read_text()
    assert len(text.encode("utf-8")) <= 12_000, len(text.encode("utf-8"))  # bytes: what `wc -c` and CI count
    assert "make demo" in text and "make test" in text
    for link in re.findall(r"\]\((docs/[\w./-]+\.md)", text):
        assert (REPO / link).is_file(), link


def _shown(output: str) -> list[str]:
    """Output as a page shows it: progress bars and blank lines left out."""
    return [x.rstrip() for x in output.splitlines() if x.strip() and "%|" not in x]


def write_outputs(page: Path) -> None:
    """Run a page's commands and write their real outputs under them (trim by hand afterwards, with ``...``)."""
    import tempfile

    text = page.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = scratch(Path(tmp))
        for before in pages_first(page):  # their runs are what this page's commands use
            for cmd in commands(before):
                run_command(cmd, cwd)
        pieces, last = [], 0
        for block in _FENCE.finditer(text):
            lines = []
            for cmd in commands_in(block.group(1)):
                code, output = run_command(cmd, cwd)
                print(f"$ {cmd.text}  [exit {code}]", file=sys.stderr)
                lines += ["$ " + cmd.text, *_shown(output)]
            pieces += [text[last : block.start(1)], "\n".join(lines) + "\n"]
            last = block.end(1)
        page.write_text("".join(pieces) + text[last:])


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        write_outputs(Path(arg).resolve())
