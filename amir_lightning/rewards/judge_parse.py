"""Reading a judge's score from its reply, the way people write scores: ``8/10``, ``Score: 8``, ``9. It is right``.

A reply often quotes the numbers of the question or of the answer (``37 * 8 = 296``), so the score is not "the last
number": it is the number the reply presents as a score, on the judge's scale ``[0, max_score]``.
"""

from __future__ import annotations

import re

_NUMBER = r"(-?\d+(?:\.\d+)?)"
#: A score named as one: "Score: 8", "**Score:** 8", "score = 8.5", '{"score": 8}', "Rating: 7 (scale 0-10)"; or
#: given to the answer: "I would give it a 9", "I rate this answer 7" (not "the answer gives 5 reasons").
_LABELLED = re.compile(
    r"(?:\b(?:score[sd]?|rating|rated|grade[sd]?)\b(?:\s+(?:is|of|as|at))?"
    r"|\b(?:give[sn]?|rate[sd]?|grade[sd]?|score[sd]?)\s+(?:it|this|that|the)(?:\s+(?:answer|response|reply))?"
    r"(?:\s+(?:an?|as|at))?)[\s:=*#\"']*" + _NUMBER,
    re.IGNORECASE,
)
#: A line that is a number and nothing else: "8", "**8**", "7.5.".
_LONE = re.compile(r"^[\s*#]*" + _NUMBER + r"[\s*.]*$", re.MULTILINE)
#: The reply's first word is a number not starting a sum: "9. It computes 37 * 8 = 296", "9 - correct".
_LEADING = re.compile(r"^[\s*#]*" + _NUMBER + r"(?![\d.]*\s*[-+*/x×=^]\s*\d)")


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

    The forms are tried in order, and the first that holds a number on the scale gives the score (its last such
    number: a reply ends with its verdict): ``a/max_score`` or ``a out of max_score``; a labelled score; a line that
    is only a number; the leading number. A number off the scale is never a score (``12/10``, ``296``, ``-3``).

    Args:
        reply: The judge's reply, thinking included.
        max_score: The top of the scale.
        pattern: A regular expression of the score instead (its first group, else its match).

    Returns:
        The score, or ``None``.
    """
    text = strip_thinking(reply)
    if text is None:
        return None
    top = re.escape(f"{max_score:g}") + (r"(?:\.0+)?" if float(max_score).is_integer() else "")
    out_of = re.compile(_NUMBER + r"\s*(?:/|out of)\s*" + top + r"(?![\d.]*\d)", re.IGNORECASE)
    forms = [pattern] if pattern is not None else [out_of, _LABELLED, _LONE, _LEADING]
    for form in forms:
        values = [float(m.group(1) if m.groups() else m.group(0)) for m in form.finditer(text)]
        on_scale = [v for v in values if 0 <= v <= max_score]
        if on_scale:
            return on_scale[-1]
    return None
