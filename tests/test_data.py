"""Prompt sources on small local fixtures: JSONL (GSM8K and generic), HF datasets from local files, generators."""

import json
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


def test_reasoning_gym_prompts_are_gradable():
    source = ReasoningGymPrompts("chain_sum", size=4, seed=1)
    p = source[0]
    assert p.question and grade_answer(f"The answer is {p.answer}.", p.answer) == 1.0


def test_render_prompt_applies_chat_template_and_system_prompt():
    tok = build_char_tokenizer()
    p = ArithmeticPrompts(num_terms=1, template="{expression}=", split="all")[0]
    ids = render_prompt(tok, p, system_prompt="1")
    assert tok.decode(ids) == "1" + p.question


def test_template_braces_other_than_the_placeholder_are_literal():
    """LaTeX in a template (``\\boxed{}``, ``{a}``) is kept as written; only ``{expression}`` is filled."""
    template = "{expression} = ? Put the answer in \\boxed{}, not {a} or {{x}}. Again: {expression}"
    p = ArithmeticPrompts(num_terms=2, template=template, split="all")[0]
    expression = p.question.split(" = ?")[0]
    assert p.question == template.replace("{expression}", expression)
    assert "\\boxed{}" in p.question and "{a}" in p.question and "{{x}}" in p.question
    assert p.question.endswith("Again: " + expression) and "{expression}" not in p.question
