"""Each term of the loss menu against its reference, in float64: the largest difference in the loss and its gradient.

    python benchmarks/loss_menu.py [--seeds 20]

The references are the formulas of the paper or the peer that defines each term, written in float64 in the tests
(tests/test_losses.py, tests/test_advantages.py): verl 0.9's vanilla policy loss with ``clip_ratio_c`` (dual clip),
TRL 1.16's ``cispo`` and ``sapo`` per-token losses, RLOO's leave-one-out mean (arXiv 2402.14740), verl's
REINFORCE++ outcome estimators and their ``masked_whiten``, TRL's off-policy sequence mask and its lower bound on
the mismatch weights, verl's ``kl_penalty`` estimators and TRL's importance-weighted KL. Each is run on ``--seeds``
random off-policy steps (4 completions of up to 6 tokens, log-ratios in [-2, 2]), and the table gives the largest
absolute difference seen, loss or gradient (advantages for the estimators).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from test_advantages import tokens_of, verl_masked_whiten  # noqa: E402
from test_losses import trl_is_weights, trl_token_losses, verl_dual_clip_token_losses, verl_kl  # noqa: E402

from amir_lightning.objectives import GRPOLoss  # noqa: E402
from amir_lightning.objectives.advantages import estimate_advantages  # noqa: E402
from amir_lightning.objectives.mismatch import mismatch_weights  # noqa: E402


def step(seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (4,), generator=generator)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(torch.int64)
    adv = torch.randn(4, generator=generator, dtype=torch.float64) * 2
    old = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    start = old + torch.rand(4, 6, generator=generator, dtype=torch.float64) * 4 - 2
    return mask, adv, old, start


def policy_term(term: str, aggregation: str, seed: int) -> float:
    """The largest difference, loss or gradient, of ``term`` against its reference on one step."""
    mask, adv, old, start = step(seed)
    settings = {"dual clip": {"dual_clip": 3.0}, "cispo": {"policy_loss": "cispo"}, "sapo": {"policy_loss": "sapo"}}
    ours = start.clone().requires_grad_(True)
    out = GRPOLoss(aggregation=aggregation, **settings[term])(ours, mask, adv, torch.zeros(4), 4, old_logps=old)
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    if term == "dual clip":
        token = verl_dual_clip_token_losses(theirs, old, adv, 0.2, 3.0)
    else:
        token = trl_token_losses(term, theirs, old, adv)
    token = token * mask
    expected = token.sum() / mask.sum() if aggregation == "dapo" else (token.sum(-1) / mask.sum(-1)).mean()
    expected.backward()
    return max(abs(out.loss.item() - expected.item()), (ours.grad - theirs.grad).abs().max().item())


def floor_weights(mode: str, seed: int) -> float:
    """The largest difference of the mismatch weights with ``sampling_floor`` 0.5 against TRL's ``clip_min``."""
    mask, _, old, _ = step(seed)
    mask = mask.double()
    generator = torch.Generator().manual_seed(seed + 1000)
    sampling = old + torch.randn(4, 6, generator=generator, dtype=torch.float64) * (0.1 if "sequence" in mode else 1)
    ours, _ = mismatch_weights(old, sampling, mask, mode, 3.0, float(mask.sum()), floor=0.5)
    return (ours - trl_is_weights(old, sampling, mask, mode, 3.0, 0.5)).abs().max().item()


def off_policy_masked(seed: int) -> float:
    """The largest difference, loss or gradient, with ``off_policy_mask`` 0.05 against TRL's ``get_off_policy_mask``."""
    mask, adv, _, start = step(seed)
    generator = torch.Generator().manual_seed(seed + 2000)
    sampling = start + torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.2
    ours = start.clone().requires_grad_(True)
    loss = GRPOLoss(aggregation="dapo", sampling_correction="none", off_policy_mask=0.05)
    out = loss(ours, mask, adv, torch.zeros(4), 4, sampling_logps=sampling)
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    gap = ((sampling - theirs.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    keep = ((adv[:, None] >= 0) | (gap <= 0.05)).double()
    ratio = (theirs - theirs.detach()).exp()
    token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * keep * mask
    expected = token.sum() / mask.sum()
    expected.backward()
    return max(abs(out.loss.item() - expected.item()), (ours.grad - theirs.grad).abs().max().item())


def kl_term(estimator: str, weighted: bool, seed: int) -> float:
    """The largest difference, loss or gradient, of the KL term against verl's estimate (times TRL's ratio)."""
    mask, _, old, start = step(seed)
    generator = torch.Generator().manual_seed(seed + 3000)
    ref = start + 0.5 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    zero = torch.zeros(4, dtype=torch.float64)
    ours = start.clone().requires_grad_(True)
    loss = GRPOLoss(aggregation="dapo", kl_coef=1.0, kl_estimator=estimator, kl_importance_weighted=weighted)
    loss(ours, mask, zero, zero, 4, old_logps=old, ref_logps=ref).loss.backward()
    out = loss(start.clone(), mask, zero, zero, 4, old_logps=old, ref_logps=ref).loss
    theirs = start.clone().requires_grad_(True)
    per_token = verl_kl(theirs, ref, estimator) * ((theirs - old).exp() if weighted else 1.0)
    expected = (per_token * mask).sum() / mask.sum()
    expected.backward()
    return max(abs(out.item() - expected.item()), (ours.grad - theirs.grad).abs().max().item())


def estimator(name: str, seed: int) -> float:
    """The largest difference of the ``name`` advantages against the reference on one batch of 3 groups of 4."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.rand(12, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, 30, (12,), generator=generator).tolist()
    ours = estimate_advantages(rewards, 4, name, "none" if name == "rloo" else "group", torch.tensor(lengths).double())
    if name == "rloo":  # each reward minus the mean of the others of its group, one by one
        groups = [rewards[i // 4 * 4 : i // 4 * 4 + 4] for i in range(12)]
        others = [torch.cat([g[: i % 4], g[i % 4 + 1 :]]) for i, g in enumerate(groups)]
        expected = torch.stack([rewards[i] - rest.mean() for i, rest in enumerate(others)])
    else:
        scores = rewards
        if name == "reinforce_pp_baseline":
            scores = (rewards.view(-1, 4) - rewards.view(-1, 4).mean(1, keepdim=True)).view(-1)
        mask, _ = tokens_of(lengths)
        expected = verl_masked_whiten(scores[:, None] * mask, mask)[:, 0]
    return (ours - expected).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    seeds = range(args.seeds)
    print(f"float64, {args.seeds} random steps each")
    print("| term | setting | reference | aggregation | largest difference (loss or gradient) |")
    print("|---|---|---|---|---|")
    rows = [
        ("dual clip", "`dual_clip: 3.0`", "verl 0.9 `compute_policy_loss_vanilla`, `clip_ratio_c`", ["dapo", "grpo"]),
        ("cispo", "`policy_loss: cispo`", "TRL 1.16 `GRPOTrainer._compute_loss`, `loss_type=cispo`", ["dapo", "grpo"]),
        ("sapo", "`policy_loss: sapo`", "TRL 1.16 `GRPOTrainer._compute_loss`, `loss_type=sapo`", ["grpo", "dapo"]),
    ]
    for term, setting, reference, aggregations in rows:
        for aggregation in aggregations:
            worst = max(policy_term(term, aggregation, seed) for seed in seeds)
            print(f"| {term} | {setting} | {reference} | {aggregation} | {worst:.1e} |")
    worst = max(off_policy_masked(seed) for seed in seeds)
    print(
        f"| off-policy sequence mask | `off_policy_mask: 0.05` | TRL 1.16 `get_off_policy_mask` | dapo | {worst:.1e} |"
    )
    print("\n| KL estimator | importance-weighted | reference | largest difference (loss or gradient) |")
    print("|---|---|---|---|")
    for name in ("k1", "k2", "k3", "k1+", "k3+"):
        for weighted in (False, True):
            worst = max(kl_term(name, weighted, seed) for seed in seeds)
            reference = "verl 0.9 `kl_penalty`" + (" times TRL's `use_bias_correction_kl` ratio" if weighted else "")
            print(f"| `{name}` | {weighted} | {reference} | {worst:.1e} |")
    print("\n| mismatch weights | setting | reference | largest difference (weights) |")
    print("|---|---|---|---|")
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        worst = max(floor_weights(mode, seed) for seed in seeds)
        print(f"| `{mode}` | `sampling_floor: 0.5` | TRL 1.16 `vllm_importance_sampling_clip_min` | {worst:.1e} |")
    print("\n| advantage estimator | reference | largest difference (advantages) |")
    print("|---|---|---|")
    for name, reference in [
        ("rloo", "the leave-one-out mean, arXiv 2402.14740"),
        ("reinforce_pp", "verl 0.9 `compute_reinforce_plus_plus_outcome_advantage`, `masked_whiten`"),
        ("reinforce_pp_baseline", "verl 0.9 `compute_reinforce_plus_plus_baseline_outcome_advantage`"),
    ]:
        worst = max(estimator(name, seed) for seed in seeds)
        print(f"| `{name}` | {reference} | {worst:.1e} |")


if __name__ == "__main__":
    main()
