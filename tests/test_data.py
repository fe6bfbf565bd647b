"""Prompt sources on small local fixtures: JSONL (GSM8K and generic), HF datasets from local files, generators."""

import json
import re
from pathlib import Path

import pytest

from amir_lightning.data import (
    ArithmeticPrompts,
    DataFileError,
    HFDatasetPrompts,
    JsonlPrompts,
    ReasoningGymPrompts,
    render_prompt,
)
from amir_lightning.data.base import Prompt
from amir_lightning.data.stream import PromptStream
from amir_lightning.models import build_char_tokenizer
from amir_lightning.rewards.grading import grade_answer, reference_answer

FIXTURES = Path(__file__).parent / "fixtures"


def test_jsonl_gsm8k_format():
    source = JsonlPrompts(str(FIXTURES / "gsm8k_sample.jsonl"))
    assert len(source) == 8
    first = source[0]
    assert first.question.startswith("Natalia sold clips")
    assert reference_answer(first.answer) == "72"
    assert first.meta["source"].endswith("gsm8k_sample.jsonl:1")


def test_jsonl_generic_format_skips_blank_lines():
    source = JsonlPrompts(str(FIXTURES / "generic.jsonl"))
    assert [p.answer for p in source.items] == ["5", "6", "\\frac{1}{2}"]
    assert source[2].meta["source"].endswith("generic.jsonl:4")  # line numbers count the blank line


def test_jsonl_malformed_line_names_file_and_line():
    with pytest.raises(DataFileError, match=r"malformed\.jsonl:2: not valid JSON"):
        JsonlPrompts(str(FIXTURES / "malformed.jsonl"))


def test_jsonl_missing_field_and_empty_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n" + json.dumps({"question": "b"}) + "\n")
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: missing field 'answer'"):
        JsonlPrompts(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataFileError, match="no prompts"):
        JsonlPrompts(str(empty))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        JsonlPrompts(str(tmp_path / "missing.jsonl"))


def test_hf_datasets_from_local_files(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(5)))
    source = HFDatasetPrompts("json", data_files=str(path), split="train")
    assert len(source) == 5 and source[3].question == "3 + 1 = ?" and source[3].answer == "4"
    with pytest.raises(DataFileError, match="missing column"):
        HFDatasetPrompts("json", data_files=str(path), question_key="question", answer_key="answer")


def test_arithmetic_splits_are_disjoint_and_answers_right():
    train = ArithmeticPrompts(max_value=12, heldout_fraction=0.45, order="enumerate")
    heldout = ArithmeticPrompts(max_value=12, split="heldout", heldout_fraction=0.45, order="enumerate")
    assert len(train) + len(heldout) == 13 * 13
    assert not set(train.listing) & set(heldout.listing)
    sampled = {ArithmeticPrompts(max_value=12, heldout_fraction=0.45, seed=3)[i].meta["expression"] for i in range(500)}
    assert sampled <= set(train.listing)
    mixed = ArithmeticPrompts(num_terms=3, operators="+-*", split="all")
    for i in range(50):
        p = mixed[i]
        assert int(p.answer) == eval(p.meta["expression"])  # noqa: S307 (test oracle on digits and + - *)
        assert p.question == f"What is {p.meta['expression']}?"


def test_the_seed_sets_which_prompts_a_random_source_serves_unless_shuffle_is_off():
    """``data.seed`` reaches a generator's draw: seeds train on different prompts; seed 0 and ``shuffle: false``
    serve the source from index 0; a stream put back at a position continues with the same prompts."""
    source = ArithmeticPrompts(num_terms=3, max_value=99)

    def questions(seed, shuffle=True, start=0, count=12):
        stream = PromptStream(source, shuffle=shuffle, seed=seed)
        stream.position = start
        return [p.question for p in stream.take(count)]

    from_start = [source[i].question for i in range(12)]
    assert questions(0) == from_start
    assert questions(7, shuffle=False) == from_start
    drawn = [questions(seed) for seed in range(4)]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(drawn) for b in drawn[i + 1 :])
    assert questions(3, start=5, count=7) == drawn[3][5:]


def test_reasoning_gym_prompts_are_gradable():
    source = ReasoningGymPrompts("chain_sum", size=4, seed=1)
    p = source[0]
    assert p.question and grade_answer(f"The answer is {p.answer}.", p.answer) == 1.0


def test_render_prompt_applies_chat_template_and_system_prompt():
    tok = build_char_tokenizer()
    p = ArithmeticPrompts(num_terms=1, template="{expression}=", split="all")[0]
    ids = render_prompt(tok, p, "1")
    assert tok.decode(ids) == "1" + p.question


def test_template_braces_other_than_the_placeholder_are_literal():
    """LaTeX in a template (``\\boxed{}``, ``{a}``) is kept as written; only ``{expression}`` is filled."""
    template = "{expression} = ? Put the answer in \\boxed{}, not {a} or {{x}}. Again: {expression}"
    p = ArithmeticPrompts(num_terms=2, template=template, split="all")[0]
    expression = p.question.split(" = ?")[0]
    assert p.question == template.replace("{expression}", expression)
    assert "\\boxed{}" in p.question and "{a}" in p.question and "{{x}}" in p.question
    assert p.question.endswith("Again: " + expression) and "{expression}" not in p.question


def conversational_rows():
    """TRL's conversational format: ``prompt`` as messages, the second row with its own system turn."""
    return [
        {"prompt": [{"role": "user", "content": "3="}], "solution": "3", "level": 1},
        {
            "prompt": [{"role": "system", "content": "9"}, {"role": "user", "content": "4="}],
            "solution": "4",
            "level": 2,
        },
    ]


def test_conversational_jsonl_keeps_messages_and_its_own_system_turn(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in conversational_rows()))
    source = JsonlPrompts(str(path))
    first, second = source[0], source[1]
    assert first.messages == ({"role": "user", "content": "3="},) and first.question == "3=" and first.answer == "3"
    assert second.columns["level"] == 2 and second.columns["solution"] == "4"  # every column rides along
    tok = build_char_tokenizer()
    assert tok.decode(render_prompt(tok, first, "1")) == "13="  # data.system_prompt added
    assert tok.decode(render_prompt(tok, second, "1")) == "94="  # the row's own system turn wins


def test_prompt_only_jsonl_has_no_reference_and_the_math_reward_does_not_apply(tmp_path):
    from amir_lightning.rewards import MathAnswerReward

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "source": "gen"}) + "\n" for i in range(3)))
    source = JsonlPrompts(str(path))
    assert [p.question for p in source.items] == ["0=", "1=", "2="] and all(p.answer == "" for p in source.items)
    assert source[1].columns == {"prompt": "1=", "source": "gen"}
    reward = MathAnswerReward()
    try:
        assert reward.score(["1", "2"], ["", "2"]) == [None, 1.0]
    finally:
        reward.close()


@pytest.mark.parametrize("conversational", [False, True])
def test_local_datasets_folder_in_both_formats(tmp_path, conversational):
    datasets = pytest.importorskip("datasets")
    if conversational:
        rows = conversational_rows()
    else:
        rows = [{"prompt": "3=", "ground_truth": "3", "level": 1}, {"prompt": "4=", "ground_truth": "4", "level": 2}]
    saved, files = tmp_path / "saved", tmp_path / "files"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))
    files.mkdir()
    (files / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for folder in (saved, files):  # written by save_to_disk, and a folder of data files
        source = HFDatasetPrompts(str(folder), split="train")
        assert [p.answer for p in source.items] == ["3", "4"] and source[1].columns["level"] == 2
        assert (source[1].messages is not None) == conversational
        assert source[1].question == "4="


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"text": "3=", "label": "3"},
            "no prompt field one of ['prompt', 'question', 'problem'] (keys: ['label', 'text'])",
        ),
        ({"prompt": [{"role": "robot", "content": "hi"}]}, "message 0 must be {role: system|user|assistant"),
        ({"prompt": [{"role": "system", "content": "be brief"}]}, "field 'prompt' has no user message"),
        ({"prompt": ["3="]}, "field 'prompt' must be text, got a list"),
    ],
)
def test_a_row_in_no_known_format_names_file_line_and_keys(tmp_path, row, message):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataFileError) as err:
        JsonlPrompts(str(path))
    assert "odd.jsonl:1: " in str(err.value) and message in str(err.value)


def test_a_short_reference_is_preferred_to_a_worked_solution(tmp_path):
    """OlympiadBench-like rows hold both: the final answer is the reference, the solution rides along."""
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "solution": ["Two and two make 4."], "final_answer": ["4"]}) + "\n")
    (prompt,) = JsonlPrompts(str(path)).items
    assert prompt.answer == "4" and prompt.columns["solution"] == ["Two and two make 4."]


@pytest.mark.parametrize(
    ("given", "named", "truncates"),
    [
        ({"top_p": 0.9}, "top_p 0.9", True),
        ({"top_k": 20}, "top_k 20", True),
        ({"min_p": 0.05}, "min_p 0.05", True),
        ({"repetition_penalty": 1.1}, "repetition_penalty 1.1", False),
        ({"generation_kwargs": {"logit_bias": {"5": 2.0}}}, "generation_kwargs.logit_bias", False),
        ({"stop": ["</answer>"], "generation_kwargs": {"ignore_eos": False}}, None, False),
        ({}, None, False),
    ],
)
def test_sampling_that_reshapes_the_distribution_says_what_it_does_to_the_log_probs(given, named, truncates, caplog):
    """vLLM's sampling log-probs come from the distribution it samples (truncated, penalised), the trainer's from the
    softmax at the temperature; stop strings and ``ignore_eos`` change nothing a token is drawn from. Truncation
    (top-p/k, min-p) samples p / Z on the kept tokens: the mismatch weight is Z <= 1 on every token, which the
    warning says cannot repair it."""
    from amir_lightning.data import ArithmeticPrompts
    from amir_lightning.engines import HFEngine, SamplingConfig
    from amir_lightning.systems.datamodule import RolloutDataModule

    sampling = SamplingConfig(**given)
    RolloutDataModule(prompts=ArithmeticPrompts(), engine=HFEngine(progress=False), sampling=sampling)
    said = [r.getMessage() for r in caplog.records if "reshapes the distribution" in r.getMessage()]
    assert len(said) == int(named is not None)
    assert all(f"({named})" in m and "sampling_correction: none" in m for m in said)
    kept_mass = "the mismatch weight is the kept mass Z <= 1 on every token: a uniform shrinkage that cannot repair"
    assert [kept_mass in m for m in said] == [truncates] * len(said)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"min_p": 1.0}, "sampling.min_p must be >= 0 and < 1, got 1"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty must be > 0, got 0"),
        ({"stop": "</answer>"}, "sampling.stop must be a list of non-empty strings, got '</answer>'"),
        ({"generation_kwargs": {"n": 4}}, "generation_kwargs.n is not passed through: the rollout sets it"),
        ({"generation_kwargs": {"min_p": 0.1}}, "generation_kwargs.min_p is not passed through: set data.sampling"),
    ],
)
def test_a_bad_sampling_setting_names_its_key(given, message):
    from amir_lightning.engines import SamplingConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingConfig(**given)


def test_chat_template_variables_need_a_template_and_a_template_must_render(tmp_path):
    from amir_lightning.data.templates import ChatFormat, read_template

    tok = build_char_tokenizer("0123456789=+")
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"data.chat_template_kwargs \(enable_thinking\) has nothing to reach"):
        ChatFormat(template_kwargs={"enable_thinking": False}).check(tok)
    ChatFormat().check(tok)  # no template, no variables: the messages' texts
    with pytest.raises(ValueError, match="data.chat_template does not render a prompt: TemplateSyntaxError"):
        ChatFormat(template="{% for m in messages %}").check(tok)
    with pytest.raises(ValueError, match="data.chat_template: 'nothing.jinja' is neither a Jinja template"):
        read_template("nothing.jinja")
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}={% if x %}+{% endif %}")
    chat = ChatFormat(template=read_template(str(tmp_path / "t.jinja")), template_kwargs={"x": True})
    chat.check(tok)
    assert tok.decode(chat.render(tok, Prompt(question="12", answer=""))) == "12=+"


def test_a_stream_leaves_out_excluded_prompts_and_keeps_the_others_order():
    from amir_lightning.data import ArithmeticPrompts

    source = ArithmeticPrompts(split="all", order="enumerate")
    plain = PromptStream(source, shuffle=False)
    kept = PromptStream(source, shuffle=False)
    kept.exclude({1, 3})
    expected = [p for i, p in enumerate(plain.take(8)) if i not in (1, 3)]
    assert kept.take(6) == expected and len(kept) == len(source) - 2
    shuffled = PromptStream(source, shuffle=True, seed=5)
    shuffled.exclude({0})
    assert source[0] not in shuffled.take(len(shuffled))


def test_the_rollout_line_says_how_long_the_run_has_left():
    from amir_lightning.systems.progress import time_left

    assert time_left([100.0], 1, 30) == ""  # one rollout: no pace yet
    assert time_left([100.0, 110.0, 130.0], 3, 30) == "; 15 s per rollout, 7 min left"
    assert time_left([0.0, 3600.0], 2, 1000) == "; 60 min per rollout, 41.6 d left"
    assert time_left([0.0, 5.0], 2, -1) == "; 5 s per rollout"  # no set length


@pytest.mark.parametrize(
    ("build", "module", "message"),
    [
        (lambda: HFDatasetPrompts("gsm8k"), "datasets", "HFDatasetPrompts needs datasets: pip install 'datasets>=3'"),
        (lambda: ReasoningGymPrompts(), "reasoning_gym", "needs reasoning-gym: pip install 'reasoning-gym>=0.1.25'"),
    ],
)
def test_a_missing_extra_names_a_command_that_installs_it_from_anywhere(build, module, message, monkeypatch):
    """The requirement itself (from the package's metadata), which pip installs whether amir-lightning came from a
    clone, a built wheel or an index; the extra's name for those who install by it."""
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    with pytest.raises(ModuleNotFoundError, match=re.escape(message)) as raised:
        build()
    assert "in a clone: pip install -e '.[" in str(raised.value)
