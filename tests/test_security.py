"""Safe loading, checked on the source: a regression here is a security bug, so it fails the suite."""

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "surefit"

FORBIDDEN = {
    r"(?<![\w.])eval\(": "eval() runs arbitrary code",
    r"(?<![\w.])exec\(": "exec() runs arbitrary code",
    r"yaml\.load\(": "yaml.load can build arbitrary objects; use yaml.safe_load",
    r"pickle\.loads?\(": "unpickling runs arbitrary code",
    r"trust_remote_code=True": "remote code must only run when the user passes --trust_remote_code",
}


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_no_eval_exec_unsafe_yaml_pickle_or_forced_remote_code():
    hits = []
    for path in _sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code):
                    hits.append(f"{path.relative_to(SRC)}:{n}: {why}: {line.strip()}")
    assert hits == []


def test_every_torch_load_is_weights_only():
    calls = [(p, n, line) for p in _sources() for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if "torch.load(" in line.split("#", 1)[0]]
    assert calls, "the checkpoint loader uses torch.load; this test must see it"
    assert [f"{p.name}:{n}" for p, n, line in calls if "weights_only=True" not in line] == []


def test_every_from_pretrained_that_can_run_code_passes_the_users_choice():
    """AutoModel*/AutoTokenizer/AutoConfig loads name trust_remote_code explicitly (the user's flag, default off)."""
    missing = []
    for path in _sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"Auto\w+\.from_pretrained\(", line) and "gguf_file" not in line:
                window = " ".join(path.read_text(encoding="utf-8").splitlines()[n - 1 : n + 3])
                if "trust_remote_code" not in window:
                    missing.append(f"{path.name}:{n}")
    assert missing == []
