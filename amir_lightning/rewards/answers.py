r"""Finding the final answer a completion commits to, the way a careful human grader reads it.

Where the answer is (the first rule that matches wins):
1. the last ``\boxed{...}`` (brace-matched, nested braces allowed);
2. the content of the last ``<answer>...</answer>`` (or what follows a last, unclosed ``<answer>``), or a box in it;
3. what follows the last ``#### `` (GSM8K style);
4. optionally (``fallback_last_number``) what follows the last "answer is" / "answer:" of the text, else its last
   number; text inside ``<think>`` is reasoning, not an answer, so only what follows the last ``</think>`` counts.

What the answer is (``committed``): the region cleaned of presentation a grader ignores (markdown emphasis, ``$``
and ``\$``, ``\text{units}``, ``%``, degrees, trailing punctuation, a leading "The answer is" or ``x =``). When
that still holds words (``18 eggs``, ``she makes $18 by selling 9 eggs``), the answer is the number the sentence
commits to (``committed``'s docstring).
"""

from __future__ import annotations

import re

#: A number as people write it: thousands separators only in groups of three, decimals, simple fractions, signs.
NUMBER = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:\s*/\s*\d+)?|\.\d+)")
_LATEX_FRACTION = re.compile(r"-?\\[dt]?frac\{\s*-?\d+\s*\}\{\s*\d+\s*\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_STATED = re.compile(r"answer\s*(?:is|:|=|would be|will be)\s*", re.IGNORECASE)
_LEAD_IN = re.compile(
    r"^(?:(?:so|thus|therefore|hence)[,\s]+)?(?:the\s+)?(?:final\s+)?(?:answer|result|total)\s*(?:is|:|=)?\s*",
    re.IGNORECASE,
)
_VARIABLE = re.compile(r"^[A-Za-z]\s*=\s*(?=\S)")
_UNIT_TEXT = re.compile(r"\\(?:text|mbox|mathrm|textrm|operatorname)\s*\{([^{}]*)\}")
_BOLD = re.compile(r"\\(?:textbf|mathbf|boldsymbol|bm)\s*\{([^{}]*)\}")
_WORD = re.compile(r"[A-Za-z]{2,}")
_HEDGE = re.compile(r"\bor\b|\beither\b", re.IGNORECASE)
_CONCLUSION = re.compile(
    r",?\s*\b(?:but|actually|instead|wait|so|therefore|thus|hence)\b|\bno\s*,|=|\.\.\.", re.IGNORECASE
)
_SUBORDINATE = re.compile(
    r",?\s*\b(?:which|since|because|after|by|from|when|while|as|given|if|compared|out of)\b|\(", re.IGNORECASE
)
_COMMAND = re.compile(r"\\[A-Za-z]+")
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


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
    """The region of ``text`` that holds its final answer, as written, or ``None`` (module docstring)."""
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
    if not fallback_last_number:
        return None
    if _THINK_OPEN in text:  # reasoning is not an answer: only what follows the last </think> counts
        close_at = text.rfind(_THINK_CLOSE)
        text = text[close_at + len(_THINK_CLOSE) :] if close_at >= 0 else ""
    stated = list(_STATED.finditer(text))
    if stated:
        tail = text[stated[-1].end() :].split("\n", 1)[0]
        if NUMBER.search(tail) or _LATEX_FRACTION.search(tail):
            return tail.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def clean(answer: str) -> str:
    r"""``answer`` without the presentation a grader ignores: ``**18**.``, ``\$18``, ``18\%``, ``x = 18`` -> ``18``."""
    text = _BOLD.sub(r"\1", answer)
    text = _UNIT_TEXT.sub(lambda m: "" if _WORD.search(m.group(1)) else m.group(1), text)
    for mark in ("\\$", "$", "\\(", "\\)", "\\[", "\\]", "**", "__", "`", "\\%", "%", "^\\circ", "^{\\circ}", "°"):
        text = text.replace(mark, "")
    text = text.replace("\\!", "").replace("\\,", "").replace("−", "-")
    text = text.strip().strip("*_").strip()
    text = _LEAD_IN.sub("", text)
    text = _VARIABLE.sub("", text)
    return text.strip().rstrip(".,;:!?").strip()


def committed(answer: str) -> str:
    """The answer a grader reads in the region: the cleaned text, or its committed number when words remain.

    Words (``18 eggs``, ``she makes $18 by selling 9 eggs``) are not mathematics, so the committed number is read
    as a person reads the sentence: what follows the last conclusion (``so``, ``but``, ``no,``, ``=``); there, a
    leading number, else the last number of the main clause (before ``which``, ``since``, ``by``, ``after``...).
    Text with no number stays as it is; a hedge between different numbers (``18 or 20``) commits to none.
    """
    main = clean(answer)
    if not _WORD.search(_COMMAND.sub("", main)):  # no prose beyond LaTeX commands and one-letter variables
        return normalise_number(main)
    numbers = _numbers(main)
    if not numbers:
        return main
    if _HEDGE.search(main) and len({normalise_number(n) for _, n in numbers}) > 1:
        return ""  # "18 or 20" commits to neither
    tail = next((p for p in reversed(_CONCLUSION.split(main)) if _numbers(p)), main).strip()
    numbers = _numbers(tail)
    if numbers[0][0] == 0:
        return normalise_number(numbers[0][1])
    clause = _numbers(_SUBORDINATE.split(tail, maxsplit=1)[0]) or numbers
    return normalise_number(clause[-1][1])


def _numbers(text: str) -> list[tuple[int, str]]:
    r"""``(start, text)`` of every number in ``text``, ``\frac{a}{b}`` counted once."""
    fractions = list(_LATEX_FRACTION.finditer(text))
    spans = [range(f.start(), f.end()) for f in fractions]
    plain = [m for m in NUMBER.finditer(text) if not any(m.start() in span for span in spans)]
    return sorted((m.start(), m.group()) for m in [*fractions, *plain])


def normalise_number(number: str) -> str:
    """``1,234`` -> ``1234`` (real thousands separators only), unicode minus -> ``-``."""
    number = number.replace("−", "-").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", number):
        number = number.replace(",", "")
    return number


def reference_answer(answer: str) -> str:
    """A dataset answer as a grader reads it: GSM8K's ``... #### 1,234`` is ``1234``; ``1,2`` stays a list."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return normalise_number(clean(answer))
