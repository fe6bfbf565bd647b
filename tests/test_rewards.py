"""Rewards: answer extraction, math-verify equality, the sandbox timeout, and the format rewards."""

import time

import pytest

from amir_lightning.rewards import MathAnswerReward, SandboxedGrader, TagCountReward, ThinkAnswerFormatReward
from amir_lightning.rewards.grading import extract_answer, grade_answer


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{x^{2}}", "x^{2}"),  # last box, nested braces
        ("<think>7?</think><answer> 42 </answer>", "42"),
        ("<answer>\\boxed{3}</answer> and then 5", "3"),
        ("blah #### 1,234", "1,234"),
        ("3 + 4 = 7.", "7"),
        ("no digits here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_extract_without_number_fallback():
    assert extract_answer("3 + 4 = 7.", fallback_last_number=False) is None


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The total is 72.", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("\\boxed{2^{10}}", "1024", 1.0),
        ("\\boxed{71}", "#### 72", 0.0),
        ("I don't know", "5", 0.0),
    ],
)
def test_grade_answer(completion, answer, score):
    assert grade_answer(completion, answer) == score


@pytest.mark.slow
def test_pathological_answer_times_out_to_zero_within_the_limit():
    reward = MathAnswerReward(timeout_s=1.0)
    try:
        reward.correctness(["\\boxed{1}"], ["1"])  # workers up before timing
        start = time.monotonic()
        scores = reward.correctness(["\\boxed{9999999^{9999999}}", "\\boxed{7}"], ["7", "7"])
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0]
        assert reward.grader.timeouts == 1  # the timeout fired
        assert elapsed < 60  # not the hours sympy would take (a busy machine may take several seconds to restart)
    finally:
        reward.close()


def _crash(_):
    raise RuntimeError("grader bug")


@pytest.mark.slow
def test_sandbox_survives_a_crashing_grader():
    grader = SandboxedGrader(timeout_s=5.0, timeout_score=-1.0)
    try:
        assert grader.map(_crash, [(1,), (2,)]) == [-1.0, -1.0]
    finally:
        grader.close()


def _allocate(megabytes):
    return float(len(bytearray(megabytes * 1024 * 1024)) > 0)


@pytest.mark.slow
def test_the_memory_cap_counts_from_what_a_started_worker_holds():
    """A worker that already maps more than ``memory_mb`` (its interpreter, torch, sympy: a CUDA torch alone maps
    gigabytes) still starts; an answer that allocates past the cap scores ``timeout_score``, one under it grades."""
    grader = SandboxedGrader(timeout_s=20.0, num_workers=1, memory_mb=64, timeout_score=-1.0)
    try:
        assert grader.map(_allocate, [(8,), (512,), (8,)]) == [1.0, -1.0, 1.0]
    finally:
        grader.close()


def test_format_rewards():
    good = "<think>4 and 3</think>\n<answer>\\boxed{7}</answer>"
    assert ThinkAnswerFormatReward().score([good, good + "\ntrailing", "7"], ["7"] * 3) == [0.5, 0.0, 0.0]
    assert TagCountReward().score([good, "<think><think>"], ["7"] * 2) == [pytest.approx(0.1), 0.0]
    assert MathAnswerReward().name == "math_answer" and TagCountReward().name == "tag_count"


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "expected"), [("short", [1.0, 0.0, 0.0, 0.0]), ("long", [0.0, 1.0, 0.0, 0.0])])
def test_length_controlled_answer_reward_applies_its_length_rule_to_right_answers(rule, expected):
    from amir_lightning.rewards import LengthControlledAnswerReward

    reward = LengthControlledAnswerReward(threshold_tokens=3, correct_when=rule)
    try:
        completions = ["7", "xx7", "8", "xx8"]  # right short, right long, wrong short, wrong long
        ids = [[1, 0], [2, 2, 1, 0], [3, 0], [2, 2, 3, 0]]  # token counts 2, 4, 2, 4 (end token included)
        assert reward.score(completions, ["7"] * 4, completion_ids=ids) == expected
        assert reward.allowed(3) == (rule == "short") and reward.allowed(4) == (rule == "long")
        with pytest.raises(ValueError, match="completion_ids"):
            reward.score(completions, ["7"] * 4)
    finally:
        reward.close()
    with pytest.raises(ValueError, match="threshold_tokens must be >= 1"):
        LengthControlledAnswerReward(threshold_tokens=0)


@pytest.mark.parametrize(
    ("cores", "env", "expected"),
    [
        (2, {}, 1),  # this machine: one worker, one core left to the trainer
        (32, {}, 8),  # capped
        (32, {"LOCAL_WORLD_SIZE": "8"}, 3),  # torchrun, 8 processes on the node: 4 cores each, less one
        (96, {"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8),
        (16, {"SLURM_NTASKS_PER_NODE": "4(x2)"}, 3),
        (8, {"LOCAL_WORLD_SIZE": "8"}, 1),  # never none
    ],
)
def test_grading_workers_default_to_the_process_share_of_the_cores(cores, env, expected, monkeypatch):
    from amir_lightning.rewards import sandbox

    monkeypatch.setattr(sandbox.os, "sched_getaffinity", lambda pid: set(range(cores)))
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert sandbox.default_workers() == expected
    grader = SandboxedGrader()
    assert grader.num_workers is None  # decided when the first answer is graded, in the launched process


SCRIPT = """
import sys
import torch  # what a training script imports at its top, as the `amir` console script imports the whole CLI

from amir_lightning.rewards import SandboxedGrader
from probe import loaded

with open("runs.log", "a") as log:
    log.write("top level\\n")


def here(name):
    return 1.0


if __name__ == "__main__":
    grader = SandboxedGrader(timeout_s=20.0, num_workers=1)
    try:
        print("loaded", grader.map(loaded, [("torch",), ("math_verify",), ("probe",)]))
        try:
            grader.map(here, [("x",)])
        except ValueError as err:
            print("refused", err)
    finally:
        grader.close()
"""


@pytest.mark.slow
def test_a_grading_worker_imports_neither_torch_nor_the_script_that_runs_it(tmp_path):
    """A worker imports the grading function's module, math-verify and the sandbox, nothing more: the script that
    runs the grader (``amir``'s console script imports the whole CLI) runs once, and torch is not imported in the
    worker. The function's module is found where the script finds it. A function of the script itself is refused
    with the reason."""
    import subprocess
    import sys

    (tmp_path / "probe.py").write_text("import sys\n\n\ndef loaded(name):\n    return float(name in sys.modules)\n")
    (tmp_path / "train.py").write_text(SCRIPT)
    result = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded [0.0, 1.0, 1.0]" in result.stdout, result.stdout
    assert (tmp_path / "runs.log").read_text() == "top level\n"
    assert "refused here is defined in the script being run" in result.stdout


@pytest.mark.slow
def test_a_grading_function_a_worker_cannot_import_is_named():
    """A function whose module exists only in the trainer's process (made at run time) stops the grading with its
    name, not a timeout score for every answer."""
    import sys
    import types

    module = types.ModuleType("made_at_run_time")
    exec("def grade(x):\n    return 1.0\n", module.__dict__)
    module.grade.__module__ = module.__name__
    sys.modules[module.__name__] = module
    grader = SandboxedGrader(timeout_s=20.0, num_workers=1)
    try:
        with pytest.raises(RuntimeError, match=r"cannot load made_at_run_time\.grade \(ModuleNotFoundError"):
            grader.map(module.grade, [(1,)])
    finally:
        grader.close()
        del sys.modules[module.__name__]
