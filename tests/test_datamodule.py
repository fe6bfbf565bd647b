"""RolloutDataModule in this process, under a real Trainer: HF generate as the engine, a tiny model, no subprocess.

The module hands its ``Policy`` to the data module (``attach``); the data module syncs it into the engine, collects
a rollout and builds the steps, with the old policy's log-probs on every micro-batch of an off-policy rollout.
"""

import lightning as L
import pytest
import torch

from amir_lightning.data import ArithmeticPrompts
from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.objectives import AmirGRPOLoss
from amir_lightning.objectives.amir import PairWeightSettings
from amir_lightning.rewards.base import Reward
from amir_lightning.rollout import HFEngine, SamplingConfig
from amir_lightning.rollout.collect import RolloutSettings
from amir_lightning.rollout.policy import ScoringSettings
from amir_lightning.systems.datamodule import RolloutDataModule
from amir_lightning.systems.module import AmirGRPOModule


class LengthReward(Reward):
    """The completion's length in characters: rewards that differ within a group, so the policy moves."""

    def score(self, completions, answers, **kwargs) -> list[float]:
        return [float(len(c)) for c in completions]


class Watch(L.Callback):
    """Records each step's old log-probs and rollout, and the policy's log-probs before any update."""

    def __init__(self) -> None:
        self.before: dict[int, torch.Tensor] = {}
        self.old: dict[int, list] = {}
        self.rollouts: set[int] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        # train_dataloader() has run (the first rollout), and no step yet: the sampling policy's weights.
        for step in trainer.train_dataloader:
            for batch in step.micro_batches:
                self.before[id(batch)] = pl_module.handle.logps(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.old[batch.index] = [None if b.old_logps is None else b.old_logps.cpu() for b in batch.micro_batches]
        self.rollouts.add(id(batch.rollout))


def fit(tmp_path, steps_per_rollout: int, mu: int) -> tuple[Watch, RolloutDataModule, list]:
    model_dir = build_tiny_model(tmp_path / "model", seed=5)
    module = AmirGRPOModule(
        policy=HFModel(str(model_dir)),
        loss=AmirGRPOLoss(kl_coef=0.0, pair_weight=PairWeightSettings(value=0.5, schedule="fixed")),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        scoring=ScoringSettings(entropy=False),
    )
    data = RolloutDataModule(
        prompts=ArithmeticPrompts(num_terms=1, template="{expression}="),
        engine=HFEngine(progress=False),
        rewards=[LengthReward()],
        rollout=RolloutSettings(
            group_size=4, prompts_per_epoch=2, micro_batch_groups=1, steps_per_rollout=steps_per_rollout, mu=mu
        ),  # fmt: skip
        sampling=SamplingConfig(max_new_tokens=4),
    )
    data.attach(module.handle)
    watch = Watch()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
        callbacks=[watch],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    steps = list(trainer.train_dataloader)
    return watch, data, steps


def test_every_step_of_an_off_policy_rollout_takes_the_policy_before_its_first_update(tmp_path):
    """2 steps x 2 passes: the old log-probs of all 4 steps are the policy's before step 0 updated it, exactly."""
    watch, data, steps = fit(tmp_path, steps_per_rollout=2, mu=2)
    assert sorted(watch.old) == [0, 1, 2, 3]
    for step in steps:
        for batch, old in zip(step.micro_batches, watch.old[step.index], strict=True):
            torch.testing.assert_close(old, watch.before[id(batch)], rtol=0, atol=0)
    # The policy did move: the old log-probs of the last step are not the current policy's.
    last = steps[-1].micro_batches[0]
    assert not torch.allclose(data.policy.logps(last), watch.before[id(last)], atol=1e-4)
    assert len(watch.rollouts) == 1 and None not in watch.rollouts  # every step names the one rollout


def test_an_on_policy_rollout_has_no_old_log_probs(tmp_path):
    watch, _, steps = fit(tmp_path, steps_per_rollout=1, mu=1)
    assert list(watch.old) == [0] and watch.old[0] == [None] * len(steps[0].micro_batches)


def test_the_data_module_needs_the_policy_handed_over(tmp_path):
    data = RolloutDataModule(prompts=ArithmeticPrompts(), engine=HFEngine(progress=False))
    data.trainer = L.Trainer(accelerator="cpu", logger=False, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(RuntimeError, match=r"call data.attach\(module.handle\) before the trainer runs"):
        data.setup("fit")
