"""Every finding code has tests: its name appears in the doctor's test files (each has a broken case and a healthy
twin there); a new code without tests fails here."""

from pathlib import Path

from surefit.doctor import CODES

HERE = Path(__file__).parent


def test_every_code_is_exercised_by_a_test():
    text = "\n".join(p.read_text(encoding="utf-8") for p in HERE.glob("test_checks_*.py"))
    missing = [code for code in CODES if f'"{code}"' not in text and f"'{code}'" not in text]
    assert missing == []


def test_every_code_is_registered_by_a_check():
    import surefit.doctor  # noqa: F401 - importing the package registers every check
    from surefit.doctor.core import REGISTRY

    registered = {c for codes, _ in REGISTRY for c in codes.split(",")}
    assert sorted(set(CODES) - registered) == []
