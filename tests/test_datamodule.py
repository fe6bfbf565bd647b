"""RolloutDataModule in this process, under a real Trainer: HF generate as the engine, a tiny model, no subprocess.

The module hands its ``Policy`` to the data module (``attach``); the data module syncs it into the engine, collects
a rollout and builds the steps, with the old policy's log-probs on every micro-batch of an off-policy rollout.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from amir_lightning.data import ArithmeticPrompts
from amir_lightning.engines import HFEngine, SamplingConfig
from amir_lightning.loop.batch import batch_logps
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.models.export import ExportSettings
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.objectives import AmirGRPOLoss
from amir_lightning.objectives.amir import PairWeightSettings
from amir_lightning.rewards.base import Reward
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
                self.before[id(batch)] = batch_logps(pl_module.policy, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.old[batch.index] = [None if b.old_logps is None else b.old_logps.cpu() for b in batch.micro_batches]
        self.rollouts.add(id(batch.rollout))


class CountingEngine(HFEngine):
    """HF generate that counts its rollouts and records where the prompt stream was at each."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.calls += 1
        return super().generate(prompts, n, sampling, seed)


def build(
    tmp_path, steps_per_rollout: int = 1, passes: int = 1, engine=None, rollout=None, new_tokens: int = 4
) -> tuple[AmirGRPOModule, RolloutDataModule]:
    """The module and the data module of these tests (HF generate, 2 prompts x 4, unless given)."""
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        build_tiny_model(model_dir, seed=5)
    module = AmirGRPOModule(
        policy=HFModel(str(model_dir)),
        loss=AmirGRPOLoss(kl_coef=0.0, pair_weight=PairWeightSettings(value=0.5, schedule="fixed")),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        scoring=ScoringSettings(entropy=False),
        export=ExportSettings(dir=str(tmp_path / "policy")),
    )
    data = RolloutDataModule(
        prompts=ArithmeticPrompts(num_terms=1, template="{expression}="),
        engine=engine or CountingEngine(progress=False),
        rewards=[LengthReward()],
        rollout=rollout
        or RolloutSettings(
            group_size=4,
            prompts_per_process=2,
            micro_batch_groups=1,
            steps_per_rollout=steps_per_rollout,
            passes=passes,
        ),  # fmt: skip
        sampling=SamplingConfig(max_new_tokens=new_tokens),
    )
    data.attach(module.policy)
    return module, data


def make_trainer(
    tmp_path, epochs: int, callbacks: list, checkpoints: bool = False, keep_all: bool = False
) -> L.Trainer:
    """A CPU trainer of ``epochs`` rollouts; with ``checkpoints``, ``last.ckpt`` after each (and each rollout's own
    with ``keep_all``)."""
    if checkpoints:
        keep = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", save_last=True, save_on_train_epoch_end=True, save_top_k=-1 if keep_all else 1
        )
        callbacks = [*callbacks, keep]
    return L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )


def cut_and_resume(build, tmp_path, epochs: int) -> list[tuple[AmirGRPOModule, RolloutDataModule]]:
    """Runs of ``build``'s module and data module: ``epochs`` rollouts straight, each rollout's checkpoint kept, then
    one resumed from rollout ``epochs - 1``'s checkpoint to ``epochs``; their (module, data module) pairs."""
    straight = build(tmp_path / "straight")
    make_trainer(tmp_path / "straight", epochs, [], checkpoints=True, keep_all=True).fit(
        straight[0], datamodule=straight[1]
    )
    (cut,) = (tmp_path / "straight" / "ckpt").glob(f"epoch={epochs - 2}-*.ckpt")
    resumed = build(tmp_path / "resumed")
    make_trainer(tmp_path / "resumed", epochs, [], checkpoints=True).fit(
        resumed[0], datamodule=resumed[1], ckpt_path=cut
    )
    return [straight, resumed]


def fit(tmp_path, steps_per_rollout: int, passes: int) -> tuple[Watch, RolloutDataModule, list]:
    module, data = build(tmp_path, steps_per_rollout, passes)
    watch = Watch()
    trainer = make_trainer(tmp_path, 1, [watch])
    trainer.fit(module, datamodule=data)
    steps = list(trainer.train_dataloader)
    return watch, data, steps


def test_every_step_of_an_off_policy_rollout_takes_the_policy_before_its_first_update(tmp_path):
    """2 steps x 2 passes: the old log-probs of all 4 steps are the policy's before step 0 updated it, exactly."""
    watch, data, steps = fit(tmp_path, steps_per_rollout=2, passes=2)
    assert sorted(watch.old) == [0, 1, 2, 3]
    for step in steps:
        for batch, old in zip(step.micro_batches, watch.old[step.index], strict=True):
            torch.testing.assert_close(old, watch.before[id(batch)], rtol=0, atol=0)
    # The policy did move: the old log-probs of the last step are not the current policy's.
    last = steps[-1].micro_batches[0]
    assert not torch.allclose(batch_logps(data.policy, last), watch.before[id(last)], atol=1e-4)
    assert len(watch.rollouts) == 1 and None not in watch.rollouts  # every step names the one rollout


def test_an_on_policy_rollout_has_no_old_log_probs(tmp_path):
    watch, _, steps = fit(tmp_path, steps_per_rollout=1, passes=1)
    assert list(watch.old) == [0] and watch.old[0] == [None] * len(steps[0].micro_batches)


def test_the_data_module_needs_the_policy_handed_over(tmp_path):
    data = RolloutDataModule(prompts=ArithmeticPrompts(), engine=HFEngine(progress=False))
    data.trainer = L.Trainer(accelerator="cpu", logger=False, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(RuntimeError, match=r"call data.attach\(module.policy\) before the trainer runs"):
        data.setup("fit")


def test_a_run_resumed_at_the_end_of_a_rollout_runs_only_the_next_one_and_ends_where_an_uninterrupted_run_does(
    tmp_path,
):
    """The data module's own record (the rollout's epoch and its steps started) tells a resumed epoch from a new one.

    Resumed from the checkpoint written at the end of rollout 1 of 2, the run generates once (rollout 2), draws the
    prompts an uninterrupted run draws there, and ends with its weights, bitwise.
    """
    (straight_module, straight), (module, data) = cut_and_resume(build, tmp_path, 2)
    assert (straight.engine.calls, data.engine.calls) == (2, 1)
    assert data.feed.position == straight.feed.position == 4  # 2 rollouts of 2 prompts
    for name, weight in straight_module.model.state_dict().items():
        assert torch.equal(weight, module.model.state_dict()[name]), name


def test_decoupled_old_log_probs_are_the_default_and_a_run_without_the_correction_is_warned():
    """``stale_logps: current`` (the default) leans on the engine/trainer importance weights to weigh a stale
    rollout; with ``sampling_correction: none`` nothing would, and the run says so before it starts."""
    ahead = RolloutSettings(max_staleness=1)
    assert ahead.stale_logps == "current" and ahead.uncorrected_staleness("token_truncate") is None
    assert "sampling_correction none" in ahead.uncorrected_staleness("none")
    assert RolloutSettings(max_staleness=1, stale_logps="sampler").uncorrected_staleness("none") is None
    assert RolloutSettings().uncorrected_staleness("none") is None  # in turn: nothing is stale


@pytest.mark.parametrize("correction", ["sequence_truncate", "sequence_mask"])
def test_sequence_weights_on_a_stale_rollout_with_current_old_log_probs_are_warned(correction):
    """``stale_logps: current`` leaves the staleness to the importance weights; one per sequence is the product of
    hundreds of stale token ratios, far from 1 for most completions: the run names the three keys before it starts.
    A token correction, ``stale_logps: sampler`` or a rollout trained in turn is not warned about."""
    warning = RolloutSettings(max_staleness=1).uncorrected_staleness(correction)
    keys = ("data.rollout.stale_logps current", "data.rollout.max_staleness 1", f"sampling_correction {correction}")
    assert warning is not None and "\n" not in warning and all(key in warning for key in keys)
    assert "product of its token ratios" in warning and "data.rollout.stale_logps: sampler" in warning
    assert RolloutSettings(max_staleness=1).uncorrected_staleness("token_mask") is None
    assert RolloutSettings(max_staleness=1, stale_logps="sampler").uncorrected_staleness(correction) is None
    assert RolloutSettings().uncorrected_staleness(correction) is None
