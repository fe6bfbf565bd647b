"""The rollout engine as the loop uses it: generation seeded by its place in the run, and the verified weight push.

Which rollout settings an engine can serve is checked here too, at configuration (``setting_errors``).

A generation's seed is a hash of (the run's seed, the optimisation step, the rank, the purpose), a further round's
or turn's a hash of that and its index, and a request's a hash of that and its prompt (``engines/base.py``
``request_seed``): a rollout is then a function of the weights and its place in the run, not of hidden engine state,
so a resumed run draws the same rollouts as an uninterrupted one, and no two ranks, rounds, turns or prompts share
a stream (offsets added to a seed would: a rank's next to a prompt's). In-process engines sample from the global
RNG, forked and seeded per call, so the trainer's random stream is untouched; an engine in its own process takes
the seed with the request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion, RolloutEngine, SamplingConfig, mix_seed
from amir_lightning.environments.base import Environment, EpisodeBatch
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.loop.pending import PendingRollout, Sampled
from amir_lightning.loop.sync import SyncCheck, SyncReport
from amir_lightning.models.policy import Policy

#: What a generation is for: the training rollout in turn, validation and tests, the rollout sampled ahead.
TRAIN, EVALUATE, AHEAD = 0, 1, 2
#: A further round of sampling's place in the seed hash (a further turn's is ``engines/base.py``'s ``TURN``).
ROUND = 1


def generation_seed(seed: int, step: int, rank: int, purpose: int) -> int:
    """The seed of a generation at optimisation ``step`` on process ``rank`` for ``purpose`` (a hash of the four)."""
    return mix_seed(seed, step, rank, purpose)


def round_seed(seed: int, index: int) -> int:
    """The seed of a rollout's ``index``-th round of sampling (dynamic sampling; the first round's is ``seed``)."""
    return seed if index == 0 else mix_seed(seed, ROUND, index)


def setting_errors(
    engine: RolloutEngine, rollout: RolloutSettings, sampling: SamplingConfig, environment: Environment | None
) -> list[str]:
    """What ``data.rollout`` and ``data.sampling`` ask of the engine and the environment that they cannot do."""
    errors = []
    room = getattr(engine, "max_model_len", None)
    if room is not None and room - sampling.max_new_tokens < 1:
        errors.append(
            f"data.sampling.max_new_tokens ({sampling.max_new_tokens}) leaves no room for a prompt in "
            f"data.engine.init_args.max_model_len ({room})"
        )
    if rollout.max_staleness and not engine.runs_apart:
        errors.append(
            f"data.rollout.max_staleness {rollout.max_staleness} needs an engine in its own process "
            f"(amir_lightning.engines.VLLMServerEngine): {type(engine).__name__} generates inside the training "
            "process, so generation and training cannot overlap"
        )
    elif rollout.partial_rollouts and not engine.takes_updates_in_flight:
        errors.append(f"data.rollout.partial_rollouts needs an engine that takes pushes with requests in flight "
                      f"(amir_lightning.engines.VLLMServerEngine), not {type(engine).__name__}")  # fmt: skip
    elif rollout.partial_rollouts and getattr(engine, "push_adapters", False):
        errors.append("data.rollout.partial_rollouts with data.engine.init_args.push_adapters: a push in flight "
                      "would replace the adapter that the running requests name. Instead: push merged weights "
                      "(push_adapters false; pushes then reach requests in flight), or sample one rollout ahead "
                      "without pushes in flight (max_staleness 1, partial_rollouts false)")  # fmt: skip
    if rollout.partial_rollouts and environment is not None:
        errors.append("data.rollout.partial_rollouts with data.environment or data.tools: a multi-turn "
                      "episode's turns are not tagged with the weights that sampled them. Instead: sample episodes "
                      "one rollout ahead with each finished on the weights that started it (max_staleness 1, "
                      "partial_rollouts false), or in turn (max_staleness 0)")  # fmt: skip
    return errors


class Sampler:
    """Generation and the weight push through one engine.

    Args:
        engine: The rollout engine.
        environment: Where an episode's tool calls go (``data.environment``); ``None``: single-turn completions.
        sync_check: Verifies every push (``loop/sync.py``).
        updates_in_flight: Pushes land with requests in flight (``data.rollout.partial_rollouts``).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        environment: Environment | None,
        sync_check: SyncCheck,
        updates_in_flight: bool = False,
    ) -> None:
        self.engine, self.environment, self.sync_check = engine, environment, sync_check
        self.updates_in_flight = updates_in_flight
        self.pushed_version: int | None = None

    def start(
        self, policy: Policy, seed: int, device: torch.device, local_rank: int, samplings: Sequence[SamplingConfig]
    ) -> None:
        """Start the engine on the policy's files (unless it runs); check it can sample as each of ``samplings``."""
        if not self.engine.started:
            self.engine.take_adapters(policy.lora)  # LoRA layers in the engine, or merged pushes
            self.engine.start(policy.model_dir, seed, device, local_rank, self.updates_in_flight)
        for sampling in samplings:
            self.engine.check_sampling(sampling)

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        seed: int,
        prompts: list[Prompt] | None = None,
        tokenizer=None,
    ) -> list[list[Completion]]:
        """``n`` completions per prompt, each turn sampled from its own seed (``turn_seed``).

        With an ``environment``, the ``prompts`` and the ``tokenizer``, each completion is a multi-turn episode.
        """
        if self.environment is None or prompts is None:
            return self.engine.generate(prompt_ids, n, sampling, seed)
        return self.episodes(prompts, prompt_ids, n, sampling, seed, tokenizer)

    def start_apart(
        self, pending: PendingRollout, n: int, sampling: SamplingConfig, seed: int, tokenizer
    ) -> PendingRollout:
        """Start sampling ``pending``'s prompts on an engine in its own process, while the policy trains.

        The seed goes with each request (the training thread's RNG is not the engine's).
        """
        prompts = pending.prompts if self.environment is not None else None
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="amir-rollout")  # it waits on the engine's process
        sampling_thread = pool.submit(self._timed, pending.prompt_ids, n, sampling, seed, prompts, tokenizer)
        pool.shutdown(wait=False)
        return replace(pending, sampling=sampling_thread)

    def _timed(self, prompt_ids, n, sampling, seed, prompts, tokenizer) -> Sampled:
        start = time.perf_counter()
        completions = self.generate(prompt_ids, n, sampling, seed, prompts, tokenizer)
        return Sampled(completions, time.perf_counter() - start, time.perf_counter())

    def sleep(self) -> None:
        """Lend a colocated engine's memory to training until the next push (engines with sleep mode)."""
        self.engine.sleep()

    def episodes(self, prompts, prompt_ids, n, sampling, seed: int, tokenizer) -> list[list[Completion]]:
        """``n`` multi-turn episodes per prompt through ``environment``, turn ``i`` from ``turn_seed(seed, i)``."""
        room = getattr(self.engine, "max_model_len", None)
        return self.environment.episodes(
            EpisodeBatch(prompts, prompt_ids, n, sampling, self.engine, seed, tokenizer, room)
        )

    def push(
        self,
        policy: Policy,
        step: int,
        probe: tuple[list[int], str],
        max_over_processes: Callable[[list[float]], list[float]],
    ) -> SyncReport | None:
        """Push the policy into the engine and verify it, once per weight version (``None``: pushed already).

        The weight version is the optimisation ``step`` that made the weights: the engine labels the tokens they
        sample with it (``Completion.versions``), a rollout keeps it (``PendingRollout.version``).

        The first push fixes the probe (a prompt's ids and its answer) for the rest of the run.
        """
        if self.pushed_version == step:
            return None
        self.sync_check.set_probe(policy.tokenizer, *probe)
        report = self.sync_check.push_and_verify(policy, self.engine, max_over_processes, version=step)
        self.pushed_version = step
        return report
