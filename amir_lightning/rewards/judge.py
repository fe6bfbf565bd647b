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
without one). The score is the last number in the reply that ``pattern`` finds, clipped to ``[0, max_score]`` and
divided by ``max_score``; a reply with none counts as ``on_unparsed`` says. A request that fails is retried
``retries`` times, then the run stops naming the judge and its answer.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from amir_lightning.helpers import serving
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.sources import HFModel, ModelSource
from amir_lightning.rewards.base import Reward

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{question}\n\nReference answer (may be empty):\n{answer}"
    "\n\nAnswer to grade:\n{completion}\n\nHow correct and helpful is the answer, from 0 (worst) to 10 (best)? "
    "Reply with the number only."
)


@dataclass
class JudgeServer:
    """A vLLM server this run starts for the judge (``vllm serve`` on devices of its own).

    Attributes:
        model: The judge: a Hugging Face id or directory, or a model source.
        devices: GPUs it runs on (``CUDA_VISIBLE_DEVICES``, e.g. ``"7"``); ``None``: as the environment says.
        cpu_cores: CPU cores it is pinned to (``taskset -c``); ``None``: all.
        threads: Threads of its CPU kernels (``OMP_NUM_THREADS``); ``None``: as the environment says.
        dtype: ``auto`` (``bfloat16`` on GPU, ``float32`` on CPU), or a dtype vLLM knows.
        max_model_len: Longest request + reply, in tokens.
        gpu_memory_utilization: Share of each of its GPUs it may take.
        kv_cache_memory_bytes: KV-cache size (what to set on CPU; 256 MiB there by default).
        tensor_parallel_size: GPUs it spans.
        startup_timeout: Seconds it may take to answer.
    """

    model: str | ModelSource
    devices: str | None = None
    cpu_cores: str | None = None
    threads: int | None = None
    dtype: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        import shutil

        key, errors = "data.rewards: judge.serve", []
        check_number(errors, f"{key}.threads", self.threads, ge=1, optional=True)
        check_number(errors, f"{key}.max_model_len", self.max_model_len, ge=1)
        check_number(errors, f"{key}.gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1)
        check_number(errors, f"{key}.kv_cache_memory_bytes", self.kv_cache_memory_bytes, gt=0, optional=True)
        check_number(errors, f"{key}.tensor_parallel_size", self.tensor_parallel_size, ge=1)
        check_number(errors, f"{key}.startup_timeout", self.startup_timeout, gt=0)
        if self.cpu_cores is not None and shutil.which("taskset") is None:
            errors.append(f"{key}.cpu_cores needs the taskset command (util-linux), which this machine lacks")
        raise_errors(errors)

    def command(self, port: int, on_gpu: bool) -> list[str]:
        """The command line of the server, listening on ``port`` of this machine."""
        import sys

        source = HFModel(self.model) if isinstance(self.model, str) else self.model
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(source.resolve())]
        command += ["--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
        command += [
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
        ]
        command += ["--disable-uvicorn-access-log"]
        if on_gpu:
            command += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            command += ["--enforce-eager", "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes or 256 * 1024**2)]
        if self.kv_cache_memory_bytes and on_gpu:
            command += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        return ["taskset", "-c", self.cpu_cores, *command] if self.cpu_cores is not None else command

    def env(self) -> dict[str, str]:
        """Its environment: not part of the training processes' group, on its own devices and threads."""
        env = {k: v for k, v in os.environ.items() if k not in serving.TRAINER_GROUP}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env


class JudgeReward(Reward):
    """Ask a chat model to grade each completion (an LLM judge) over an OpenAI-compatible API.

    Args:
        url: The server's address (``http://host:8000``); ``None``: start one with ``serve``.
        model: The model name the server knows the judge by (``None``: the one it serves, asked at start).
        serve: Start a vLLM server for the judge (``JudgeServer``): the first training process starts it, every
            process asks it. It listens on its node only: for training processes on several nodes, start one they
            all reach and give its ``url``.
        template: The user message, with ``{question}``, ``{completion}`` and ``{answer}``.
        system_prompt: A system message before it.
        pattern: Regular expression of a score in the reply (its first group, else the match); the last match counts.
        max_score: The top of the judge's scale; scores are divided by it (rewards in [0, 1]).
        on_unparsed: A reply with no score: ``none`` (the judge does not apply to it), ``zero``, or ``error``.
        max_tokens: Longest reply.
        temperature: The judge's sampling temperature (0: its most likely reply).
        concurrency: Requests in flight at once.
        timeout_s: Seconds one request may take.
        retries: Further tries of a request that failed.
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
        pattern: str = r"-?\d+(?:\.\d+)?",
        max_score: float = 10.0,
        on_unparsed: Literal["none", "zero", "error"] = "none",
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
            self.pattern = re.compile(pattern)
        except re.error as err:
            errors.append(f"{key}.pattern is not a regular expression: {err}")
        unknown = sorted(set(re.findall(r"{(\w*)}", template)) - {"question", "completion", "answer"})
        if unknown:
            errors.append(f"{key}.template names {', '.join(unknown)}: it may use {{question}}, {{completion}}, "
                          "{answer}")  # fmt: skip
        if on_unparsed not in ("none", "zero", "error"):
            errors.append(f"{key}.on_unparsed must be none, zero or error, got {on_unparsed!r}")
        check_number(errors, f"{key}.max_score", max_score, gt=0)
        check_number(errors, f"{key}.max_tokens", max_tokens, ge=1)
        check_number(errors, f"{key}.temperature", temperature, ge=0)
        check_number(errors, f"{key}.concurrency", concurrency, ge=1)
        check_number(errors, f"{key}.timeout_s", timeout_s, gt=0)
        check_number(errors, f"{key}.retries", retries, ge=0)
        raise_errors(errors)
        self.url, self.model, self.serve = url.rstrip("/") if url else None, model, serve
        self.template, self.system_prompt, self.max_score, self.on_unparsed = (
            template,
            system_prompt,
            max_score,
            on_unparsed,
        )
        self.max_tokens, self.temperature, self.concurrency = max_tokens, temperature, concurrency
        self.timeout_s, self.retries, self.api_key_env = timeout_s, retries, api_key_env
        self.server: serving.ServerProcess | None = None
        self.unparsed = 0

    def setup(self) -> None:
        """Start the judge's server (``serve``; the first training process does) and learn the model's name."""
        from amir_lightning.helpers.distributed import from_rank_zero

        if self.serve is not None and self.url is None:
            self.url = from_rank_zero(self._launch)
            if self.server is None:  # another process started it: wait for it here too
                key = f"data.rewards: {self.name}.serve.startup_timeout"
                serving.wait_for(self.url, self.serve.startup_timeout, key, "the judge's vLLM server")
        if self.model is None:
            self.model = self._get("/v1/models")["data"][0]["id"]

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

    def _get(self, route: str) -> dict:
        import json
        import urllib.request

        request = urllib.request.Request(f"{self.url}{route}", headers=self._headers())
        try:
            with serving.DIRECT.open(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except (OSError, ValueError) as err:  # URLError and HTTPError are OSErrors; a reply that is not JSON
            raise ValueError(
                f"data.rewards: {self.name}.url {self.url} did not answer {route} as an OpenAI-compatible server "
                f"does: {err}"
            ) from None

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def messages(self, question: str, completion: str, answer: str) -> list[dict[str, str]]:
        """The chat request for one completion."""
        user = self.template.format(question=question, completion=completion, answer=answer)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def parse(self, reply: str) -> float | None:
        """The score in ``reply`` in [0, 1] (``None``: no score found)."""
        found = list(self.pattern.finditer(reply))
        if not found:
            return None
        last = found[-1]
        value = float(last.group(1) if last.groups() else last.group(0))
        return min(max(value, 0.0), self.max_score) / self.max_score

    def ask(self, messages: list[dict[str, str]]) -> str:
        """The judge's reply to one request (retried ``retries`` times)."""
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}  # fmt: skip
        for attempt in range(self.retries + 1):
            try:
                answer = serving.post_json(
                    self.url, "/v1/chat/completions", body, self.timeout_s, "the judge", self.server, self._headers()
                )
                return answer["choices"][0]["message"]["content"] or ""
            except RuntimeError:
                if attempt == self.retries:
                    raise
                time.sleep(min(2.0**attempt, 30.0))
        raise AssertionError("unreachable")

    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float | None]:
        """The judge's grade of each completion, in [0, 1]."""
        if self.url is None or self.model is None:
            self.setup()
        questions = [p if isinstance(p, str) else _last_user(p) for p in kwargs["prompts"]]
        requests = [self.messages(q, c, a) for q, c, a in zip(questions, completions, answers)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests)) or 1) as pool:
            replies = list(pool.map(self.ask, requests))
        scores = [self.parse(r) for r in replies]
        missing = [i for i, s in enumerate(scores) if s is None]
        if missing:
            self.unparsed += len(missing)
            first = replies[missing[0]][:200]
            if self.on_unparsed == "error":
                raise ValueError(f"the judge's reply to completion {missing[0]} has no score ({self.pattern.pattern}): "
                                 f"{first!r}")  # fmt: skip
            log.warning("%s: %d of %d replies had no score (%s), e.g. %r", self.name, len(missing), len(replies),
                        "left out" if self.on_unparsed == "none" else "scored 0", first)  # fmt: skip
        return [0.0 if s is None and self.on_unparsed == "zero" else s for s in scores]

    def close(self) -> None:  # noqa: D102
        if self.serve is not None:  # a server this run started (here or in another process) is gone after the run
            if self.server is not None:
                self.server.close()
            self.server = self.url = None


def _last_user(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
