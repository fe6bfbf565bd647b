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
    # a count in the reasoning is not the score: it names what it counts ("parts", "test cases")
    ("Score: 3. The answer is half right (it scored 1 of 2 parts).", 3),
    ("8 out of 10 test cases pass. Score: 6", 6),
    ("Rating: 7. The answer scores 2 of 3 rubric items.", 7),
    ("3/4 of the steps are right.", None),
    # a score on the scale the reply states, read on the judge's
    ("Rating: 3 out of 5", 6),
    ("Score: 4/5", 8),
    ("4/5", 8),
    ("I rate the answer 4 out of 5 stars.", 8),
    ("Score: 85%", 8.5),
    ("Score: 0.5/10", 0.5),
    ("Rating: 3 (scale 0-5)", 6),
    ("Score: 4 on a scale of 1 to 5", 7.5),
    # a decimal in [0, 1] on a 0-10 scale: a fraction of it; 1.0 is either end of the scale, so no score
    ("Score: 0.8", 8),
    ("0.75", 7.5),
    ("Score: 0.0", 0),
    ("Score: 1.0", None),
    # markdown or template marks around the number
    ("Final verdict: **2**", 2),
    ("**Verdict:** 8", 8),
    ("Rating: [[7]]", 7),
    ("Final grade: __6__", 6),
    ("Score: `9`", 9),
]
