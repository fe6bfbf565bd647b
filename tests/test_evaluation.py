"""Evaluation: unbiased pass@k, the benchmark loaders on local fixtures, and the comparison report."""

import json
import math
from pathlib import Path

import pytest
import torch

from amir_lightning.evaluation import PRESETS, BenchmarkPrompts, PassAtK, pass_at_k
from amir_lightning.evaluation.compare import compare, coverage, problem_margins
from amir_lightning.rewards.grading import grade_answer

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"


def direct(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(pass_at_k(n, c, k), direct(n, c, k), abs_tol=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    """c = 0 never passes; c = n always does; pass@1 is the fraction correct; n < k is refused."""
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 8, 1) == 1.0 and math.isclose(pass_at_k(8, 3, 1), 3 / 8)
    assert pass_at_k(8, 5, 4) == 1.0  # fewer than 4 wrong samples: any 4 contain a correct one
    with pytest.raises(ValueError, match="pass@4 needs at least 4 samples"):
        pass_at_k(2, 1, 4)
    with pytest.raises(ValueError, match="correct"):
        pass_at_k(4, 5, 1)


def test_pass_at_k_metric_averages_problems():
    """Counts [0, 2, 8] of 8: pass@2 = (0 + (1 - C(6,2)/C(8,2)) + 1) / 3 = (0 + 13/28 + 1) / 3."""
    metric = PassAtK([1, 2])
    metric.update(torch.tensor([0, 2]), 8)
    metric.update(torch.tensor([8]), 8)
    result = metric.compute()
    assert math.isclose(float(result[1]), (0 + 2 / 8 + 1) / 3)
    assert math.isclose(float(result[2]), (0 + 13 / 28 + 1) / 3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_benchmark_fixture_loads_and_grades(name):
    source = BenchmarkPrompts(name, path=str(FIXTURES / f"{name}.jsonl"))
    p = source[0]
    assert p.question and p.answer and p.meta["benchmark"] == name
    assert grade_answer(f"The answer is \\boxed{{{p.answer}}}", p.answer) == 1.0


def test_benchmark_specific_answers():
    assert BenchmarkPrompts("gsm8k", path=str(FIXTURES / "gsm8k.jsonl"))[1].answer.endswith("#### 24")
    aqua = BenchmarkPrompts("aqua_rat", path=str(FIXTURES / "aqua_rat.jsonl"))[0]
    assert aqua.answer == "$4" and "Options: A)$2" in aqua.question
    assert BenchmarkPrompts("livemathbench", path=str(FIXTURES / "livemathbench.jsonl"))[0].answer == "2"
    assert BenchmarkPrompts("olympiadbench", path=str(FIXTURES / "olympiadbench.jsonl"))[0].answer == "$9$"
    assert grade_answer("so 10", BenchmarkPrompts("amc23", path=str(FIXTURES / "amc23.jsonl"))[0].answer) == 1.0


def test_benchmark_errors():
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        BenchmarkPrompts("gsm9k")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        BenchmarkPrompts("gsm8k", path="missing.jsonl")


def report(correct, logps):
    problems = [
        {"index": i, "question": "q", "answer": "a", "correct": c, "lengths": [1] * len(c), "mean_logp": lp}
        for i, (c, lp) in enumerate(zip(correct, logps))
    ]
    return {"benchmark": "b", "samples": 2, "temperature": 0.6, "pass@k": {"1": 0.5}, "problems": problems}


def test_coverage_and_margins_hand_computed(tmp_path):
    """Run A solves problems 0 and 1, run B solves 1 and 2; problem 3 is solved by neither.

    Coverage over the 3 problems solved by any run: A only 1, both 1, B only 1, neither 0.
    Margin of A on problem 0 (samples [1, 0], logps [-0.5, -1.0]) = 0.5; problem 1 ([1, 1]) has no margin.
    """
    a = report([[1, 0], [1, 1], [0, 0], [0, 0]], [[-0.5, -1.0], [-1, -1], [-2, -2], [-1, -1]])
    b = report([[0, 0], [0, 1], [1, 0], [0, 0]], [[-1, -1], [-0.2, -0.4], [-0.3, -0.1], [-1, -1]])
    total, rows = coverage([a, b])
    assert total == 3 and dict(rows) == {(True, True): 1, (True, False): 1, (False, True): 1, (False, False): 0}
    assert problem_margins(a) == [0.5]
    assert [round(m, 6) for m in problem_margins(b)] == [-0.2, -0.2]
    for name, payload in (("A", a), ("B", b)):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "eval" / "b.json").write_text(json.dumps(payload))
    out = compare([tmp_path / "A", tmp_path / "B"], ["A", "B"], tmp_path / "cmp")
    text = out.read_text()
    assert "| ✓ | ✗ | 33.3 % | 1 |" in text and (tmp_path / "cmp" / "margins_b.png").stat().st_size > 1000
