"""The monitors on synthetic micro-batches: values against direct computations; they only read."""

import math

import pytest
import torch

from amir_lightning.callbacks import LengthBiasMonitor, PairMarginMonitor, RolloutSampleLogger
from amir_lightning.callbacks.length_bias import spearman_per_group
from amir_lightning.engines.base import Completion
from amir_lightning.loop.batch import build_steps, plan_steps
from amir_lightning.loop.types import Group
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages
from amir_lightning.objectives.amir import PairTermSettings, PairWeightSettings

G = 4


class FakeModule:
    def __init__(self, loss):
        self.loss = loss


class FakeLogger:
    def __init__(self):
        self.logged = {}

    def log_metrics(self, metrics, step):
        self.logged.update(metrics)


class FakeTrainer:
    is_global_zero = True
    global_step = 0

    def __init__(self):
        self.logger = FakeLogger()
        self.loggers = [self.logger]


def make_step():
    """Two groups: lengths 1..4, rewards [1, 0, 1, 0] (first) and [0, 0, 1, 1] (second); correct = reward."""
    groups = []
    for rewards in ([1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]):
        r = torch.tensor(rewards)
        completions = [Completion([5] * (k + 1), "x", [0.0] * (k + 1), "stop") for k in range(G)]
        groups.append(
            Group([1, 2], completions, r, group_advantages(r, G), correct=r.clone(), question="q", answer="a")
        )
    (step,) = build_steps(plan_steps(groups, 1, 1), pad_id=0)
    # token log-probs: completion k of every group has mean log-prob -(k + 1) / 10
    logps = [torch.tensor([[-(k + 1) / 10] * 4 for k in range(G)]) * b.completion_mask for b in step.micro_batches]
    return groups, step, logps


def run(monitor, loss, step, logps, refs=None):
    """Feed the monitor what ``training_step`` gives it; return its logged values and the step's summed loss stats."""
    module, trainer = FakeModule(loss), FakeTrainer()
    context = loss.step_context(step.lengths, step.rewards, step.group_size, step.truncated)
    stats, rows = {}, []
    for i, (batch, lp) in enumerate(zip(step.micro_batches, logps)):
        ref = None if refs is None else refs[i]
        out = loss(lp, batch.completion_mask, batch.advantages, batch.rewards, G, ref_logps=ref, context=context)
        for key, value in out.stats.items():
            stats[key] = stats.get(key, 0.0) + float(value)
        rows.append(out.rows)
    monitor.on_train_batch_end(trainer, module, {"loss": 0.0, "rows": rows}, step, 0)
    return trainer.logger.logged, stats


def test_pair_margin_monitor_matches_direct_computation():
    """Group 1 pairs (0,1), (0,3), (2,1), (2,3): margins -0.1 + 0.1 ... = l_c - l_r with l_k = -(k + 1) / 10.

    (0,1): -0.1 + 0.2 = 0.1; (0,3): 0.3; (2,1): -0.1; (2,3): 0.1. Group 2 pairs (2,0): -0.2, (2,1): -0.1,
    (3,0): -0.3, (3,1): -0.2. Mean = -0.0375 * 8 / 8 = (0.4 - 0.8) / 8 = -0.05; median of 8 sorted values
    [-0.3, -0.2, -0.2, -0.1, -0.1, 0.1, 0.1, 0.3] = -0.1 (torch takes the lower middle); acc = 3 / 8.
    The pooled values are the loss's stats (GRPO mines for measurement), the median the monitor's.
    """
    _, step, logps = make_step()
    logged, stats = run(PairMarginMonitor(histogram=False), GRPOLoss(), step, logps)
    assert stats["amir/num_pairs"] == 8
    assert math.isclose(stats["amir/pair_margin"], -0.05, abs_tol=1e-6)
    assert math.isclose(logged["amir/pair_margin_median"], -0.1, abs_tol=1e-6)
    assert math.isclose(stats["amir/pair_acc"], 3 / 8)
    assert math.isclose(stats["amir/pair_reward_gap"], 1.0)


def test_pair_margin_monitor_uses_the_amir_loss_mining():
    """top1: the best of each group against its losers, 4 pairs; the median is over those 4 margins."""
    _, step, logps = make_step()
    logged, stats = run(
        PairMarginMonitor(histogram=False), AmirGRPOLoss(pair_term=PairTermSettings(mode="top1")), step, logps
    )
    assert stats["amir/num_pairs"] == 4
    # top1 picks the first best: group 1 row 0 over rows 1, 3 (0.1, 0.3); group 2 row 2 over rows 0, 1 (-0.2, -0.1)
    assert math.isclose(logged["amir/pair_margin_median"], -0.1, abs_tol=1e-6)


def test_length_bias_monitor():
    """Correct lengths: group 1 -> 1, 3; group 2 -> 3, 4: mean 2.75. Incorrect: 2, 4, 1, 2: mean 2.25."""
    groups, step, logps = make_step()
    logged, _ = run(
        LengthBiasMonitor(histogram=False), AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.05)), step, logps
    )
    assert math.isclose(logged["length/correct_mean"], 2.75) and math.isclose(logged["length/incorrect_mean"], 2.25)
    assert math.isclose(logged["length/gap"], -0.5)
    lengths = torch.arange(1.0, 5.0)
    expected = spearman_per_group(torch.stack([lengths, lengths]), torch.stack([g.advantages for g in groups]))
    assert math.isclose(logged["length/corr_advantage"], expected.mean().item(), rel_tol=1e-6)
    # grpo aggregation: a negative-advantage token weighs |A| / (N |o|), N = 8
    negative = [(a.abs().item(), n) for g in groups for a, n in zip(g.advantages, lengths.tolist()) if a < 0]
    expected_pg = sum(a / (8 * n) for a, n in negative) / len(negative)
    assert math.isclose(logged["length/neg_token_weight_pg"], expected_pg, rel_tol=1e-6)
    ratio = logged["length/neg_token_weight_pair"] / logged["length/neg_token_weight_pg"]
    assert math.isclose(logged["length/pair_to_pg"], ratio, rel_tol=1e-6)
    assert "length/long_incorrect_frac" not in logged
    # incorrect completions longer than 2 tokens: group 1 row 3 (4 tokens); group 2 none (1, 2): 1 of 8 completions
    logged, _ = run(
        LengthBiasMonitor(histogram=False, long_tokens=2),
        AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.05)),
        step,
        logps,
    )
    assert math.isclose(logged["length/long_incorrect_frac"], 1 / 8)


def test_length_bias_pair_weight_is_the_pair_terms_gradient():
    """The pair push-down the monitor logs equals autograd's gradient of lambda * L_pref on the rows that only lose.

    With a reference model (reference_free=False), split into two micro-batches sharing the step's pair count:
    the three ways the earlier monitor disagreed with the loss.
    """
    groups, step, logps = make_step()
    gen = torch.Generator().manual_seed(0)
    refs = [lp - torch.rand(lp.shape, generator=gen) * b.completion_mask for lp, b in zip(logps, step.micro_batches)]
    term = PairTermSettings(reference_free=False, beta=0.5)
    amir, grpo = AmirGRPOLoss(term, PairWeightSettings(value=0.3, max=1.0, schedule="fixed")), GRPOLoss()
    logged, _ = run(LengthBiasMonitor(histogram=False), amir, step, logps, refs)
    contexts = [loss.step_context(step.lengths, step.rewards, G) for loss in (amir, grpo)]
    losers = []
    for batch, lp, ref in zip(step.micro_batches, logps, refs):
        grads = []
        for loss, context in zip((amir, grpo), contexts):
            x = lp.clone().requires_grad_(True)
            out = loss(x, batch.completion_mask, batch.advantages, batch.rewards, G, ref_logps=ref, context=context)
            grads.append(torch.autograd.grad(out.loss, x)[0])
        pair_grad = grads[0] - grads[1]  # [n, T]: the pair term's gradient alone
        r = batch.rewards.view(-1, G)
        only_lose = (r == r.min(-1, keepdim=True).values).view(-1) & (batch.advantages < 0)
        losers += [pair_grad[i, 0] for i in torch.nonzero(only_lose).flatten()]
    negatives = sum(int((b.advantages < 0).sum()) for b in step.micro_batches)
    assert len(losers) == negatives  # every negative row of this step is a lowest-reward row: it only loses pairs
    assert math.isclose(logged["length/neg_token_weight_pair"], float(torch.stack(losers).mean()), rel_tol=1e-6)


def test_spearman_hand_computed():
    """x = [1, 2, 3, 4], y = [1, 3, 2, 4]: d = [0, 1, 1, 0], rho = 1 - 6 * 2 / (4 * 15) = 0.8. Ties: average ranks."""
    rho = spearman_per_group(torch.tensor([[1.0, 2, 3, 4], [1, 1, 1, 1]]), torch.tensor([[1.0, 3, 2, 4], [1, 2, 3, 4]]))
    assert math.isclose(rho[0].item(), 0.8, rel_tol=1e-6) and rho[1].isnan()
    tied = spearman_per_group(torch.tensor([[1.0, 1, 2, 3]]), torch.tensor([[1.0, 2, 3, 4]]))
    assert math.isclose(tied.item(), 0.9486833, rel_tol=1e-5)  # Pearson of ranks [1.5, 1.5, 3, 4] with [1, 2, 3, 4]


def test_monitors_only_read():
    _, step, logps = make_step()
    before = [(b.rewards.clone(), b.advantages.clone(), lp.clone()) for b, lp in zip(step.micro_batches, logps)]
    rng = torch.get_rng_state()
    for monitor in (PairMarginMonitor(), LengthBiasMonitor()):
        run(monitor, AmirGRPOLoss(), step, logps)  # the loss reads the log-probs and the batch too
    assert torch.equal(rng, torch.get_rng_state())
    for (r, a, lp), b, lp_now in zip(before, step.micro_batches, logps):
        assert torch.equal(r, b.rewards) and torch.equal(a, b.advantages) and torch.equal(lp, lp_now)


def test_sample_logger_renders_groups():
    groups, _, _ = make_step()
    md = RolloutSampleLogger(num_prompts=1).render(groups[:1])
    assert md.count("- reward") == G and "✓" in md and "✗" in md and "**Q:** q" in md


def _monitor_on_two_processes(rank, store_file, results):
    import torch.distributed as dist

    from amir_lightning.callbacks._base import StepMonitor

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    monitor = StepMonitor(means=["length", "nobody"], cats=["lengths"])
    if rank == 0:  # only rank 0 saw, say, a correct completion; rank 1's step was fillers alone: no call at all
        seen = torch.tensor([2.0, 4.0])
        monitor.mean("length", seen)
        monitor.cat("lengths", seen)
        monitor.mean("nobody", torch.zeros(0))
    means, cats = monitor.computed()
    results[rank] = (float(means["length"]), cats["lengths"].tolist(), "nobody" in means)
    dist.destroy_process_group()


@pytest.mark.slow
def test_monitors_sync_even_where_a_process_saw_nothing(tmp_path):
    """Metric sync is a collective: a process that saw no values must still take part, or the others hang; also one
    that never added a value (its step was fillers alone, which have no rows). A monitor made its metrics when it
    first saw a value: such a process held none, synced nothing, and the other waited for it (a 2-process run with
    dynamic sampling hung)."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_monitor_on_two_processes, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    assert results[0] == results[1] == (3.0, [2.0, 4.0], False)
