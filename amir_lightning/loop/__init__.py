"""The rollout loop, read top to bottom: what one epoch of the data module runs to make the rollout it trains on.

1. ``schedule.py``: when a rollout is sampled and from which weights: in turn (``InTurn``), or N rollouts ahead
   while the policy trains (``Ahead``, with ``pending.py``'s record of a rollout in the background and
   ``saved.py``'s rollouts kept in a checkpoint).
2. ``sampler.py``: the engine as the loop uses it: seeds by place in the run, and the push of the policy's weights,
   verified exactly by ``sync.py``.
3. ``rewarding.py``: every reward on every completion; ``collect.py`` makes the rollout (``types.py``'s groups with
   their advantages), ``dynamic.py`` samples more prompts while too few groups have reward variance.
4. ``batch.py``: the rollout's steps, micro-batches of whole groups, and the one writer of the old log-probs.

The loop reaches the engines through the ``RolloutEngine`` seam and the environments through ``run_episodes``;
neither imports the loop.
"""
