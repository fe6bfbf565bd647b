"""Group-whole micro-batching: padding, steps and their summaries, passes, row selection."""

import torch

from amir_lightning.rollout.batch import Group, build_steps
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


def test_steps_hold_micro_batches_of_whole_groups_and_step_summaries():
    groups = make_groups()
    steps = build_steps(groups, micro_batch_groups=2, steps_per_rollout=2, pad_id=PAD)
    assert [(s.index, [b.input_ids.shape[0] for b in s.micro_batches]) for s in steps] == [(0, [6]), (1, [6])]
    first = steps[0]
    assert torch.equal(first.micro_batches[0].rewards, torch.cat([groups[0].rewards, groups[1].rewards]))
    assert torch.equal(first.rewards, first.micro_batches[0].rewards)  # one micro-batch per step here
    assert first.lengths.tolist() == [1, 2, 3, 1, 2, 3]
    assert first.truncated.tolist() == [False, False, True] * 2
    (one_step,) = build_steps(groups, micro_batch_groups=1, steps_per_rollout=1, pad_id=PAD)
    assert [b.input_ids.shape[0] for b in one_step.micro_batches] == [3, 3, 3, 3]
    assert torch.equal(one_step.rewards, torch.cat([g.rewards for g in groups]))
    assert one_step.group_size == 3 and one_step.micro_batches[0].group_size == 3


def test_padding_left_prompt_right_completion():
    batch = build_steps(make_groups(), micro_batch_groups=2, steps_per_rollout=2, pad_id=PAD)[1].micro_batches[0]
    # groups 2 and 3: prompts of length 3 and 4 -> P = 4; completions of length 1..3 -> T = 3.
    assert batch.input_ids.shape == (6, 7) and batch.completion_width == 3
    row = batch.input_ids[0].tolist()  # group 2, first completion: [pad, 1, 2, 3 | 12, pad, pad]
    assert row == [PAD, 1, 2, 3, 12, PAD, PAD]
    assert batch.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 0, 0]
    assert batch.completion_mask[2].tolist() == [1.0, 1.0, 1.0]
    assert batch.completion_ids[2].tolist() == [12, 12, 12]
    assert batch.sampling_logps[0].tolist() == [-0.5, 0.0, 0.0]


def test_passes_continue_step_indices_share_tensors_and_the_first_step_carries_the_pass():
    schedule = build_steps(make_groups(), micro_batch_groups=2, steps_per_rollout=2, pad_id=PAD, mu=3)
    assert [s.index for s in schedule] == [0, 1, 2, 3, 4, 5]
    assert schedule[2].micro_batches[0].input_ids is schedule[0].micro_batches[0].input_ids
    # The old policy of every later step is the policy before the first update: the first step carries the pass.
    carried = schedule[0].rollout
    assert [[b.input_ids for b in micro] for micro in carried] == [[s.micro_batches[0].input_ids] for s in schedule[:2]]
    assert all(b is m for micro, s in zip(carried, schedule) for b, m in zip(micro, s.micro_batches))
    assert all(not s.rollout for s in schedule[1:])
    (on_policy,) = build_steps(make_groups(), micro_batch_groups=2, steps_per_rollout=1, pad_id=PAD)
    assert on_policy.rollout == []
    assert len(build_steps(make_groups(), micro_batch_groups=2, steps_per_rollout=1, pad_id=PAD, mu=2)[0].rollout) == 1


def test_select_picks_rows_of_every_per_row_field():
    batch = build_steps(make_groups(), micro_batch_groups=2, steps_per_rollout=1, pad_id=PAD)[0].micro_batches[1]
    batch.old_logps = batch.sampling_logps * 2
    sub = batch.select([4, 0])
    for name in ("input_ids", "completion_mask", "advantages", "rewards", "truncated", "sampling_logps", "old_logps"):
        assert torch.equal(getattr(sub, name), getattr(batch, name)[[4, 0]]), name
    assert sub.group_size == batch.group_size and batch.input_ids.shape[0] == 6
