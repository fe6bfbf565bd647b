"""An LLM judge over an OpenAI-compatible API: a real vLLM server this test starts serves a tiny random chat model."""

import pytest

from amir_lightning.helpers.serving import post_json
from amir_lightning.models import TinyModel
from amir_lightning.rewards import JudgeReward, JudgeServer
from amir_lightning.rewards.base import RewardInputs


def test_the_score_is_the_last_number_of_the_reply_on_the_judges_scale():
    judge = JudgeReward(url="http://unused:1", max_score=10)
    assert judge.parse("Good reasoning, 7 steps. Score: 8") == 0.8
    assert judge.parse("12 out of 10!") == 1.0 and judge.parse("-3") == 0.0  # clipped to the scale
    assert judge.parse("no score here") is None
    tagged = JudgeReward(url="http://unused:1", pattern=r"<score>(\d+)</score>", max_score=5)
    assert tagged.parse("3 errors found. <score>4</score> (out of 5)") == 0.8
    assert judge.messages("2+2?", "4", "4")[-1]["content"].count("4") >= 2  # completion and reference filled in


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({}, "needs exactly one of url \\(a running server\\) and serve"),
        ({"url": "http://h:1", "template": "{question} {reply}"}, "template names reply: it may use"),
        ({"url": "http://h:1", "pattern": "("}, "pattern is not a regular expression"),
        ({"url": "http://h:1", "max_score": 0}, "data.rewards: judge.max_score must be > 0, got 0"),
    ],
)
def test_bad_judge_settings_name_their_key(given, message):
    with pytest.raises(ValueError, match=message):
        JudgeReward(**given)


@pytest.mark.slow
def test_a_judge_served_here_grades_each_completion_as_its_own_reply_says(tmp_path):
    """The judge's server starts at ``setup`` and stops at ``close``; each completion's score is the parse of the
    reply the same request gets straight from the server (temperature 0), whatever the number of requests in flight,
    and the question, the completion and the reference reach the request."""
    serve = JudgeServer(
        model=TinyModel(alphabet="0123456789", seed=11, cache_dir=str(tmp_path)),
        threads=1,
        max_model_len=128,
        kv_cache_memory_bytes=32 * 1024**2,
    )
    judge = JudgeReward(serve=serve, template="{question}{completion}{answer}", max_score=9, max_tokens=3)
    judge.setup()
    try:
        from amir_lightning.data.base import Prompt

        prompts = [Prompt(question=f"{i}", answer=f"{i}") for i in range(12)]
        completions = [f"{i * 7 % 10}{i % 3}" for i in range(12)]
        inputs = RewardInputs(completions, prompts, [[1]] * 12, ["stop"] * 12)
        scores = judge(inputs)
        judge.concurrency = 1
        assert judge(inputs) == scores
        for prompt, completion, score in zip(prompts, completions, scores):
            asked = [{"role": "user", "content": prompt.question + completion + prompt.answer}]
            body = {"model": judge.model, "max_tokens": 3, "temperature": 0.0, "messages": asked}
            reply = post_json(judge.url, "/v1/chat/completions", body, 60, "judge", None)
            assert score == judge.parse(reply["choices"][0]["message"]["content"])
        assert judge.model == "judge" and len({s for s in scores if s is not None}) > 1
        process = judge.server.process
    finally:
        judge.close()
    assert process.poll() is not None


def test_a_judge_url_that_does_not_answer_is_one_line_naming_it():
    from amir_lightning.helpers.serving import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    judge = JudgeReward(url=url, timeout_s=5)
    with pytest.raises(ValueError, match=f"data.rewards: judge.url {url} did not answer /v1/models"):
        judge.setup()


def test_bad_judge_server_settings_name_their_key():
    with pytest.raises(ValueError, match="data.rewards: judge.serve.max_model_len must be >= 1, got 0"):
        JudgeServer(model="unused", max_model_len=0)
