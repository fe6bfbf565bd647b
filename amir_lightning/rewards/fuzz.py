"""Adversarial completions for the grader: what a policy, or an attacker steering it, may emit.

Used by ``tests/test_grading_fuzz.py`` and ``benchmarks/grading.py``; deterministic for a given seed.
"""

from __future__ import annotations

import random

_TOWERS = [
    "9^9^9^9",
    "9^{9^{9^{9}}}",
    "9**9**9**9",
    "(10^{10})^{10^{10}}",
    "2^{2^{2^{2^{2^{2}}}}}",
    "e^{e^{e^{e}}}",
    "10^{10^{100}}",
    "I^I^I^I",
    "(-1)^{10^{100}}",
]
_SYMPY = [
    "oo",
    "zoo",
    "nan",
    "-oo",
    "Sum(1/n, (n, 1, oo))",
    "integrate(exp(-x**2), (x, -oo, oo))",
    "\\sum_{n=1}^{\\infty} n",
    "\\prod_{k=1}^{10^{9}} k",
    "\\lim_{x \\to 0} \\frac{1}{x}",
    "0/0",
    "1/0",
    "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}^{-1}",
    "\\sqrt{-1}",
    "10000000!",
    "(10^{6})!",
    "\\binom{10^9}{10^8}",
]
_BOMBS = [
    "\\def\\x{\\x\\x}\\x",
    "\\newcommand{\\a}{\\a\\a}\\a",
    "\\csname x\\endcsname",
    "\\input{/etc/passwd}",
    "\\loop\\iftrue\\repeat",
    "\\underbrace{" * 50 + "1" + "}" * 50,
]


def _wrap(rng: random.Random, body: str) -> str:
    style = rng.randrange(5)
    if style == 0:
        return f"The answer is \\boxed{{{body}}}."
    if style == 1:
        return f"<think>work</think><answer>{body}</answer>"
    if style == 2:
        return f"so #### {body}"
    if style == 3:
        return f"<answer>\\boxed{{{body}}}</answer> and then {body}"
    return body


def adversarial_completions(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` (completion, reference answer) pairs across ten families of hostile output."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        family = i % 10
        if family == 0:
            body = rng.choice(_TOWERS)
        elif family == 1:  # deep nesting of braces, parentheses or fractions
            depth = rng.choice([20, 200, 5000])
            opener, closer = rng.choice([("{", "}"), ("(", ")"), ("\\frac{1}{", "}"), ("\\sqrt{", "}")])
            body = opener * depth + "1" + closer * rng.choice([depth, depth // 2, 0])
        elif family == 2:  # megabyte strings
            unit = rng.choice(["9", "\\boxed{", "}", "a", "1+", "<answer>", "#### "])
            body = unit * (1_000_000 // len(unit))
        elif family == 3:  # control characters, lone surrogates, undecodable bytes
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
            body = raw.decode("utf-8", errors="surrogateescape") + "".join(chr(rng.randrange(32)) for _ in range(20))
        elif family == 4:
            body = rng.choice(_BOMBS)
        elif family == 5:
            body = rng.choice(_SYMPY)
        elif family == 6:  # huge numbers
            body = "".join(rng.choice("0123456789") for _ in range(rng.choice([70, 5000, 100_000])))
        elif family == 7:  # random unicode, right-to-left marks, emoji
            body = "".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(rng.randrange(1, 300)))
        elif family == 8:  # malformed markup
            body = rng.choice(
                [
                    "\\boxed{",
                    "\\boxed{}",
                    "<answer>",
                    "</answer><answer>",
                    "\\boxed{\\boxed{\\boxed{",
                    "}}}}",
                    "\\fbox{",
                    "####",
                    "$$$$",
                    "\\(\\)\\[\\]",
                ]
            )
        else:  # well-formed answers, some right, some wrong: grading must still work around the hostile ones
            value = rng.randrange(-1000, 1000)
            body = str(value if rng.random() < 0.5 else value + 1)
            out.append((_wrap(rng, body), str(value)))
            continue
        out.append((_wrap(rng, body), str(rng.randrange(100))))
    return out
