"""The rollouts sampled ahead in a checkpoint, by process (``data.rollout.max_staleness`` N >= 1).

Each process samples up to N rollouts ahead of its own prompts (``loop/pending.py``), but Lightning writes the data
module's state from global rank 0 alone (DDP's file, and the ``meta.pt`` of FSDP2's distributed checkpoints). So
every process sends its saved rollout to rank 0, which writes them by rank (``gather_saved``); on resume each process
takes its own (``saved_for_rank``) and checks that its completions belong to the prompts it draws again
(``restore``). A checkpoint written by another number of processes holds rollouts of other prompt shards: it is
dropped, and its prompts are sampled again from the checkpoint's weights (the run goes on, on-policy for that
rollout; no uninterrupted run at this size exists for it to match).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from amir_lightning.data.base import Prompt
from amir_lightning.helpers.distributed import gather_to_rank_zero, global_rank, world_size
from amir_lightning.loop.pending import PendingRollout, SavedRollout

log = logging.getLogger(__name__)


def gather_saved(state: list[dict] | dict | None, replicated: bool) -> dict | None:
    """Every process's saved rollouts (``SavedRollout.state``, oldest first) by global rank, for rank 0's checkpoint.

    Every process must call it. Under DDP the kept weights (``stale_logps: sampler``) are a whole copy on every
    rank, the same: only rank 0's are written. Under FSDP2 each rank keeps its own shards, written by rank.

    Args:
        state: This process's saved rollouts, or one (``None``: it has none, nor has any other).
        replicated: The kept weights are the same on every process (not sharded).

    Returns:
        ``{"world_size": N, "ranks": {rank: [state, ...]}}`` (on other ranks than 0, only their own), or ``None``.
    """
    rank = global_rank()
    if isinstance(state, dict):
        state = [state]
    if state is not None and replicated and rank > 0:
        state = [{**one, "weights": None} for one in state]  # rank 0's
    states = gather_to_rank_zero(state)
    by_rank = dict(enumerate(states)) if states is not None else {rank: state}
    if all(s is None for s in by_rank.values()):
        return None
    return {"world_size": world_size(), "ranks": by_rank}


def saved_for_rank(
    pending: dict | None, rank: int, ranks: int, overlapped: bool
) -> tuple[list[SavedRollout] | None, int | None]:
    """This process's saved rollouts in a checkpoint's ``pending`` (``gather_saved``'s), or where to draw again.

    Args:
        pending: The checkpoint's ``pending`` entry; an older checkpoint's holds one rollout by rank, or one
            process's rollout, unkeyed.
        rank: This process's global rank.
        ranks: Processes of this run.
        overlapped: This run samples rollouts ahead (``data.rollout.max_staleness`` >= 1).

    Returns:
        ``(saved, None)``, oldest first; or ``(None, position)`` when they cannot be resumed here (another number of
        processes, an older checkpoint of several, or a run in turn): the prompt stream goes back to where the
        oldest one's prompts were drawn.
    """
    if pending is None:
        return None, None
    keyed = "ranks" in pending
    by_rank = {r: ([s] if isinstance(s, dict) else s) for r, s in (pending["ranks"] if keyed else {0: pending}).items()}
    written_by = int(pending["world_size"]) if keyed else None
    own = by_rank.get(rank)
    here = written_by == ranks if keyed else ranks == 1  # an unkeyed one is the first process's alone
    if overlapped and own is not None and here:
        # kept weights the same on every rank were written once, by rank 0
        own = [one if one["weights"] is not None else {**one, "weights": first["weights"]}
               for one, first in zip(own, by_rank[0], strict=True)]  # fmt: skip
        return [SavedRollout.from_state(one) for one in own], None
    drawn_at = int(next(s for s in by_rank.values() if s)[0]["drawn_at"])
    if rank == 0:
        why = (
            "this run samples in turn (data.rollout.max_staleness 0)"
            if not overlapped
            else f"it was written by {written_by or 'several'} processes and this run has {ranks}"
        )
        log.warning(
            "the checkpoint's rollouts sampled ahead are dropped (%s): their prompts are sampled again from the "
            "checkpoint's weights, at stream position %d",
            why,
            drawn_at,
        )
    return None, drawn_at


def restore(
    saved: SavedRollout,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    rank: int,
    ranks: int,
    max_over_processes: Callable[[list[float]], list[float]],
) -> PendingRollout:
    """``saved`` with the prompts this process drew again, once every process found its completions theirs.

    Every process must call it: one whose prompts are not those its completions were sampled for (other prompts,
    order, shard size or chat template than the run that wrote the checkpoint) stops every process with one error,
    rather than leaving the others waiting for it.

    Returns:
        The pending rollout, completions and scores as saved, for these prompts.

    Raises:
        ValueError: Some process's saved completions belong to other prompts.
    """
    flags = [0.0] * ranks
    flags[rank] = 0.0 if saved.fits(prompt_ids) else 1.0
    wrong = [r for r, flag in enumerate(max_over_processes(flags)) if flag]
    if wrong:
        raise ValueError(
            "the checkpoint's rollout sampled ahead (data.rollout.max_staleness) holds completions of other prompts "
            f"than process(es) {', '.join(map(str, wrong))} draw again at stream position {saved.drawn_at}: "
            "data.prompts, data.shuffle, data.seed, data.rollout.prompts_per_process or the chat template "
            "(data.chat_template, data.system_prompt) differ from the run that wrote it; resume with its settings"
        )
    return saved.pending(prompts, prompt_ids)
