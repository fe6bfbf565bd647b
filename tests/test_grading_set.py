"""The grader against the labelled set of tests/grading_cases.py: it must agree with the human label on every case."""

from collections import Counter

from grading_cases import cases

from amir_lightning.rewards import MathAnswerReward


def test_grader_agrees_with_every_human_label():
    labelled = cases()
    formats = Counter(name for name, *_ in labelled)
    assert len(labelled) >= 200 and len(formats) >= 60
    assert {label for *_, label in labelled} == {0.0, 1.0}
    reward = MathAnswerReward(num_workers=1)  # the sandboxed grader training uses
    try:
        grades = reward.correctness([c for _, c, _, _ in labelled], [r for _, _, r, _ in labelled])
    finally:
        reward.close()
    wrong = [(name, c, r, label) for (name, c, r, label), g in zip(labelled, grades) if g != label]
    assert not wrong, f"{len(wrong)} of {len(labelled)} disagree, e.g. {wrong[:5]}"
