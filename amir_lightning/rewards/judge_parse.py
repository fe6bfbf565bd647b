"""Reading a judge's score from its reply, the way people write scores: ``8/10``, ``Score: 8``, ``9. It is right``.

A reply often quotes the numbers of the question or of the answer (``37 * 8 = 296``) and counts things in its
reasoning (``it solved 1 of 2 parts``), so the score is not "the last number": it is the number the reply presents
as a score, read on the scale the reply states (``3 out of 5``, ``85%``) or else on the judge's ``[0, max_score]``.
"""

from __future__ import annotations

import re

_NUMBER = r"(?P<value>-?\d+(?:\.\d+)?)"
#: The scale a reply may state after its score: "3 out of 5", "4/5", "6 of 10", "85%", "(scale 0-5)", "on a scale
#: of 1 to 5".
_STATED_SCALE = (
    r"(?:\s*(?:/|\bout of\b|\bof\b)\s*(?P<scale>\d+(?:\.\d+)?)|\s*(?P<percent>%)"
    r"|\s*\(?(?:on\s+)?(?:an?\s+)?scale\s+(?:of\s+|from\s+)?(?P<low>\d+)\s*(?:-|–|to)\s*(?P<high>\d+(?:\.\d+)?))?"
)
#: Marks around a number: markdown emphasis and code (``**2**``, ``__2__``, `` `2` ``), headings, MT-Bench's ``[[7]]``.
_OPEN, _CLOSE = r"[\s*#_`\[]*", r"[\s*_`\].]*"
#: A score named as one: "Score: 8", "**Score:** 8", "score = 8.5", '{"score": 8}', "Final verdict: **2**",
#: "Rating: [[7]]"; or given to the answer: "I would give it a 9", "I rate this answer 7" (not "the answer gives 5
#: reasons").
_LABELLED = re.compile(
    r"(?:\b(?:score[sd]?|rating|rated|grade[sd]?|verdict)\b(?:\s+(?:is|of|as|at))?"
    r"|\b(?:give[sn]?|rate[sd]?|grade[sd]?|score[sd]?)\s+(?:it|this|that|the)(?:\s+(?:answer|response|reply))?"
    r"(?:\s+(?:an?|as|at))?)[\s:=*#\"'_`\[]*" + _NUMBER + _STATED_SCALE,
    re.IGNORECASE,
)
#: A line that is a number and nothing else: "8", "**8**", "7.5.", "4/5".
_LONE = re.compile(r"^" + _OPEN + _NUMBER + _STATED_SCALE + _CLOSE + r"$", re.MULTILINE)
#: The reply's first word is a number not starting a sum: "9. It computes 37 * 8 = 296", "9 - correct".
_LEADING = re.compile(r"^" + _OPEN + _NUMBER + _STATED_SCALE + r"(?![\d.]*\s*[-+*/x×=^]\s*\d)")
#: A word that may follow a score with its scale ("8/10 points", "4 out of 5 because ..."); any other word names what
#: a count counts ("1 of 2 parts", "8 out of 10 test cases", "3/4 of the steps"), which is no score.
_AFTER_A_SCORE = frozenset(
    "points point pts marks stars star possible total overall here then now only also "
    "because since as for and but so or if when while though although despite given due considering based "
    "with on in at by from to into after before except "
    "is was are be would should could might may will seems looks "
    "it this that which the a an".split()
)
_NEXT_WORD = re.compile(r"\s*([a-z][a-z-]*)")
_NO_SCORE = object()  # a match that is no score (a count, off its scale); ``None`` is one that cannot be told (1.0)


def strip_thinking(reply: str) -> str | None:
    """The reply without its ``<think>...</think>`` reasoning; ``None`` when the thinking never ended (truncated).

    Everything up to the last ``</think>`` goes: a chat template may open the thinking in the prompt, so the reply
    holds only its end.
    """
    if "</think>" in reply:
        return reply.rsplit("</think>", 1)[1]
    return None if "<think>" in reply else reply


def parse_score(reply: str, max_score: float, pattern: re.Pattern | None = None) -> float | None:
    """The score of ``reply`` on the scale ``[0, max_score]``, not normalised; ``None``: the reply gives none.

    The forms are tried in order, and the first that holds a score gives it (its last one: a reply ends with its
    verdict): ``a/max_score`` or ``a out of max_score``; a labelled score (``Score: 8``, ``Final verdict: **2**``);
    a line that is only a number; the leading number. A number is read as follows:

    - On the scale the reply states with it, moved onto the judge's: ``Rating: 3 out of 5`` is 6 of 10, ``85%`` is
      8.5 of 10, ``4 on a scale of 1 to 5`` is 7.5 of 10 (1, the scale's worst, is 0). A number followed by its
      scale and a word that is not a score's (``1 of 2 parts``, ``8 out of 10 test cases``, ``3/4 of the steps``)
      is a count, never a score.
    - A decimal in ``[0, 1]`` on a scale whose top is above 1, with no scale stated (``Score: 0.8`` on 0-10), is a
      judge grading in fractions (judges often answer 0-1 whatever the prompt asked; one grading 0-10 in whole or
      half points does not write 0.8), read as that fraction of the scale (8). ``1.0`` could be either end of the
      scale (1 of 10 or all of it), so it is no score: the reply is asked again (``unparsed_retries``), and the
      question names the scale. ``0.5/10`` states its scale and is 0.5.
    - A number off the scale is never a score (``12/10``, ``296``, ``-3``).

    Args:
        reply: The judge's reply, thinking included.
        max_score: The top of the scale.
        pattern: A regular expression of the score instead of the forms (its first group, else its match): its
            last number on ``[0, max_score]``, taken as written.

    Returns:
        The score, or ``None``.
    """
    text = strip_thinking(reply)
    if text is None:
        return None
    if pattern is not None:
        values = [float(m.group(1) if m.groups() else m.group(0)) for m in pattern.finditer(text)]
        on_scale = [v for v in values if 0 <= v <= max_score]
        return on_scale[-1] if on_scale else None
    top = re.escape(f"{max_score:g}") + (r"(?:\.0+)?" if float(max_score).is_integer() else "")
    out_of = re.compile(_NUMBER + r"\s*(?:/|out of)\s*(?P<scale>" + top + r")(?![\d.]*\d)", re.IGNORECASE)
    for form in (out_of, _LABELLED, _LONE, _LEADING):
        scores = [_read(match, max_score) for match in form.finditer(text)]
        scores = [score for score in scores if score is not _NO_SCORE]
        if scores:
            return scores[-1]
    return None


def _read(match: re.Match, max_score: float) -> float | None | object:
    """The score ``match`` gives on ``[0, max_score]``; ``None`` where it cannot be told; else ``_NO_SCORE``."""
    value, parts = float(match["value"]), match.groupdict()
    if parts.get("high"):
        low, high = float(parts["low"]), float(parts["high"])
        return (value - low) * max_score / (high - low) if low <= value <= high and low < high else _NO_SCORE
    scale = 100.0 if parts.get("percent") else float(parts["scale"]) if parts.get("scale") else None
    if scale is not None:
        if _counts_something(match):
            return _NO_SCORE
        return value * max_score / scale if 0 <= value <= scale and scale > 0 else _NO_SCORE
    if max_score > 1 and "." in match["value"] and 0 <= value <= 1:  # a fraction of the scale
        return None if value == 1 else value * max_score
    return value if 0 <= value <= max_score else _NO_SCORE


def _counts_something(match: re.Match) -> bool:
    """Whether the number and scale of ``match`` are followed by what they count (``1 of 2 parts``)."""
    word = _NEXT_WORD.match(match.string, match.end())
    return word is not None and word.group(1) not in _AFTER_A_SCORE
