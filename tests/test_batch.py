"""Group-whole micro-batching: padding, step summaries, step boundaries and passes."""

import torch

from amir_lightning.rollout.batch import Group, build_micro_batches, repeat_passes
from amir_lightning.rollout.engine import Completion

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


def test_micro_batches_hold_whole_groups_and_step_summaries():
    groups = make_groups()
    batches = build_micro_batches(groups, micro_batch_groups=2, steps_per_rollout=2, pad_id=PAD)
    assert [(b.step, b.last_in_step, b.input_ids.shape[0]) for b in batches] == [(0, True, 6), (1, True, 6)]
    first = batches[0]
    assert torch.equal(first.rewards, torch.cat([groups[0].rewards, groups[1].rewards]))
    assert torch.equal(first.step_rewards, first.rewards)  # one micro-batch per step here
    assert first.step_lengths.tolist() == [1, 2, 3, 1, 2, 3]
    assert first.step_truncated.tolist() == [False, False, True] * 2
    one_step = build_micro_batches(groups, micro_batch_groups=1, steps_per_rollout=1, pad_id=PAD)
    assert [b.last_in_step for b in one_step] == [False, False, False, True]
    assert all(torch.equal(b.step_rewards, torch.cat([g.rewards for g in groups])) for b in one_step)


def test_padding_left_prompt_right_completion():
    batch = build_micro_batches(make_groups(), micro_batch_groups=2, steps_per_rollout=2, pad_id=PAD)[1]
    # groups 2 and 3: prompts of length 3 and 4 -> P = 4; completions of length 1..3 -> T = 3.
    assert batch.input_ids.shape == (6, 7) and batch.completion_width == 3
    row = batch.input_ids[0].tolist()  # group 2, first completion: [pad, 1, 2, 3 | 12, pad, pad]
    assert row == [PAD, 1, 2, 3, 12, PAD, PAD]
    assert batch.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 0, 0]
    assert batch.completion_mask[2].tolist() == [1.0, 1.0, 1.0]
    assert batch.completion_ids[2].tolist() == [12, 12, 12]
    assert batch.sampling_logps[0].tolist() == [-0.5, 0.0, 0.0]


def test_repeat_passes_continues_step_indices_and_shares_tensors():
    batches = build_micro_batches(make_groups(), micro_batch_groups=2, steps_per_rollout=2, pad_id=PAD)
    schedule = repeat_passes(batches, mu=3)
    assert [b.step for b in schedule] == [0, 1, 2, 3, 4, 5]
    assert schedule[2].input_ids is batches[0].input_ids
