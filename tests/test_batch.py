"""Group-whole micro-batching: padding, steps and their summaries, passes, row selection, token budgets, fillers."""

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from amir_lightning.engines.base import Completion
from amir_lightning.loop.batch import build_steps, fit_plan, padded_tokens, plan_steps, split_by_tokens
from amir_lightning.loop.types import Group, Rollout

PAD = 0


def make_groups(num_groups=4, group_size=3):
    groups = []
    for g in range(num_groups):
        prompt = list(range(1, 2 + g))  # prompt lengths 1..num_groups
        completions = [
            Completion([10 + g] * (1 + k), "x", [-0.5] * (1 + k), "length" if k == group_size - 1 else "stop")
            for k in range(group_size)
        ]
        rewards = torch.arange(group_size, dtype=torch.float) + g
        groups.append(Group(prompt, completions, rewards, rewards - rewards.mean()))
    return groups


def test_steps_hold_micro_batches_of_whole_groups_and_step_summaries():
    groups = make_groups()
    steps = build_steps(plan_steps(groups, 2, 2), PAD)
    assert [(s.index, [b.input_ids.shape[0] for b in s.micro_batches]) for s in steps] == [(0, [6]), (1, [6])]
    first = steps[0]
    assert torch.equal(first.micro_batches[0].rewards, torch.cat([groups[0].rewards, groups[1].rewards]))
    assert torch.equal(first.rewards, first.micro_batches[0].rewards)  # one micro-batch per step here
    assert first.lengths.tolist() == [1, 2, 3, 1, 2, 3]
    assert first.truncated.tolist() == [False, False, True] * 2
    (one_step,) = build_steps(plan_steps(groups, 1, 1), PAD)
    assert [b.input_ids.shape[0] for b in one_step.micro_batches] == [3, 3, 3, 3]
    assert torch.equal(one_step.rewards, torch.cat([g.rewards for g in groups]))
    assert one_step.group_size == 3 and one_step.micro_batches[0].group_size == 3


def test_padding_left_prompt_right_completion():
    batch = build_steps(plan_steps(make_groups(), 2, 2), PAD)[1].micro_batches[0]
    # groups 2 and 3: prompts of length 3 and 4 -> P = 4; completions of length 1..3 -> T = 3.
    assert batch.input_ids.shape == (6, 7) and batch.completion_width == 3
    row = batch.input_ids[0].tolist()  # group 2, first completion: [pad, 1, 2, 3 | 12, pad, pad]
    assert row == [PAD, 1, 2, 3, 12, PAD, PAD]
    assert batch.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 0, 0]
    assert batch.completion_mask[2].tolist() == [1.0, 1.0, 1.0]
    assert batch.completion_ids[2].tolist() == [12, 12, 12]
    assert batch.sampling_logps[0].tolist() == [-0.5, 0.0, 0.0]


def test_passes_continue_step_indices_share_micro_batches_and_every_step_names_its_rollout():
    rollout = Rollout(groups=make_groups(), metrics={})  # what the data module collected; steps refer to it
    schedule = build_steps(plan_steps(make_groups(), 2, 2), PAD, passes=3, rollout=rollout)
    assert [s.index for s in schedule] == [0, 1, 2, 3, 4, 5]
    # Later passes run the same micro-batch objects: old log-probs set on the first pass's serve every pass.
    assert all(a is b for s, t in zip(schedule[:2], schedule[2:4]) for a, b in zip(s.micro_batches, t.micro_batches))
    assert all(s.rollout is rollout for s in schedule)
    # Lightning moves a step to the device field by field; the rollout is not one of them (not copied, not moved).
    moved = move_data_to_device(schedule[3], torch.device("cpu"))
    assert moved.rollout is rollout and moved.index == 3


def test_select_picks_rows_of_every_per_row_field():
    batch = build_steps(plan_steps(make_groups(), 1, 2), PAD)[0].micro_batches[1]
    batch.old_logps = batch.sampling_logps * 2
    sub = batch.select([4, 0])
    for name in ("input_ids", "completion_mask", "advantages", "rewards", "truncated", "sampling_logps", "old_logps"):
        assert torch.equal(getattr(sub, name), getattr(batch, name)[[4, 0]]), name
    assert sub.group_size == batch.group_size and batch.input_ids.shape[0] == 6


def sized_groups(lengths, group_size=2, prompt=2):
    """Groups whose completions are all ``length`` tokens long."""
    zeros = torch.zeros(group_size)
    return [
        Group(list(range(1, 1 + prompt)), [Completion([7] * n, "", [0.0] * n, "stop")] * group_size, zeros, zeros)
        for n in lengths
    ]


def test_token_budget_keeps_groups_whole_sorts_by_length_and_respects_the_budget():
    groups = sized_groups([9, 1, 5, 2, 30])  # padded tokens per group alone: 22, 6, 14, 8, 64
    assert [padded_tokens([g]) for g in groups] == [22, 6, 14, 8, 64]
    parts = split_by_tokens(groups, budget=45)
    assert [[len(g.completions[0].token_ids) for g in part] for part in parts] == [[1, 2, 5], [9], [30]]
    assert [padded_tokens(part) for part in parts] == [3 * 2 * 7, 22, 64]  # the 30-token group goes alone
    assert all(padded_tokens(part) <= 45 for part in parts if len(part) > 1)
    in_order = plan_steps(groups, 1, 2)[0]  # by count, in order: [9, 1], [5, 2], [30]
    assert sum(map(padded_tokens, parts)) < sum(map(padded_tokens, in_order))
    (by_tokens,) = plan_steps(groups, 1, 2, micro_batch_tokens=45)
    assert by_tokens == parts


def test_fit_plan_splits_the_largest_micro_batch_then_adds_fillers_and_keeps_empty_steps():
    groups = sized_groups([1, 2, 8, 9])
    plan = [[groups[:]], [groups[:1]]]
    fitted = fit_plan(plan, [3, 2, 0])
    assert [[len(part) for part in step] for step in fitted] == [[2, 1, 1], [1, 0], []]
    assert fitted[0][0] == groups[:2]  # the halves balance padded tokens: [1, 2] | [8, 9] -> then [8] | [9]
    with pytest.raises(ValueError, match="more than the agreed 1"):
        fit_plan(fitted, [1, 2])
    (step, other, empty) = build_steps(fitted, PAD, filler=groups[3])
    assert empty.micro_batches == [] and empty.lengths.numel() == 0  # no process trains there: the weights stay
    assert [b.filler for b in other.micro_batches] == [False, True]
    assert other.lengths.tolist() == [1, 1] and other.micro_batches[1].input_ids.shape[0] == 2
    assert sum(b.input_ids.shape[0] for b in step.micro_batches) == 8 and not any(b.filler for b in step.micro_batches)
    with pytest.raises(ValueError, match="no filler group"):
        build_steps(fitted, PAD)
    only_fillers = build_steps([[[]]], PAD, filler=groups[0])[0]
    assert only_fillers.lengths.numel() == 0 and only_fillers.group_size == 2
