"""RolloutSampleLogger: a few prompts with their completions and rewards (TensorBoard text, a W&B table).

Columns that reward functions log (``log_extra``, TRL's signature: a parsed answer, a judge's verdict) follow the
fixed ones.
"""

from __future__ import annotations

from lightning import Callback
from typing_extensions import override

from amir_lightning.helpers.tracking import log_table

#: The columns of the sample table.
COLUMNS = ["question", "reference", "completion", "reward", "advantage", "tokens", "truncated", "correct"]


class RolloutSampleLogger(Callback):
    """Every ``every_n_epochs`` rollouts, write ``num_prompts`` prompts with all their completions and rewards.

    Args:
        every_n_epochs: Rollouts between two samples.
        num_prompts: Prompts (groups) shown.
        max_chars: Completions are cut to this many characters.
    """

    def __init__(self, every_n_epochs: int = 1, num_prompts: int = 2, max_chars: int = 600) -> None:
        if every_n_epochs < 1 or num_prompts < 1 or max_chars < 1:
            raise ValueError("RolloutSampleLogger needs every_n_epochs, num_prompts and max_chars >= 1")
        self.every_n_epochs, self.num_prompts, self.max_chars = every_n_epochs, num_prompts, max_chars

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Every step of a rollout refers to it (RolloutStep.rollout); the first one shows it.
        rollout = getattr(batch, "rollout", None)
        if batch_idx or rollout is None or not rollout.groups or trainer.current_epoch % self.every_n_epochs:
            return
        groups = rollout.groups[: self.num_prompts]
        columns = COLUMNS + extra_columns(groups)
        log_table(trainer, "rollout/samples", columns, self.rows(groups), self.render(groups))

    def rows(self, groups) -> list[list]:
        """One row per completion (``COLUMNS``, then the rewards' ``extra_columns``), for loggers that take tables."""
        out, extra = [], extra_columns(groups)
        for g in groups:
            for k, c in enumerate(g.completions):
                correct = None if g.correct is None or g.correct[k].isnan() else bool(g.correct[k] == 1)
                out.append(
                    [g.question, g.answer, c.text[: self.max_chars], float(g.rewards[k]), float(g.advantages[k]),
                     len(c.token_ids), c.truncated, correct]
                    + [g.extra[name][k] if name in g.extra else None for name in extra]
                )  # fmt: skip
        return out

    def render(self, groups) -> str:
        """Markdown for ``groups``: question, reference answer, then each completion with reward and advantage."""
        parts = []
        for g in groups:
            parts.append(f"**Q:** {_escape(g.question)}  \n**reference:** {_escape(g.answer)[:200]}\n")
            for k, c in enumerate(g.completions):
                flag = "" if g.correct is None or g.correct[k].isnan() else (" ✓" if g.correct[k] == 1 else " ✗")
                body = _escape(c.text[: self.max_chars]) + (" …" if len(c.text) > self.max_chars else "")
                logged = "".join(f", {name} {_escape(str(values[k]))[:80]}" for name, values in g.extra.items())
                parts.append(
                    f"- reward {float(g.rewards[k]):.3f}, advantage {float(g.advantages[k]):+.2f}, "
                    f"{len(c.token_ids)} tokens{' (truncated)' if c.truncated else ''}{flag}{logged}: `{body}`"
                )
            parts.append("")
        return "\n".join(parts)


def extra_columns(groups) -> list[str]:
    """The columns the rewards logged for these groups (``log_extra``), in the order they were first logged."""
    return list(dict.fromkeys(name for g in groups for name in g.extra))


def _escape(s: str) -> str:
    return s.replace("`", "'").replace("\n", " ⏎ ")
