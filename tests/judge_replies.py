"""Judge replies as judges write them on a 0-10 scale, each with the score a person reads in it (``None``: none).

``tests/test_judge.py`` requires ``judge_parse.parse_score`` to read every one; ``benchmarks/judge_parse.py`` counts
how many the parser of an older commit reads.
"""

MAX_SCORE = 10

REPLIES = [
    ("8", 8),
    ("8/10", 8),
    ("8 out of 10", 8),
    ("Score: 8 out of 10", 8),
    ("Score: 8", 8),
    ("Rating: 7 (scale 0-10)", 7),
    ("**Score:** 8", 8),
    ("score = 8.5", 8.5),
    ("7.5", 7.5),
    ("**8**", 8),
    ('{"score": 6}', 6),
    ("10/10", 10),
    ("0", 0),
    ("9. It correctly computes 37 * 8 = 296.", 9),
    ("9 - correct", 9),
    ("I would give it a 9. It correctly computes 37 * 8 = 296.", 9),
    ("Score: 9/10. The steps 12 + 30 = 42 are right.", 9),
    ("The answer has 3 errors and 296 is wrong. Score: 2", 2),
    ("Final score: 6. The answer lists 3 steps.", 6),
    ("8/10\n\nRight, but it does not show that 37 * 8 = 296.", 8),
    ("The answer computes 37 * 8 = 296, which matches the reference.\n\n10", 10),
    ("I rate this answer 7.", 7),
    ("I give the answer a 6 of 10.", 6),
    ("Score: 9\n\nThe answer gives 5 reasons.", 9),
    ("<think>The answer says 37 * 8 = 296, which is right.</think>\n\n9", 9),
    ("The answer says 37 * 8 = 296, which is right.\n</think>\n\n9", 9),  # the template opened the thinking
    ("<think>The answer says 37 * 8 = 296, so", None),  # thinking cut off by max_tokens
    ("12/10", None),  # off the scale
    ("-3", None),
    ("The answer is correct and well explained.", None),
    ("I cannot grade this answer.", None),
    ("Score: N/A", None),
    ("Grade: B+", None),
]
