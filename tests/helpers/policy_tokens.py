"""Steps of multi-turn episodes, and the same steps built from the episodes' policy tokens alone.

    PYTHONPATH=. python tests/helpers/policy_tokens.py

A tool's reply inside an episode is context, masked out of the loss: a step of episodes must train exactly as the
step of the same completions with the replies' tokens removed. ``episode_groups`` builds both (2 groups of 4
episodes of 2 or 3 policy turns, an 8-token reply between turns), and ``objective_step`` runs a loss over either
with given per-token log-probs: the same values on the policy tokens of both, so positions and context play no
part; the replies get log-probs that must not matter. Run as a script, it prints, per aggregation, the ratio of
the episode step's gradient norm to the policy-token step's and of its token-normalised statistics (1.000: exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amir_lightning.engines.base import Completion, Episode
from amir_lightning.loop.batch import build_steps, plan_steps
from amir_lightning.loop.types import Group
from amir_lightning.objectives import GRPOLoss, group_advantages

G, GROUPS, REPLY, PAD = 4, 2, 8, 0
#: The token-normalised statistics of the loss (the module adds ``train/entropy``).
TOKEN_STATS = (
    "train/clip_frac",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "rollout/engine_trainer_kl",
    "train/is_weight_mean",
    "train/is_capped_frac",
)


@dataclass
class Episodes:
    """The same completions with their tool replies (``episodes``) and without (``policy_only``).

    Attributes:
        episodes: ``GROUPS`` groups of ``G`` episodes, replies masked out of the loss.
        policy_only: The same groups, each completion's reply tokens removed.
        current: Per group, per completion, ``[policy tokens]`` current log-probs (leaves with grad).
        reference: Per group, per completion, ``[policy tokens]`` reference log-probs.
        old: Each completion's old log-probs (the trainer's before the step), by ``id`` of the completion.
    """

    episodes: list[Group]
    policy_only: list[Group]
    current: list[list[torch.Tensor]]
    reference: list[list[torch.Tensor]]
    old: dict[int, list[float]]


def _policy_and_replies(turns: list[int], trailing: bool) -> list[int]:
    """Loss mask of an episode: its turns, a reply after each but the last (or all replies at the end)."""
    mask: list[int] = []
    for i, length in enumerate(turns):
        mask += [1] * length + ([0] * REPLY if i < len(turns) - 1 and not trailing else [])
    return mask + ([0] * REPLY * (len(turns) - 1) if trailing else [])


def put_old_logps(batch, groups: list[Group], old: dict[int, list[float]]) -> None:
    """``batch.old_logps`` (the batch of ``groups``) from each completion's old log-probs in ``old``, by ``id``."""
    batch.old_logps = torch.zeros_like(batch.sampling_logps)
    for row, completion in enumerate(c for g in groups for c in g.completions):
        values = old[id(completion)]
        batch.old_logps[row, : len(values)] = torch.tensor(values)


def _completion(gen: torch.Generator, trailing: bool, truncated: bool) -> tuple[Completion, Completion, dict]:
    count = int(torch.randint(2, 4, (1,), generator=gen))  # 2 or 3 policy turns, a reply between each two
    turns = [int(torch.randint(2, 9, (1,), generator=gen)) for _ in range(count)]
    mask = _policy_and_replies(turns, trailing)
    ids = torch.randint(3, 20, (len(mask),), generator=gen).tolist()
    engine = (-0.1 - 2.0 * torch.rand(len(mask), generator=gen)).tolist()  # q, the engine's
    sampler = [q + 0.4 * float(torch.randn(1, generator=gen)) for q in engine]  # p_old, the trainer's
    own = [i for i, m in enumerate(mask) if m]
    reason = "length" if truncated else "stop"
    # Replies are not sampled (engine log-prob 0, as run_episodes writes); the trainer scores them like any token.
    logps = [q if m else 0.0 for q, m in zip(engine, mask)]
    episode = Completion(ids, "", logps, reason, episode=Episode(mask, tool_calls=len(turns) - 1))
    bare = Completion([ids[i] for i in own], "", [engine[i] for i in own], reason)
    old = {id(episode): [p if m else -4.0 for p, m in zip(sampler, mask)], id(bare): [sampler[i] for i in own]}
    return episode, bare, old


def episode_groups(seed: int = 0, trailing: bool = False) -> Episodes:
    """Both versions of one step; ``trailing`` puts every reply after the episode's last turn (then a causal model
    scores the policy tokens of both versions alike, and a module-level comparison is exact too)."""
    gen = torch.Generator().manual_seed(seed)
    episodes, bare_groups, current, reference, old = [], [], [], [], {}
    for g in range(GROUPS):
        made = [_completion(gen, trailing, truncated=k == g) for k in range(G)]
        pairs = [(e, b) for e, b, _ in made]
        for _, _, values in made:
            old |= values
        rewards = torch.tensor([0.0, 1.0, 2.0, 0.5])[torch.randperm(G, generator=gen)]
        advantages = group_advantages(rewards, G)
        prompt = list(range(1, 3 + g))
        episodes.append(Group(prompt, [e for e, _ in pairs], rewards, advantages))
        bare_groups.append(Group(prompt, [b for _, b in pairs], rewards, advantages))
        sampler = [torch.tensor(old[id(b)]) for _, b in pairs]
        current.append([(s + 0.15 * torch.randn(s.shape, generator=gen)).requires_grad_() for s in sampler])
        reference.append([s + 0.2 * torch.randn(s.shape, generator=gen) for s in sampler])
    return Episodes(episodes, bare_groups, current, reference, old)


def _scatter(mask: torch.Tensor, values: list[torch.Tensor], filler: float) -> torch.Tensor:
    """``[n, T]`` with ``values`` (row by row) on the policy tokens and ``filler`` elsewhere."""
    return torch.full(mask.shape, filler).masked_scatter(mask.bool(), torch.cat(values))


def objective_step(
    loss: GRPOLoss, groups: list[Group], data: Episodes, micro_batch_groups: int = 1
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss, its gradient in the policy tokens' current log-probs, and its summed stats.

    The step runs as training runs it: its ``StepContext`` from ``RolloutStep``'s step-wide facts, then a loss per
    micro-batch (``micro_batch_groups`` groups each) with the engine's and the sampler's log-probs of the batch.
    ``groups`` are ``data``'s episodes or their policy tokens alone.
    """
    current, reference = data.current, data.reference
    plan = plan_steps(groups, 1, micro_batch_groups)
    (step,) = build_steps(plan, PAD)
    context = loss.step_context(step.lengths, step.rewards, step.group_size, step.truncated)
    where = {id(g): i for i, g in enumerate(groups)}
    total, stats = torch.zeros(()), {}
    for part, batch in zip(plan[0], step.micro_batches):
        put_old_logps(batch, part, data.old)
        index = [(where[id(g)], k) for g in part for k in range(len(g.completions))]
        logps = _scatter(batch.completion_mask, [current[g][k] for g, k in index], -9.0)
        ref = _scatter(batch.completion_mask, [reference[g][k] for g, k in index], -9.0)
        out = loss(
            logps, batch.completion_mask, batch.advantages, batch.rewards, batch.group_size,
            old_logps=batch.old_logps, ref_logps=ref, truncated=batch.truncated,
            sampling_logps=batch.sampling_logps, context=context,
        )  # fmt: skip
        total = total + out.loss
        for key, value in out.stats.items():
            stats[key] = stats.get(key, 0.0) + value.detach()
    grads = torch.autograd.grad(total, [leaf for group in current for leaf in group])
    return total.detach(), torch.cat(grads), stats


#: (label, loss arguments) of every aggregation, with and without dropping truncated completions.
SETTINGS = [
    (f"{aggregation}{label}{' mask_truncated' if drop else ''}", {"aggregation": aggregation, **extra,
                                                                   "mask_truncated_completions": drop})
    for aggregation, label, extra in [
        ("grpo", "", {}),
        ("dr_grpo", " L=64", {"max_completion_length": 64}),
        ("dr_grpo", " L=longest", {}),
        ("bnpo", "", {}),
        ("dapo", "", {}),
    ]
    for drop in (False, True)
]  # fmt: skip


def main() -> None:
    """Print, per setting, episode step / policy-token step: gradient norm, loss and token-normalised stats."""
    data = episode_groups()
    tokens = [sum(c.loss_mask) for g in data.episodes for c in g.completions]
    every = sum(len(c.token_ids) for g in data.episodes for c in g.completions)
    print(f"{GROUPS} groups x {G} episodes: {sum(tokens)} policy tokens, {every - sum(tokens)} reply tokens")
    print(f"{'setting':<34} {'grad':>6} {'loss':>6} " + " ".join(f"{k.split('/')[1]:>13}" for k in TOKEN_STATS))
    for label, kwargs in SETTINGS:
        loss = GRPOLoss(kl_coef=0.04, **kwargs)
        ep_loss, ep_grad, ep_stats = objective_step(loss, data.episodes, data)
        bare_loss, bare_grad, bare_stats = objective_step(loss, data.policy_only, data)
        ratios = [float(ep_stats[k] / bare_stats[k]) if float(bare_stats[k]) else float("nan") for k in TOKEN_STATS]
        line = f"{label:<34} {float(ep_grad.norm() / bare_grad.norm()):6.3f} {float(ep_loss / bare_loss):6.3f} "
        print(line + " ".join(f"{r:13.3f}" for r in ratios))


if __name__ == "__main__":
    main()
