"""``data.rollout.max_staleness: 1`` under a real Trainer with a real vLLM server: the next rollout samples while the
policy trains, every update uses the trainer's log-probs under the weights that sampled its rollout, and a resumed
run ends where an uninterrupted one does."""

import time

import lightning as L
import pytest
import torch
from test_datamodule import build as build_with
from test_datamodule import cut_and_resume, make_trainer

from amir_lightning.data import ArithmeticPrompts
from amir_lightning.engines import HFEngine, VLLMServerEngine
from amir_lightning.loop.batch import batch_logps
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.rewards.base import Reward
from amir_lightning.systems.datamodule import RolloutDataModule
from amir_lightning.systems.module import AmirGRPOModule

pytestmark = pytest.mark.slow


class CountingServer(VLLMServerEngine):
    """The server engine, counting its rollouts (generations of more than one prompt)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rollouts = 0

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.rollouts += 1
        return super().generate(prompts, n, sampling, seed)


def build(tmp_path, url: str, new_tokens: int = 6) -> tuple[AmirGRPOModule, RolloutDataModule]:
    """test_datamodule's module and data module, with the vLLM server at ``url`` and 8 prompts x 8 sampled a rollout
    ahead (exact old log-probs: ``stale_logps: sampler``)."""
    engine = CountingServer(url=url, max_model_len=64)
    rollout = RolloutSettings(
        group_size=8, prompts_per_process=8, micro_batch_groups=4, max_staleness=1, stale_logps="sampler"
    )
    return build_with(tmp_path, engine=engine, rollout=rollout, new_tokens=new_tokens)


class Watch(L.Callback):
    """Per epoch: the weights it starts from, its rollout, the one sampling meanwhile, and its steps' times."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.current, self.ahead, self.steps, self.old = [], [], [], []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        data = trainer.datamodule
        self.weights.append(pl_module.policy.trainable_weights())
        self.current.append(data.schedule.current)
        self.ahead.append(data.schedule.ahead[-1])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append([time.perf_counter(), None])
        self.old.append([b.old_logps.clone() if b.old_logps is not None else None for b in batch.micro_batches])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[-1][1] = time.perf_counter()


def test_the_next_rollout_samples_while_the_policy_trains_on_the_weights_that_will_score_it(tmp_path, served):
    module, data = build(tmp_path / "run", served.tiny_url(), new_tokens=24)
    watch = Watch()
    make_trainer(tmp_path / "run", 4, [watch]).fit(module, datamodule=data)
    # Rollout e + 1 started sampling before epoch e's step and finished after that step started: they overlapped.
    watch.ahead[-1].wait()
    overlapped = [ahead.started < step[0] < ahead.finished_at for ahead, step in zip(watch.ahead, watch.steps)]
    assert sum(overlapped) >= 2, overlapped
    # Epoch 0 trains on its own weights; every later rollout was sampled by the weights the epoch before started
    # with, one optimiser step older than those it trains (one step per rollout here).
    assert watch.current[0].version == 0 and watch.old[0] == [None] * len(watch.old[0])
    for epoch in range(1, 4):
        rollout = watch.current[epoch]
        assert rollout is watch.ahead[epoch - 1] and rollout.version == epoch - 1
        for name, value in watch.weights[epoch - 1].items():
            assert torch.equal(rollout.weights[name], value), name
        assert all(old is not None for old in watch.old[epoch])
    # The ratio's old log-probs are the trainer's under those weights, exactly; the policy has moved since.
    scored = watch.current[3]
    policy = data.policy
    from amir_lightning.loop.batch import make_batch
    from amir_lightning.loop.types import Group

    zeros = torch.zeros(8)
    groups = [Group(ids, comps, zeros, zeros) for ids, comps in zip(scored.prompt_ids, scored.completions)]
    with policy.swapped(watch.weights[2]):
        sampled_by = [batch_logps(policy, make_batch(groups[i : i + 4], policy.pad_token_id)) for i in (0, 4)]
    for old, expected in zip(watch.old[3], sampled_by, strict=True):
        torch.testing.assert_close(old, expected, rtol=0, atol=0)
    now = batch_logps(policy, make_batch(groups[:4], policy.pad_token_id))
    assert not torch.allclose(now, sampled_by[0], atol=1e-4)
    assert data.engine.rollouts == 5  # 4 trained, and the one sampled after the last, for a longer resumed run
    data.engine.close()


class ChangesItsMind(Reward):
    """The completion's length on its first call, minus it on every later one: a reward that need not answer the same
    twice (a judge sampling its verdict, a reward model in bf16), so a rollout scored again would train otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def score(self, completions, answers, **kwargs) -> list[float]:  # noqa: D102
        self.calls += 1
        return [float(len(c)) * (1.0 if self.calls == 1 else -1.0) for c in completions]


def test_a_run_resumed_between_rollouts_ends_where_an_uninterrupted_run_does(tmp_path, served):
    """Resumed from rollout 2's checkpoint of 3: it holds rollout 3, sampled by rollout 2's weights and scored, and
    the resumed run trains on it (no new generation but the one sampled ahead, no new scoring: its reward answers
    otherwise now), ending with the uninterrupted run's weights."""

    def build_changing_reward(folder) -> tuple[AmirGRPOModule, RolloutDataModule]:
        module, data = build(folder, served.tiny_url())
        data.rewards = [ChangesItsMind()]
        return module, data

    (straight_module, straight), (module, data) = cut_and_resume(build_changing_reward, tmp_path, 3)
    assert (straight.engine.rollouts, data.engine.rollouts) == (4, 1)
    assert data.feed.position == straight.feed.position
    for name, weight in straight_module.model.state_dict().items():
        assert torch.equal(weight, module.model.state_dict()[name]), name
    # straight: rollout 1 as it trains, 2-4 when the checkpoints before them were written; resumed: 4 only
    assert [d.rewards[0].calls for d in (straight, data)] == [4, 1]
    for engine in (straight.engine, data.engine):
        engine.close()


def test_an_engine_inside_the_training_process_cannot_overlap():
    with pytest.raises(ValueError, match="max_staleness 1 needs an engine in its own process"):
        RolloutDataModule(
            prompts=ArithmeticPrompts(), engine=HFEngine(progress=False), rollout=RolloutSettings(max_staleness=1)
        )


def test_decoupled_old_log_probs_add_no_pass_and_weigh_the_staleness(tmp_path, served):
    """``stale_logps: current``: a stale rollout's first step has ratio 1 (no old log-probs, no scoring pass, no kept
    weights), and the importance weights compare the current policy with the engine that sampled the tokens."""
    module, data = build(tmp_path / "run", served.tiny_url())
    data.settings = RolloutSettings(
        group_size=8, prompts_per_process=8, micro_batch_groups=4, max_staleness=1, stale_logps="current"
    )
    watch = Watch()
    make_trainer(tmp_path / "run", 3, [watch]).fit(module, datamodule=data)
    assert [rollout.version for rollout in watch.current] == [0, 0, 1]
    assert all(old is None for step in watch.old for old in step)
    assert all(rollout.weights == {} for rollout in watch.current)
    data.engine.close()
