r"""A labelled grading set: completions in the formats models write, each with the label a careful human gives.

Every case is ``(format, completion, reference, label)``. The generated part writes each answer format around a
correct and a wrong final answer for several references (so the label is known by construction); the hand-written
part holds the cases a grader gets wrong by accident: right number mentioned earlier, hedges, truncation, reasoning
without an answer, symbolic answers, tuples. ``tests/test_grading_set.py`` requires agreement on all of them.
"""

# (reference as a dataset gives it, the answer written correctly, a wrong answer, a unit word)
VALUES = [
    ("Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n#### 18", "18", "16", "dollars"),
    ("#### 72", "72", "27", "clips"),
    ("#### 1234", "1,234", "1,243", "apples"),
    ("#### 5", "5", "6", "hours"),
    ("0.5", "0.5", "0.25", "liters"),
    ("#### -12", "-12", "12", "degrees"),
    ("#### 2.5", "2.50", "2.05", "miles"),
    ("#### 360", "360", "36", "minutes"),
    ("#### 100000", "100,000", "10,000", "people"),
    ("#### 7", "7", "8", "cookies"),
]

# (format name, template with {a} for the written answer and {u} for the unit word)
TEMPLATES = [
    ("think+answer+boxed", "<think>\nLet me compute step by step.\n</think>\n<answer>\n\\boxed{{{a}}}\n</answer>"),
    ("answer tag", "<think>First add, then subtract.</think>\n<answer>{a}</answer>"),
    ("answer tag, trailing period", "<think>ok</think><answer>{a}.</answer>"),
    ("answer tag, unit", "<think>ok</think><answer>{a} {u}</answer>"),
    ("answer tag, bold", "<think>ok</think>\n<answer>**{a}**</answer>"),
    ("answer tag, sentence", "<think>ok</think>\n<answer>The answer is {a}.</answer>"),
    ("answer tag, math mode", "<think>ok</think><answer>${a}$</answer>"),
    ("answer tag, variable", "<think>ok</think><answer>x = {a}</answer>"),
    ("boxed in prose", "We combine the two parts, which gives a total of \\boxed{{{a}}}."),
    ("boxed with text unit", "Therefore the result is $\\boxed{{{a} \\text{{ {u}}}}}$."),
    ("gsm8k hashes", "She has 3 + 4 = 7 left over, so the total is computed below.\n#### {a}"),
    ("prose, answer is", "Adding everything up, the answer is {a}."),
    ("prose, final answer colon", "Step 1: 3 + 4 = 7.\nStep 2: multiply.\nFinal answer: {a}"),
    ("prose, last number", "We subtract what was spent and are left with {a} {u}."),
    ("markdown bold prose", "**Answer:** **{a}**"),
    ("unclosed answer tag (truncated after the answer)", "<think>done</think>\n<answer>{a}"),
]


def generated() -> list[tuple[str, str, str, float]]:
    cases = []
    for reference, right, wrong, unit in VALUES:
        for name, template in TEMPLATES:
            cases.append((name, template.format(a=right, u=unit), reference, 1.0))
            cases.append((name, template.format(a=wrong, u=unit), reference, 0.0))
    return cases


HAND_WRITTEN = [
    # currency, percent, degrees, decimals written differently
    ("currency in tag", "<think>4 * 4.5 = 18</think><answer>$18</answer>", "#### 18", 1.0),
    ("currency with cents", "<answer>$18.00</answer>", "#### 18", 1.0),
    ("escaped dollar in box", "So Janet makes \\boxed{\\$18} every day.", "#### 18", 1.0),
    ("percent", "<answer>25%</answer>", "#### 25", 1.0),
    ("escaped percent in box", "The increase is \\boxed{25\\%}.", "#### 25", 1.0),
    ("percent, wrong", "<answer>20%</answer>", "#### 25", 0.0),
    ("degrees", "The angle is \\boxed{90^\\circ}.", "90", 1.0),
    ("trailing zeros", "<answer>2.500</answer>", "2.5", 1.0),
    ("decimal vs integer", "\\boxed{18.0}", "#### 18", 1.0),
    # fractions and decimals
    ("fraction vs decimal", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("decimal vs fraction", "<answer>0.75</answer>", "\\frac{3}{4}", 1.0),
    ("slash fraction", "<answer>3/4</answer>", "0.75", 1.0),
    ("dfrac", "The probability is $\\boxed{\\dfrac{2}{3}}$.", "\\frac{2}{3}", 1.0),
    ("fraction, wrong", "\\boxed{\\frac{2}{3}}", "\\frac{3}{4}", 0.0),
    ("fraction with unit", "<answer>3/4 cup</answer>", "\\frac{3}{4}", 1.0),
    ("rounded decimal is not exact", "\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    # negative numbers
    ("unicode minus", "<answer>−7</answer>", "-7", 1.0),
    ("negative in box", "\\boxed{-7}", "#### -7", 1.0),
    ("sign lost", "\\boxed{7}", "#### -7", 0.0),
    ("negative with unit", "<answer>-5 degrees</answer>", "-5", 1.0),
    # thousands separators and lists
    ("thousands separator in prose", "In total they collected 12,500 stamps.", "#### 12500", 1.0),
    ("thousands separator in hashes", "#### 1,000,000", "1000000", 1.0),
    ("list is not a thousands number", "\\boxed{1,2}", "12", 0.0),
    ("list reference stays a list", "\\boxed{1, 2}", "1,2", 1.0),
    ("wrong grouping is not a separator", "<answer>12,34</answer>", "1234", 0.0),
    # tuples and intervals
    ("tuple", "The intersection point is \\boxed{(2, -3)}.", "(2,-3)", 1.0),
    ("tuple, swapped", "\\boxed{(-3, 2)}", "(2,-3)", 0.0),
    ("interval", "\\boxed{[0, 1)}", "[0,1)", 1.0),
    # symbolic answers
    ("square root", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("pi", "\\boxed{2\\pi}", "2\\pi", 1.0),
    ("pi approximated", "\\boxed{6.28}", "2\\pi", 0.0),
    ("polynomial", "\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("polynomial, wrong constant", "\\boxed{x^2 + 18}", "18", 0.0),
    ("equation answer", "\\boxed{x = 4}", "4", 1.0),
    # the right number mentioned earlier, then a wrong final answer
    ("right number earlier, boxed", "At first I got 18, but that double counts. \\boxed{20}", "#### 18", 0.0),
    ("right number earlier, tag", "<think>18? No: 16 + 4 = 20.</think><answer>20</answer>", "#### 18", 0.0),
    ("right number earlier, prose", "It is not 18. Recounting, the answer is 20.", "#### 18", 0.0),
    ("right number in reasoning of tag", "<answer>20 eggs, which is 2 more than 18</answer>", "#### 18", 0.0),
    ("wrong then corrected", "I thought it was 17, but recounting, the answer is 18.", "#### 18", 1.0),
    ("two boxes, last counts", "\\boxed{17} is a typo; the result is \\boxed{18}.", "#### 18", 1.0),
    ("two boxes, last wrong", "\\boxed{18} was a guess; the result is \\boxed{17}.", "#### 18", 0.0),
    ("self-correction in tag", "<answer>Maybe 17... no, 18</answer>", "#### 18", 1.0),
    # sentences with several numbers: the one the sentence commits to
    ("sentence, answer then means", "<answer>Janet makes $18 every day by selling 9 eggs.</answer>", "#### 18", 1.0),
    ("sentence, answer then remainder", "<answer>She has 18 eggs left after using 4.</answer>", "#### 18", 1.0),
    ("sentence, which-clause", "<answer>The total is 20, which is 2 more than 18.</answer>", "#### 18", 0.0),
    (
        "sentence, so-conclusion",
        "<answer>She sells 9 eggs at $2 each, so she makes 18 dollars.</answer>",
        "#### 18",
        1.0,
    ),
    ("sentence, equation with unit", "<answer>9 * 2 = 18 dollars</answer>", "#### 18", 1.0),
    ("sentence, but-correction", "<answer>I thought it was 17, but it's 18.</answer>", "#### 18", 1.0),
    ("sentence, since-clause", "<answer>She makes 16 dollars, since 18 - 2 = 16.</answer>", "#### 18", 0.0),
    ("sentence, leading clause", "<answer>After 2 weeks she has 18 dollars.</answer>", "#### 18", 1.0),
    ("sentence, per person", "<answer>Each of the 4 friends gets 18 cookies.</answer>", "#### 18", 1.0),
    ("sentence, out of", "<answer>Each friend gets 18 cookies out of 72.</answer>", "#### 18", 1.0),
    (
        "sentence, wrong with the right number as context",
        "<answer>Out of 18 eggs, 9 are sold.</answer>",
        "#### 18",
        0.0,
    ),
    # hedges commit to nothing
    ("hedge in tag", "<answer>18 or 20</answer>", "#### 18", 0.0),
    ("hedge in box", "\\boxed{18 \\text{ or } 20}", "#### 18", 0.0),
    ("either", "<answer>either 18 or 19</answer>", "#### 18", 0.0),
    # empty, missing, truncated
    ("empty tag", "<think>hmm</think><answer></answer>", "#### 18", 0.0),
    ("no answer at all", "I am not sure how to solve this problem.", "#### 18", 0.0),
    ("answer is a word", "<answer>unknown</answer>", "#### 18", 0.0),
    ("truncated inside thinking", "<think>\nFirst 16 - 3 = 13, then 13 - 4 = 9, then 9 * 2 = 18", "#### 18", 0.0),
    ("thinking only, no answer", "<think>9 * 2 = 18</think>", "#### 18", 0.0),
    ("answer after thinking, no tag", "<think>9 * 2 = 18</think>\nSo she makes 18 dollars.", "#### 18", 1.0),
    ("empty completion", "", "#### 18", 0.0),
    ("empty box", "\\boxed{}", "#### 18", 0.0),
    # whitespace, newlines, case
    ("spaces and newlines in tag", "<answer>\n\n   18   \n</answer>", "#### 18", 1.0),
    ("word answer", "<answer>Yes</answer>", "yes", 1.0),
    ("word answer, wrong", "<answer>No</answer>", "yes", 0.0),
    # the official prompt's exact format, correct and wrong
    (
        "official format",
        "<think>\nJanet's ducks lay 16 eggs. She eats 3 and bakes with 4, leaving 9. At $2 each: 9 * 2 = 18.\n"
        "</think>\n<answer>\n\\boxed{18}\n</answer>",
        "#### 18",
        1.0,
    ),
    (
        "official format, wrong",
        "<think>\n16 - 3 = 13, 13 * 2 = 26.\n</think>\n<answer>\n\\boxed{26}\n</answer>",
        "#### 18",
        0.0,
    ),
]


def cases() -> list[tuple[str, str, str, float]]:
    return generated() + HAND_WRITTEN
