r"""Math grading of a completion against a reference (math-verify). Runs inside sandbox workers, never in the trainer.

``answers.py`` finds the answer a completion commits to; it is then compared with the reference by
``math_verify.verify`` (so ``\boxed{1/2}`` equals ``0.5``), after screens that keep hostile inputs away from sympy.
"""

from __future__ import annotations

import re

from amir_lightning.rewards.answers import committed, extract_answer, reference_answer

MAX_CANDIDATE_CHARS = 512  # a longer "answer" is not an answer; keeps sympy away from megabyte inputs

_BIG_NUMBER = re.compile(r"\d{60,}")
# An exponent whose own exponent is a power: 9^9^9, 9^{9^9}, 9**9**9 (a^2 + b^2 is fine).
_TOWER = re.compile(r"(\^|\*\*)\s*(\{[^{}]*(\^|\*\*)|\(?[\w.]+\)?\s*(\^|\*\*))")
# Factorials and binomials of large (4+ digit) or exponentiated arguments: exact integers of millions of digits.
_BIG_COMBINATORICS = re.compile(r"(\d{4,}|\^|\*\*)[^!]{0,12}!|\\[dt]?binom\s*\{[^{}]*(\d{4,}|\^)|\\choose")
_COMMANDS = ("\\def", "\\newcommand", "\\renewcommand", "\\input", "\\include", "\\csname", "\\loop")


def _hostile(candidate: str) -> bool:
    """Cheap screens for answers built to hang or blow up a symbolic parser."""
    depth = deepest = 0
    for ch in candidate:
        if ch in "({[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")}]":
            depth -= 1
    return (
        deepest > 12
        or bool(_TOWER.search(candidate))
        or candidate.count("!") > 2
        or bool(_BIG_COMBINATORICS.search(candidate))
        or bool(_BIG_NUMBER.search(candidate))
        or any(c in candidate for c in _COMMANDS)
        or any(ord(ch) < 32 and ch not in "\t\n" for ch in candidate)
    )


def _parse(candidate: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # Wrapping in \boxed{} makes math-verify read exactly this candidate (LaTeX or plain), nothing around it.
    return parse("\\boxed{" + candidate + "}", extraction_config=configs, parsing_timeout=None)


def grade_answer(completion: str, answer: str, fallback_last_number: bool = True) -> float:
    """1.0 if the answer ``completion`` commits to equals the reference ``answer``, else 0.0."""
    from math_verify import verify

    region = extract_answer(completion, fallback_last_number)
    if region is None or len(region) > MAX_CANDIDATE_CHARS:
        return 0.0
    candidate, reference = committed(region), reference_answer(answer)
    if not candidate:
        return 0.0
    if candidate.replace(" ", "").lower() == reference.replace(" ", "").lower():
        return 1.0
    if _hostile(candidate):  # would make sympy compute for hours or exhaust memory; a real answer never is
        return 0.0
    gold, pred = _parse(reference), _parse(candidate)
    if not gold or not pred:
        return 0.0
    # math-verify's own timeouts use SIGALRM (main thread only); the sandbox enforces ours instead.
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
