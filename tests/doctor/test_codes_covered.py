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
    from surefit.doctor.checks_dpo import ENTRY_POINT_CODES
    from surefit.doctor.core import REGISTRY

    # The dpo checks need encoded pairs and the loss, which a Setup does not hold: they run through their own entry
    # points (check_pairs, check_dpo_trainer), whose module lists their codes; no code is in both or in neither.
    registered = {c for codes, _ in REGISTRY for c in codes.split(",")}
    assert sorted(set(CODES) - registered - ENTRY_POINT_CODES) == []
    assert sorted(registered & ENTRY_POINT_CODES) == []
    assert ENTRY_POINT_CODES <= set(CODES)
