"""The run's progress: one bar for the whole run, each rollout's log line with its pace, where a stop left it.

The bar shows the rollouts done of the run's, the time left, the last reward and loss (``RunProgressBar``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class RunProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting rollouts over the whole run instead of optimisation steps in one epoch.

    A rollout is generated and graded before Lightning starts its epoch (in ``train_dataloader``), so an epoch's
    bar of optimisation steps misses most of a rollout's time and knows nothing of the run's length. This bar
    advances once per rollout, so its rate and time left count generation, grading and training; a resumed run
    starts it where the checkpoint left off. The postfix holds the last rollout's mean reward and the last loss.
    Validation keeps Lightning's own bar below it. ``amir fit`` puts it in place of Lightning's default bar.
    """

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        total = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        bar.reset(total=total)
        bar.initial = bar.n = bar.last_print_n = trainer.current_epoch
        bar.set_description("rollouts")
        bar.unit = "rollout"  # and seconds per rollout, not Lightning's 0.02 it/s, when a rollout takes longer
        bar.bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
        bar.refresh()

    @override
    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        pass  # the bar spans the run: nothing resets per rollout

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.train_progress_bar.disable and (batch_idx + 1) % max(self.refresh_rate, 1) == 0:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.update(1)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict[str, int | str | float | dict[str, float]]:
        """The last rollout's mean reward and the last loss, then what the module logs to the bar (no ``v_num``)."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        metrics = trainer.callback_metrics
        names = {"reward": "rollout/reward_mean", "loss": "train/loss"}
        return {short: f"{float(metrics[key]):.3g}" for short, key in names.items() if key in metrics} | items


def rollout_line(metrics: dict[str, float], epoch: int, max_epochs: int | None, logged_at: list[float]) -> str:
    """The log line of rollout ``epoch`` (0-based) from its metrics averaged over processes, with the time left."""
    total = max_epochs if max_epochs and max_epochs > 0 else None
    return (
        f"rollout {epoch + 1}{f' of {total}' if total else ''}: "
        f"reward {metrics['rollout/reward_mean']:.3f} +- {metrics['rollout/reward_std']:.3f}, "
        f"{100 * (1 - metrics['rollout/zero_std_frac']):.0f}% of groups with reward variance, "
        f"{metrics['rollout/tokens_per_s']:.0f} tokens/s, length {metrics['length/mean']:.1f} "
        f"({100 * metrics['length/truncated_frac']:.0f}% truncated){time_left(logged_at, epoch + 1, max_epochs)}"
    )


def short_rollout_line(epoch: int, groups: int, steps: int, settings) -> str | None:
    """The warning of rollout ``epoch`` (0-based) when its groups fill fewer than its steps (``None``: they fill all).

    ``groups``: the groups it trains on, over processes; ``steps``: the steps they fill, of
    ``settings.steps_per_rollout``.
    """
    planned = settings.steps_per_rollout
    if steps >= planned:
        return None
    if settings.dynamic_sampling:
        cause = (f"dynamic sampling found {groups} group(s) with reward variance within "
                 f"data.rollout.max_sampling_rounds ({settings.max_sampling_rounds})")  # fmt: skip
    elif settings.drop_zero_std_groups:
        cause = f"data.rollout.drop_zero_std_groups left {groups} group(s) with reward variance"
    else:
        cause = f"{groups} group(s) have finite rewards"
    return (
        f"rollout {epoch + 1}: {cause}, fewer than its {planned} steps (data.rollout.steps_per_rollout): "
        f"{steps} step(s) train, the other {planned - steps} leave the weights as they are (the LR schedule moves on)"
    )


def where_it_stopped(trainer) -> str:
    """Where a SIGTERM stopped the run, and how it resumes (``amir`` prints it as it exits)."""
    if trainer.state.fn != "fit":  # amir test, validate: nothing to resume, run it again
        return f" during amir {trainer.state.fn.value}"
    done = trainer.current_epoch  # rollouts whose epoch completed
    total = f" of {trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
    last = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
    resume = (
        f"; the last checkpoint is {last}: resume with the same command and --ckpt_path last"
        if last
        else "; no checkpoint was written yet"
    )
    return f" with {done}{total} rollouts done{resume}"


def time_left(logged_at: list[float], done: int, total: int | None) -> str:
    """``"; 42 s per rollout, 1 h 10 min left"`` from when the rollouts of this process were logged ("" at first)."""
    if len(logged_at) < 2:
        return ""
    per = (logged_at[-1] - logged_at[0]) / (len(logged_at) - 1)
    text = f"; {_duration(per)} per rollout"
    if total and total > 0:
        text += f", {_duration(per * max(total - done, 0))} left"
    return text


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours = minutes / 60
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} d"
