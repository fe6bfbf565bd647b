"""Preference (pair) loss: hand-computed values and the direction of its gradient."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amir_lightning.objectives import mine_pairs, preference_loss, sequence_logps


def test_sequence_logps_mean_and_sum():
    """Row 0: tokens -1, -3 (third is padding) -> sum -4, mean -2. Row 1 is empty -> sum 0, mean 0."""
    logps = torch.tensor([[-1.0, -3.0, -9.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_logps(logps, mask, "sum"), torch.tensor([-4.0, 0.0]))
    torch.testing.assert_close(sequence_logps(logps, mask, "mean"), torch.tensor([-2.0, 0.0]))


def test_reference_free_hand_computed():
    """l = [-1, -2], pair (0, 1), beta 0.5: z = 0.5 * (-1 - -2) = 0.5; loss = log(1 + e^-0.5) = 0.474077."""
    loss = preference_loss(torch.tensor([-1.0, -2.0]), torch.tensor([[0, 1]]), beta=0.5)
    torch.testing.assert_close(loss, torch.tensor(math.log1p(math.exp(-0.5))))


def test_with_reference_hand_computed():
    """ref = [-1.5, -1.0]: z = 0.5 * ((-1 + 1.5) - (-2 + 1)) = 0.75; loss = log(1 + e^-0.75) = 0.385007."""
    loss = preference_loss(
        torch.tensor([-1.0, -2.0]), torch.tensor([[0, 1]]), beta=0.5, ref_seq_logps=torch.tensor([-1.5, -1.0])
    )
    torch.testing.assert_close(loss, torch.tensor(math.log1p(math.exp(-0.75))))


def test_pooled_mean_and_step_normaliser():
    """Pairs (0,1) z=0.5 and (0,2) z=1.0 with beta 0.5, l = [0, -1, -2].

    Pooled mean: (log(1+e^-0.5) + log(1+e^-1)) / 2 = (0.474077 + 0.313262) / 2 = 0.393669;
    with num_pairs=4 (the step has two more pairs elsewhere) the share is the sum / 4 = 0.196835.
    """
    seq = torch.tensor([0.0, -1.0, -2.0])
    pairs = torch.tensor([[0, 1], [0, 2]])
    total = math.log1p(math.exp(-0.5)) + math.log1p(math.exp(-1.0))
    torch.testing.assert_close(preference_loss(seq, pairs, 0.5), torch.tensor(total / 2))
    torch.testing.assert_close(preference_loss(seq, pairs, 0.5, num_pairs=4), torch.tensor(total / 4))


def test_no_pairs_is_zero_and_differentiable():
    seq = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss = preference_loss(seq, torch.zeros(0, 2, dtype=torch.long), beta=0.5)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(seq.grad, torch.zeros(2))


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.data(), st.floats(0.05, 2.0))
def test_gradient_pushes_chosen_up_rejected_down(group_size, data, beta):
    rewards = torch.tensor(
        data.draw(st.lists(st.integers(0, 3), min_size=group_size, max_size=group_size)), dtype=torch.float32
    )
    pairs = mine_pairs(rewards, group_size)
    if len(pairs) == 0:
        return
    logps = torch.tensor(
        data.draw(st.lists(st.floats(-5, 0), min_size=group_size, max_size=group_size)), requires_grad=True
    )
    loss = preference_loss(logps, pairs, beta)
    loss.backward()
    grad = logps.grad
    only_chosen = set(pairs[:, 0].tolist()) - set(pairs[:, 1].tolist())
    only_rejected = set(pairs[:, 1].tolist()) - set(pairs[:, 0].tolist())
    # Gradient descent moves logps by -grad: chosen-only completions go up, rejected-only go down.
    assert all(grad[i] < 0 for i in only_chosen)
    assert all(grad[j] > 0 for j in only_rejected)
    # And a small step lowers the loss.
    with torch.no_grad():
        stepped = preference_loss(logps - 1e-2 * grad, pairs, beta)
    assert stepped < loss
