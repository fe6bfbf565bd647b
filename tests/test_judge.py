"""An LLM judge over an OpenAI-compatible API: its replies read as people write scores; a real vLLM server this test
starts serves a tiny random chat model, and a local chat server (tests/helpers/chat_server.py) replies what a test
needs."""

import math

import pytest
from helpers.chat_server import ChatServer
from judge_replies import MAX_SCORE, REPLIES

from amir_lightning.engines.base import Completion
from amir_lightning.helpers.http import ServerError
from amir_lightning.loop.rewarding import score_completions
from amir_lightning.models import TinyModel
from amir_lightning.rewards import JudgeReward, JudgeServer
from amir_lightning.rewards.inputs import RewardInputs
from amir_lightning.rewards.judge import RETRY_PROMPT


@pytest.mark.parametrize(("reply", "expected"), REPLIES, ids=[r[:40] for r, _ in REPLIES])
def test_the_score_is_the_one_the_reply_gives_on_the_judges_scale(reply, expected):
    judge = JudgeReward(url="http://unused:1", max_score=MAX_SCORE)
    got = judge.parse(reply)
    assert got == (None if expected is None else pytest.approx(expected / MAX_SCORE)), reply


def test_a_pattern_of_ones_own_replaces_the_forms_and_the_scale_still_holds():
    tagged = JudgeReward(url="http://unused:1", pattern=r"<score>(\d+)</score>", max_score=5)
    assert tagged.parse("3 errors found. <score>4</score> (out of 5)") == 0.8
    assert tagged.parse("<score>4</score> then <score>7</score>") == 0.8  # 7 is off the 0-5 scale
    assert tagged.parse("Score: 4") is None
    judge = JudgeReward(url="http://unused:1", max_score=4)
    assert judge.parse("3/4") == 0.75 and judge.parse("2.5/4.0") == 0.625
    assert judge.parse("8/10") == 0.8 and judge.parse("12/10") is None  # read on the scale it states, when on it
    assert judge.messages("2+2?", "4", "4")[-1]["content"].count("4") >= 2  # completion and reference filled in


def test_a_decimal_on_a_scale_of_0_to_1_is_the_score_as_written():
    """On a 0-1 judge a decimal is a point of its own scale, 1.0 its top: only a scale above 1 reads 0.8 as a
    fraction of it, and leaves 1.0 (either end) to be asked again."""
    judge = JudgeReward(url="http://unused:1", max_score=1)
    assert [judge.parse(r) for r in ("Score: 0.8", "Score: 1.0", "0.75", "8/10")] == [0.8, 1.0, 0.75, 0.8]


def _completions(texts_per_prompt: list[list[str]]) -> list[list[Completion]]:
    return [[Completion([1], text, [-0.1], "stop") for text in texts] for texts in texts_per_prompt]


def _prompts(count: int):
    from amir_lightning.data.base import Prompt

    return [Prompt(question=f"question {i}", answer=f"{i}") for i in range(count)]


def _rows(texts: str) -> tuple:
    """``RewardInputs`` arguments of one group of completions ``texts`` (a character each)."""
    return list(texts), _prompts(1) * len(texts), [[1]] * len(texts), ["stop"] * len(texts)


def test_a_reply_without_a_score_is_asked_again_then_gets_its_groups_mean_and_the_share_is_logged():
    """Completion ``a`` scores 8, ``b`` 4, ``c`` never (the judge answers prose, and prose again when asked again),
    ``d`` after the second ask. ``c`` gets the mean of its group's parsed scores, or 0.5 in a group where none
    parsed: never the 0 of the worst answer. ``judge/unparsed_frac`` counts the replies with no score."""

    def reply(body):
        asked_again = body["messages"][-1]["content"] == RETRY_PROMPT.format(max_score=10)
        first = body["messages"][0]["content"]
        return {"a": "Score: 8", "b": "4/10", "c": "A fine answer.", "d": "7" if asked_again else "Looks right."}[first]

    with ChatServer(reply) as server:
        judge = JudgeReward(url=server.url, template="{completion}", unparsed_retries=1)
        completions = _completions([list("abc"), ["c"] * 3, list("dd")])
        total, metrics, _, _ = score_completions([judge], _prompts(3), completions)
        assert total.tolist() == pytest.approx([0.8, 0.4, 0.6, 0.5, 0.5, 0.5, 0.7, 0.7])
        assert metrics["judge/unparsed_frac"] == pytest.approx(4 / 8)
        assert metrics["judge/retried_frac"] == pytest.approx(6 / 8)  # c four times, d twice
        again = [b["messages"] for b in server.bodies if b["messages"][0]["content"] == "d" and len(b["messages"]) > 1]
        assert again[0][1:] == [{"role": "assistant", "content": "Looks right."},
                                {"role": "user", "content": RETRY_PROMPT.format(max_score=10)}]  # fmt: skip
        asks = len(server.bodies)
        once = JudgeReward(url=server.url, template="{completion}", unparsed_retries=0, on_unparsed="zero")
        inputs = RewardInputs(list("ad"), _prompts(2), [[1]] * 2, ["stop"] * 2)
        assert once(inputs) == [0.8, 0.0] and len(server.bodies) == asks + 2  # asked once each
        assert once.metrics() == {"unparsed_frac": 0.5, "retried_frac": 0.0}
        left_out = JudgeReward(url=server.url, template="{completion}", on_unparsed="none")
        assert left_out(RewardInputs(*_rows("ac"))) == [0.8, None]
        with pytest.raises(ValueError, match=r"has no score on its scale .*judge\.on_unparsed"):
            JudgeReward(url=server.url, template="{completion}", on_unparsed="error")(RewardInputs(*_rows("ac")))


@pytest.mark.parametrize(
    ("owned_by", "given", "sent"),
    [
        ("vllm", {}, {"enable_thinking": False}),  # the default
        ("vllm", {"chat_template_kwargs": {"enable_thinking": True, "x": 1}}, {"enable_thinking": True, "x": 1}),
        ("vllm", {"chat_template_kwargs": None}, None),
        ("vllm", {"chat_template_kwargs": {}}, None),
        ("openai", {}, None),  # a server that is not vLLM refuses the key (the local server too: HTTP 400)
    ],
)
def test_chat_template_kwargs_go_to_a_vllm_server_only(owned_by, given, sent):
    with ChatServer(lambda body: "<think>It is right.</think>9", owned_by) as server:
        judge = JudgeReward(url=server.url, **given)
        assert judge(RewardInputs(["4"], _prompts(1), [[1]], ["stop"])) == [0.9]
        assert [b.get("chat_template_kwargs") for b in server.bodies] == [sent]
        assert judge.model == "judge" and judge.on_vllm == (owned_by == "vllm")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({}, "needs exactly one of url \\(a running server\\) and serve"),
        ({"url": "http://h:1", "template": "{question} {reply}"}, "template names reply: it may use"),
        ({"url": "http://h:1", "pattern": "("}, "pattern is not a regular expression"),
        ({"url": "http://h:1", "max_score": 0}, "data.rewards: judge.max_score must be > 0, got 0"),
        ({"url": "http://h:1", "on_unparsed": "mean"}, "judge.on_unparsed must be one of group_mean, none, zero"),
        ({"url": "http://h:1", "unparsed_retries": -1}, "judge.unparsed_retries must be >= 0, got -1"),
        ({"url": "http://h:1", "chat_template_kwargs": "off"}, "judge.chat_template_kwargs must be a mapping"),
    ],
)
def test_bad_judge_settings_name_their_key(given, message):
    with pytest.raises(ValueError, match=message):
        JudgeReward(**given)


def _judge_model_that_shows_thinking_off(tmp_path) -> str:
    """The tiny judge's model directory, its chat template writing ``0`` first when thinking is off."""
    import shutil

    built = TinyModel(alphabet="0123456789", seed=11, cache_dir=str(tmp_path)).resolve()
    path = tmp_path / "judge"
    shutil.copytree(built, path)
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").write_text("{% if enable_thinking is defined and not enable_thinking %}0{% endif %}"
                                              + template)  # fmt: skip
    return str(path)


@pytest.mark.slow
def test_a_judge_served_here_grades_each_completion_as_its_own_reply_says(tmp_path):
    """The judge's server starts at ``setup`` and stops at ``close``; each completion's score is the parse of the
    reply the same request gets straight from the server (temperature 0), whatever the number of requests in flight,
    and the question, the completion and the reference reach the request. The server is vLLM, so the requests turn
    thinking off, and its chat template sees it (one more prompt token)."""
    serve = JudgeServer(
        model=_judge_model_that_shows_thinking_off(tmp_path),
        threads=1,
        max_model_len=128,
        kv_cache_memory_bytes=32 * 1024**2,
    )
    judge = JudgeReward(serve=serve, template="{question}{completion}{answer}", max_score=9, max_tokens=1,
                        unparsed_retries=0, on_unparsed="none")  # fmt: skip
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
            body = judge.request_body([{"role": "user", "content": prompt.question + completion + prompt.answer}])
            reply = judge._request("/v1/chat/completions", body)
            assert score == judge.parse(reply["choices"][0]["message"]["content"])
        assert judge.on_vllm and body["chat_template_kwargs"] == {"enable_thinking": False}
        thinking = judge._request("/v1/chat/completions", body | {"chat_template_kwargs": {}})
        assert reply["usage"]["prompt_tokens"] == thinking["usage"]["prompt_tokens"] + 1
        assert judge.model == "judge" and len({s for s in scores if s is not None}) > 1
        assert not any(math.isnan(s) for s in scores if s is not None)
        process = judge.server.process
    finally:
        judge.close()
    assert process.poll() is not None


def test_a_judge_url_that_does_not_answer_is_one_line_naming_it():
    from amir_lightning.helpers.serving import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    judge = JudgeReward(url=url, timeout_s=5)
    with pytest.raises(ServerError, match=f"no server at {url} \\(connection refused at /v1/models\\)"):
        judge.setup()


def test_bad_judge_server_settings_name_their_key():
    with pytest.raises(ValueError, match="data.rewards: judge.serve.max_model_len must be >= 1, got 0"):
        JudgeServer(model="unused", max_model_len=0)
