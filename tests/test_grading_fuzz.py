"""2,000 adversarial completions (200 of each of the ten families) through the sandboxed grader: every one gets a
score in [0, 1], the few that hang the parser cut at their deadline. ``benchmarks/grading.py`` runs 10,000 and
prints the time per completion."""

import pytest

from amir_lightning.rewards.fuzz import adversarial_completions
from amir_lightning.rewards.grading import grade_answer
from amir_lightning.rewards.sandbox import SandboxedGrader

pytestmark = pytest.mark.slow
TIMEOUT = 2.0


def test_two_thousand_adversarial_completions():
    cases = adversarial_completions(2_000, seed=0)
    grader = SandboxedGrader(timeout_s=TIMEOUT, num_workers=2)
    try:
        scores = grader.map(grade_answer, cases)
        assert len(scores) == len(cases) and all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores)
        # The well-formed answers among them (every tenth) are still graded right: half are correct by design.
        plain = [s for i, s in enumerate(scores) if i % 10 == 9]
        assert 0.35 < sum(plain) / len(plain) < 0.65
        assert grader.timeouts <= 10  # the screens keep sympy out of almost every trap (a timeout fired for the rest)
    finally:
        grader.close()


def test_hostile_answer_families_are_screened_before_sympy(monkeypatch):
    """Towers, deep nesting, huge numbers and TeX macros are scored 0 without parsing: math-verify sees plain numbers
    only (the reference "7", and "10000000", which is what ``10000000!!!`` commits to)."""
    import amir_lightning.rewards.grading as grading

    original = grading._parse

    def parse(candidate):
        assert candidate.isdigit(), f"{candidate!r} reached math-verify"
        return original(candidate)

    monkeypatch.setattr(grading, "_parse", parse)
    for completion in [
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{" + "(" * 50 + "1" + ")" * 50 + "}",
        "\\boxed{" + "9" * 80 + "}",
        "\\boxed{\\def\\x{\\x\\x}\\x}",
        "\\boxed{10000000!!!}",
    ]:
        assert grade_answer(completion, "7") == 0.0
