r"""Answer extraction and math grading (math-verify). Runs inside sandbox worker processes, never in the trainer.

Extraction order for a completion (the first that matches wins):
1. the last ``\boxed{...}`` (brace-matched, nested braces allowed);
2. the content of the last ``<answer>...</answer>`` (or what follows a last, unclosed ``<answer>``);
3. the number after the last ``#### `` (GSM8K style);
4. optionally (``fallback_last_number``) the last number in the text.
The candidate is then compared with the reference by ``math_verify.verify`` (so ``\boxed{1/2}`` equals ``0.5``).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
MAX_CANDIDATE_CHARS = 512  # a longer "answer" is not an answer; keeps sympy away from megabyte inputs


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` or ``\fbox{...}`` with balanced braces, or ``None``."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def extract_answer(text: str, fallback_last_number: bool = True) -> str | None:
    """The final answer a completion commits to, as a string, or ``None`` (see the module docstring)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    open_at = text.rfind(_ANSWER_OPEN)
    if open_at >= 0:
        inner = text[open_at + len(_ANSWER_OPEN) :]
        close_at = inner.find(_ANSWER_CLOSE)
        inner = inner[:close_at] if close_at >= 0 else inner
        nested = last_boxed(inner)
        return (nested if nested is not None else inner).strip() or None
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    if fallback_last_number:
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", "")
    return None


def reference_answer(answer: str) -> str:
    """Normalise a dataset answer: GSM8K's ``... #### 72`` becomes ``72``; thousands separators dropped."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    answer = answer.strip().strip("$").strip()
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", answer):
        answer = answer.replace(",", "")
    return answer


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
    """1.0 if the completion's extracted answer equals the reference ``answer``, else 0.0."""
    from math_verify import verify

    candidate = extract_answer(completion, fallback_last_number)
    if candidate is None or len(candidate) > MAX_CANDIDATE_CHARS:
        return 0.0
    reference = reference_answer(answer)
    if candidate.replace(" ", "") == reference.replace(" ", ""):
        return 1.0
    if _hostile(candidate):  # would make sympy compute for hours or exhaust memory; a real answer never is
        return 0.0
    gold, pred = _parse(reference), _parse(candidate)
    if not gold or not pred:
        return 0.0
    # math-verify's own timeouts use SIGALRM (main thread only); the sandbox enforces ours instead.
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
