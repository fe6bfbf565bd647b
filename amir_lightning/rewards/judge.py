"""An LLM judge: a chat model behind an OpenAI-compatible endpoint grades each completion, and its reply is parsed.

    rewards:
      - class_path: amir_lightning.rewards.JudgeReward
        init_args:
          url: http://judge-host:8000            # vLLM (`vllm serve`), SGLang, or any OpenAI-compatible server
          model: Qwen/Qwen3-8B
          template: "Question: {question} Reference: {answer} Answer: {completion} Rate it from 0 to 10."

Or let the run start a vLLM server for the judge on devices of its own (``serve``); it ends with the run.

Each completion is one chat request (``/v1/chat/completions``), up to ``concurrency`` in flight; the template is
filled with ``{question}`` (the prompt's last user message), ``{completion}`` and ``{answer}`` (the reference, ``""``
without one). The score is read as people write it (``8/10``, ``Score: 8``, ``9. It is right``: ``judge_parse``),
on the scale ``[0, max_score]``, and divided by ``max_score``. A reply without one is asked again
(``unparsed_retries``), then counts as ``on_unparsed`` says; ``judge/unparsed_frac`` logs how many. A request that
fails is retried ``retries`` times, then the run stops (exit 3) in one line naming the judge, the route and its
answer (``helpers/http.py``).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from typing_extensions import override

from amir_lightning.helpers import serving
from amir_lightning.helpers.http import Endpoint, ServerError, reading, request
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.judge_parse import parse_score, strip_thinking
from amir_lightning.rewards.judge_server import JudgeServer

log = logging.getLogger(__name__)


class _NotAsked(Exception):
    """A request not sent because another of the same ``score`` failed (that one's error is what the run reports)."""


DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{question}\n\nReference answer (may be empty):\n{answer}"
    "\n\nAnswer to grade:\n{completion}\n\nHow correct and helpful is the answer, from 0 (worst) to 10 (best)? "
    "Reply with the number only."
)
#: What the judge is asked after a reply without a score.
RETRY_PROMPT = "Reply with the score only: one number from 0 to {max_score:g}."
#: The judge's chat template arguments by default: a thinking model (Qwen3) would spend ``max_tokens`` thinking.
THINKING_OFF = {"enable_thinking": False}
ON_UNPARSED = ("group_mean", "none", "zero", "error")

__all__ = ["DEFAULT_TEMPLATE", "JudgeReward", "JudgeServer"]


class JudgeReward(Reward):
    """Ask a chat model to grade each completion (an LLM judge) over an OpenAI-compatible API.

    A reply with no score on the scale is asked again ``unparsed_retries`` times (the reply, then ``RETRY_PROMPT``),
    then scored as ``on_unparsed`` says. ``group_mean`` (the default) gives it the mean of the parsed scores of its
    group (the completions of the same prompt), or the scale's midpoint (0.5) where none parsed: GRPO's advantage
    is the score minus the group's mean, so the completion is neither pushed up nor down for the judge's failure,
    and the others keep their order. ``none`` and ``zero`` score it 0 in the total, as the worst answer is scored.

    Args:
        url: The server's address (``http://host:8000``); ``None``: start one with ``serve``.
        model: The model name the server knows the judge by (``None``: the one it serves, asked at start).
        serve: Start a vLLM server for the judge (``JudgeServer``): the first training process starts it, every
            process asks it. It listens on its node only: for training processes on several nodes, start one they
            all reach and give its ``url``.
        template: The user message, with ``{question}``, ``{completion}`` and ``{answer}``.
        system_prompt: A system message before it.
        pattern: Regular expression of a score (its first group, else the match; the last on the scale counts),
            instead of the built-in forms (``judge_parse.parse_score``).
        max_score: The top of the judge's scale; scores are divided by it (rewards in [0, 1]).
        on_unparsed: A reply with no score after the retries: ``group_mean``, ``none`` (the judge does not apply to
            it), ``zero``, or ``error`` (stop the run).
        unparsed_retries: Further asks after a reply with no score.
        chat_template_kwargs: Sent with each request to a vLLM server (``owned_by: vllm`` in ``/v1/models``), whose
            chat template reads them; ``None`` or ``{}``: nothing sent. Default: thinking off.
        max_tokens: Longest reply.
        temperature: The judge's sampling temperature (0: its most likely reply).
        concurrency: Requests in flight at once.
        timeout_s: Seconds one request may take (a judge silent for a minute is said in a line meanwhile).
        retries: Further tries of a request that failed where trying again can help (an error answer, a
            connection reset); a judge that does not answer within ``timeout_s``, or is gone, stops the run.
        api_key_env: Environment variable holding the API key (``OPENAI_API_KEY`` for a hosted endpoint).
        weight: Multiplier in the total reward.
        name: Metric name (default ``judge``).
    """

    concurrent = True  # it waits on the server: the other rewards score meanwhile

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        serve: JudgeServer | None = None,
        template: str = DEFAULT_TEMPLATE,
        system_prompt: str | None = None,
        pattern: str | None = None,
        max_score: float = 10.0,
        on_unparsed: Literal["group_mean", "none", "zero", "error"] = "group_mean",
        unparsed_retries: int = 1,
        chat_template_kwargs: dict | None = THINKING_OFF,
        max_tokens: int = 16,
        temperature: float = 0.0,
        concurrency: int = 32,
        timeout_s: float = 300.0,
        retries: int = 2,
        api_key_env: str | None = None,
        weight: float = 1.0,
        name: str | None = None,
    ) -> None:
        super().__init__(weight, name)
        key = f"data.rewards: {self.name}"
        errors: list[str] = []
        if (url is None) == (serve is None):
            errors.append(f"{key} needs exactly one of url (a running server) and serve (one this run starts)")
        try:
            self.pattern = re.compile(pattern) if pattern is not None else None
        except re.error as err:
            errors.append(f"{key}.pattern is not a regular expression: {err}")
        _check_choices(errors, key, template, on_unparsed, chat_template_kwargs)
        check_number(errors, f"{key}.max_score", max_score, gt=0)
        check_number(errors, f"{key}.unparsed_retries", unparsed_retries, ge=0)
        check_number(errors, f"{key}.max_tokens", max_tokens, ge=1)
        check_number(errors, f"{key}.temperature", temperature, ge=0)
        check_number(errors, f"{key}.concurrency", concurrency, ge=1)
        check_number(errors, f"{key}.timeout_s", timeout_s, gt=0)
        check_number(errors, f"{key}.retries", retries, ge=0)
        raise_errors(errors)
        self.url, self.model, self.serve = url.rstrip("/") if url else None, model, serve
        self.template, self.system_prompt, self.max_score = template, system_prompt, max_score
        self.on_unparsed, self.unparsed_retries = on_unparsed, unparsed_retries
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_tokens, self.temperature, self.concurrency = max_tokens, temperature, concurrency
        self.timeout_s, self.retries, self.api_key_env = timeout_s, retries, api_key_env
        self.server: serving.ServerProcess | None = None
        self.on_vllm: bool | None = None  # whether the server is vLLM (it takes chat_template_kwargs); asked at setup
        self.unparsed, self._metrics = 0, {}

    def setup(self) -> None:
        """Start the judge's server (``serve``; the first training process does), learn the model and the server."""
        from amir_lightning.helpers.distributed import from_rank_zero

        if self.serve is not None and self.url is None:
            self.url = from_rank_zero(self._launch)
            if self.server is None:  # another process started it: wait for it here too
                key = f"data.rewards: {self.name}.serve.startup_timeout"
                serving.wait_for(self.endpoint, self.serve.startup_timeout, key, refused_s=None)
        if self.model is None or self.on_vllm is None:
            answer = self._request("/v1/models", None, "GET")
            with reading(self.endpoint, "/v1/models", answer):
                served = [(m["id"], m.get("owned_by")) for m in answer.get("data") or []]
            if self.model is None and not served:
                raise ValueError(f"data.rewards: {self.name}.url {self.url} lists no model at /v1/models: set model")
            self.model = self.model or served[0][0]
            self.on_vllm = any(owner == "vllm" for _, owner in served)

    @property
    def endpoint(self) -> Endpoint:
        """The judge's server, and how its failures are named."""
        what = f"the judge's vLLM server ({self.name})" if self.serve is not None else f"the judge ({self.name})"
        absent = (f"start one (vllm serve MODEL), or give data.rewards: {self.name}.serve instead of url to let the "
                  "run start one")  # fmt: skip
        return Endpoint(self.url, what, f"data.rewards: {self.name}.url", "an OpenAI-compatible chat server (vLLM, "
                        "SGLang, a hosted API)", absent, self.server, self._headers())  # fmt: skip

    def _request(self, route: str, body: dict | None, method: str = "POST") -> dict:
        return request(self.endpoint, route, body, deadline_s=self.timeout_s,
                       deadline_key=f"data.rewards: {self.name}.timeout_s", method=method)  # fmt: skip

    def _launch(self) -> str:
        import torch

        port = serving.free_port("127.0.0.1")
        url = serving.reachable_url("127.0.0.1", port)
        log_path = Path(tempfile.mkdtemp(prefix="amir_judge_")) / "server.log"
        command = self.serve.command(port, torch.cuda.is_available())
        what = f"the judge's vLLM server ({self.name})"
        self.server = serving.ServerProcess(command, self.serve.env(), url, log_path, what)
        self.server.wait_until_ready(self.serve.startup_timeout, f"data.rewards: {self.name}.serve.startup_timeout")
        return url

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def messages(self, question: str, completion: str, answer: str) -> list[dict[str, str]]:
        """The chat request for one completion."""
        user = self.template.format(question=question, completion=completion, answer=answer)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def parse(self, reply: str) -> float | None:
        """The score in ``reply`` in [0, 1] (``None``: no score on the scale found)."""
        value = parse_score(reply, self.max_score, self.pattern)
        return None if value is None else value / self.max_score

    def request_body(self, messages: list[dict[str, str]]) -> dict:
        """The JSON body of the chat request; ``chat_template_kwargs`` only to a vLLM server (others refuse it)."""
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}  # fmt: skip
        if self.chat_template_kwargs and self.on_vllm:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body

    def ask(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply to one request (retried ``retries`` times)."""
        body = self.request_body(messages)
        route = "/v1/chat/completions"
        for attempt in range(self.retries + 1):
            try:
                answer = self._request(route, body)
                with reading(self.endpoint, route, answer):
                    return answer["choices"][0]["message"]["content"] or ""
            except ServerError as err:
                if attempt == self.retries or not err.transient:  # a server gone or silent is not asked again
                    raise
                time.sleep(min(2.0**attempt, 30.0))
        raise AssertionError("unreachable")

    def judge(self, messages: list[dict[str, str]]) -> tuple[float | None, str, int]:
        """The score of one request in [0, 1] (``None``: none after the retries), the last reply and the asks."""
        reply = self.ask(messages)
        for asks in range(1, self.unparsed_retries + 2):
            score = self.parse(reply)
            if score is not None or asks > self.unparsed_retries:
                return score, reply, asks
            said = {"role": "assistant", "content": strip_thinking(reply) or ""}
            again = {"role": "user", "content": RETRY_PROMPT.format(max_score=self.max_score)}
            reply = self.ask([*messages, said, again])
        raise AssertionError("unreachable")

    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float | None]:
        """The judge's grade of each completion, in [0, 1]."""
        if self.url is None or self.model is None or self.on_vllm is None:
            self.setup()
        questions = [p if isinstance(p, str) else _last_user(p) for p in kwargs["prompts"]]
        requests = [self.messages(q, c, a) for q, c, a in zip(questions, completions, answers)]
        failed = threading.Event()

        def judge(messages: list[dict[str, str]]) -> tuple[float | None, str, int]:
            if failed.is_set():  # the run stops on the first error: the requests not yet sent are not sent
                raise _NotAsked
            try:
                return self.judge(messages)
            except BaseException:
                failed.set()
                raise

        # Without the stop, a silent judge held the run for timeout_s once per `concurrency` completions.
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests)) or 1) as pool:
            judged = list(pool.map(judge, requests))
        scores = [s for s, _, _ in judged]
        missing = [i for i, s in enumerate(scores) if s is None]
        count = max(len(scores), 1)
        self._metrics = {"unparsed_frac": len(missing) / count, "retried_frac": sum(a > 1 for *_, a in judged) / count}
        if not missing:
            return scores
        self.unparsed += len(missing)
        first = judged[missing[0]][1][:200]
        if self.on_unparsed == "error":
            raise ValueError(f"the judge's reply to completion {missing[0]} has no score on its scale (0 to "
                             f"{self.max_score:g}): {first!r} (data.rewards: {self.name}.on_unparsed)")  # fmt: skip
        log.warning("%s: %d of %d replies had no score (%s), e.g. %r", self.name, len(missing), len(scores),
                    self.on_unparsed, first)  # fmt: skip
        if self.on_unparsed == "group_mean":
            return _group_mean(scores, list(zip(kwargs["prompts"], answers)))
        return [0.0 if s is None and self.on_unparsed == "zero" else s for s in scores]

    def metrics(self) -> dict[str, float]:
        """Of the last ``score``: ``unparsed_frac`` (replies with no score after the retries), ``retried_frac``."""
        return dict(self._metrics)

    @override
    def close(self) -> None:
        if self.serve is not None:  # a server this run started (here or in another process) is gone after the run
            if self.server is not None:
                self.server.close()
            self.server = self.url = None


def _check_choices(errors: list[str], key: str, template: str, on_unparsed: str, kwargs: dict | None) -> None:
    """Add to ``errors`` what is wrong with the judge's template, ``on_unparsed`` and ``chat_template_kwargs``."""
    unknown = sorted(set(re.findall(r"{(\w*)}", template)) - {"question", "completion", "answer"})
    if unknown:
        errors.append(f"{key}.template names {', '.join(unknown)}: it may use {{question}}, {{completion}}, {{answer}}")
    if on_unparsed not in ON_UNPARSED:
        errors.append(f"{key}.on_unparsed must be one of {', '.join(ON_UNPARSED)}, got {on_unparsed!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        errors.append(f"{key}.chat_template_kwargs must be a mapping or null, got {kwargs!r}")


def _group_mean(scores: list[float | None], groups: list) -> list[float]:
    """``None`` scores replaced by the mean of the others of their group (a run of equal ``groups``), else 0.5."""
    out = list(scores)
    for _, run in itertools.groupby(range(len(scores)), key=lambda i: groups[i]):
        run = list(run)
        parsed = [scores[i] for i in run if scores[i] is not None]
        for i in run:
            if out[i] is None:
                out[i] = statistics.fmean(parsed) if parsed else 0.5
    return out


def _last_user(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
