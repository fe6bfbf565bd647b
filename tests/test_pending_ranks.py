"""The rollout sampled ahead (``data.rollout.max_staleness: 1``) survives a checkpoint for every process: each rank
resumes its own completions, with its own kept weights and its saved rewards, and never another rank's."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import read_scalars, run_amir, started_server_pid
from helpers.served import SETTINGS
from safetensors.torch import load_file

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.helpers.distributed import all_reduce
from amir_lightning.helpers.serving import free_port, group_members
from amir_lightning.loop.collect import RolloutSettings, make_rollout
from amir_lightning.loop.pending import PendingRollout, SavedRollout
from amir_lightning.loop.saved import gather_saved, restore, saved_for_rank
from amir_lightning.rewards.base import Reward

ROOT = Path(__file__).parents[1]
FSDP2 = "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}"

#: What each of two processes trains on, as in the report of the bug: rank 1 must never get rank 0's answer.
QUESTIONS = [("What is 9 + 4?", "13"), ("What is 2 + 3?", "5")]


class CountsCalls(Reward):
    """The completion's length, times the number of calls so far: a reward that never answers twice alike (as a
    judge sampling its verdict, or a reward model in bf16 on another batch, need not)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def score(self, completions, answers, **kwargs) -> list[float]:
        self.calls += 1
        return [float(len(c) * self.calls) for c in completions]


def token_ids(question: str) -> list[int]:
    """The prompt's "token ids" (its characters' code points; any fixed encoding does)."""
    return [ord(ch) for ch in question]


def sampled_ahead(rank: int) -> PendingRollout:
    """Rank ``rank``'s rollout sampled ahead: its one prompt, two completions, its shard of the kept weights."""
    question, answer = QUESTIONS[rank]
    weights = {"w": torch.full((3,), float(rank + 1))}
    pending = PendingRollout([Prompt(question, answer)], [token_ids(question)], drawn_at=6, version=2, weights=weights)
    pending.completions = [[Completion([1, 2], answer, [-0.5, -0.25], "stop"), Completion([3], "777", [-1.0], "stop")]]
    return pending


def _two_ranks(rank: int, port: int, out: str) -> None:
    """In each of two gloo processes: gather both ranks' saved rollouts (weights sharded, then replicated), and try
    restoring rank 0's rollout on both (rank 1 draws other prompts)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        own = sampled_ahead(rank)
        own.score([CountsCalls()], 60.0)
        sharded, replicated = gather_saved(own.state(), False), gather_saved(own.state(), True)
        if rank == 0:
            torch.save({"sharded": sharded, "replicated": replicated}, out)
        first = SavedRollout.from_state(sampled_ahead(0).state())

        def max_over(values: list[float]) -> list[float]:
            return all_reduce(torch.tensor(values, dtype=torch.float64), "max").tolist()

        try:
            restore(first, own.prompts, own.prompt_ids, rank, 2, max_over)
        except ValueError as err:
            Path(f"{out}.{rank}").write_text(str(err))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes of its own
def test_each_process_resumes_its_own_rollout_sampled_ahead_and_never_another_ranks(tmp_path):
    """Two real processes (gloo): rank 0 writes both ranks' saved rollouts, keyed by rank; on resume rank 1 takes its
    own completions, scores and weight shard (rank 0's weights only when they are replicated, as under DDP). Rank 0's
    rollout offered to rank 1 (what a checkpoint holding rank 0's alone gave it) stops both processes with one error;
    such an unkeyed checkpoint is dropped on two processes, its prompts drawn again."""
    port = free_port("127.0.0.1")  # below the ephemeral range: no socket takes it meanwhile
    out = str(tmp_path / "gathered.pt")
    # spawned, not forked: a process group an earlier test left in this process must not be inherited
    mp.start_processes(_two_ranks, args=(port, out), nprocs=2, start_method="spawn")
    gathered = torch.load(out, weights_only=True)  # as Lightning loads a checkpoint
    sharded, replicated = gathered["sharded"], gathered["replicated"]
    assert sharded["world_size"] == 2 and sorted(sharded["ranks"]) == [0, 1]
    for rank, (question, answer) in enumerate(QUESTIONS):
        (saved,), redraw_at = saved_for_rank(sharded, rank, 2, overlapped=True)
        assert redraw_at is None and saved.completions[0][0].text == answer
        assert saved.fits([token_ids(question)]) and not saved.fits([token_ids(QUESTIONS[1 - rank][0])])
        assert torch.equal(saved.weights["w"], torch.full((3,), float(rank + 1)))  # its own shard
        assert saved.scores.total.tolist() == [len(answer), 3.0]  # as scored before the checkpoint (call 1)
    assert replicated["ranks"][1][0]["weights"] is None  # written once, by rank 0
    (saved,), _ = saved_for_rank(replicated, 1, 2, overlapped=True)
    assert saved.completions[0][0].text == "5" and torch.equal(saved.weights["w"], torch.full((3,), 1.0))
    errors = [Path(f"{out}.{rank}").read_text() for rank in (0, 1)]
    assert errors[0] == errors[1] and "holds completions of other prompts than process(es) 1 draw again" in errors[0]
    assert "\n" not in errors[0] and "data.rollout.prompts_per_process" in errors[0]
    unkeyed = sampled_ahead(0).state()  # a checkpoint of rank 0's rollout alone, as written before
    assert saved_for_rank(unkeyed, 1, 2, overlapped=True) == (None, 6)
    assert saved_for_rank(sharded, 0, 4, overlapped=True) == (None, 6)  # another number of processes
    assert saved_for_rank(sharded, 0, 2, overlapped=False) == (None, 6)  # resumed in turn (max_staleness 0)
    assert saved_for_rank(unkeyed, 0, 1, overlapped=True)[0][0].completions[0][0].text == "13"  # one process's
    one_each = {"world_size": 2, "ranks": {r: states[0] for r, states in sharded["ranks"].items()}}  # as written
    (saved,), _ = saved_for_rank(one_each, 1, 2, overlapped=True)  # before several could sample ahead
    assert saved.completions[0][0].text == "5" and torch.equal(saved.weights["w"], torch.full((3,), 2.0))


def test_a_rollout_sampled_ahead_is_scored_once_and_resumed_with_those_scores(tmp_path):
    """A checkpoint keeps the rollout's rewards: after a save and load, the resumed rollout trains on the rewards the
    first scoring gave, bitwise, and the reward is not called again (it would answer otherwise)."""
    reward = CountsCalls()
    pending = sampled_ahead(1)
    first = pending.score([reward], 60.0)
    assert pending.score([reward], 60.0) is first and reward.calls == 1  # the run trains on what it saved
    torch.save(pending.state(), tmp_path / "pending.pt")
    saved = SavedRollout.from_state(torch.load(tmp_path / "pending.pt", weights_only=True))
    resumed = saved.pending(pending.prompts, pending.prompt_ids)
    settings = RolloutSettings(group_size=2, prompts_per_process=1, micro_batch_groups=1)
    completions, scores = resumed.wait(), resumed.scores
    rollout = make_rollout(resumed.prompts, resumed.prompt_ids, completions, 0.0, [reward], settings, None, scores)
    assert reward.calls == 1
    assert torch.equal(rollout.groups[0].rewards, first.total) and rollout.metrics["rollout/reward_mean"] == 2.0
    rescored = make_rollout(resumed.prompts, resumed.prompt_ids, resumed.wait(), 0.0, [reward], settings)
    assert reward.calls == 2 and rescored.groups[0].rewards.tolist() == [2.0, 6.0]  # what a rescoring trains on


def max_abs_difference(first: Path, second: Path) -> float:
    """The largest absolute difference between two exported policies' weights (same names required)."""
    a, b = load_file(first / "policy" / "model.safetensors"), load_file(second / "policy" / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_two_processes_resumed_a_rollout_ahead_end_where_an_uninterrupted_run_does(tmp_path, served):
    """2 processes share one vLLM server (started by the first), which samples the next rollout while they train:
    each samples its own prompts from it, the first pushes the weights, both read them back exactly. The
    uninterrupted run of 3 rollouts keeps each rollout's checkpoint (``save_top_k: -1``); resumed from rollout 2's,
    written while rollout 3 was being sampled ahead, each rank trains its own saved rollout 3 with its own shard of
    the weights that sampled it (FSDP2, ``stale_logps: sampler``), ending with the uninterrupted run's weights, bitwise.
    The resumed run reaches a running server by ``url`` (``tests/helpers/served.py``).

    FSDP2 with ``sampler`` is the case with the most per-rank state. What DDP and ``current`` add is guarded apart:
    the replicated weights written once by rank 0 and read by rank 1 in
    ``test_each_process_resumes_its_own_rollout_sampled_ahead_and_never_another_ranks``, a resume with ``current``
    (two rollouts ahead, killed mid-generation) in tests/e2e/test_stops.py, and DDP on two processes in
    tests/e2e/test_distributed.py."""
    strategy, stale_logps = FSDP2, "sampler"
    engine = json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": SETTINGS})
    common = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.engine", engine]
    common += ["--trainer.devices", "2", "--trainer.strategy", strategy, "--trainer.deterministic", "true"]
    common += ["--data.rollout.max_staleness", "1", "--data.rollout.stale_logps", stale_logps]
    common += ["--data.rollout.prompts_per_process", "4", "--data.rollout.micro_batch_groups", "4"]
    common += ["--trainer.check_val_every_n_epoch", "50", "--trainer.max_epochs", "3"]
    full = run_amir([*common, "--checkpoint.save_top_k", "-1", "--trainer.logger.init_args.name", "full"], tmp_path)
    pid = started_server_pid(full.stderr)
    assert group_members(pid) == []  # the server the first process started, and what it started, ended with the run
    runs = tmp_path / "runs"
    scalars = read_scalars(runs / "full" / "version_0")
    assert len(scalars["rollout/reward_mean"]) == 3 and len(scalars["train/loss"]) == 3
    assert min(scalars["rollout/sync_verified_tensors"]) > 0 and max(scalars["rollout/sync_logp_diff"]) < 1e-4
    assert scalars["rollout/staleness_steps"] == [0.0, 1.0, 1.0]
    assert scalars["rollout/staleness_rollouts"] == [0.0, 1.0, 1.0]  # max_staleness 1: never more than 1
    (second,) = (runs / "full" / "version_0" / "checkpoints").glob("epoch=1-*")  # rollout 2's, of 0, 1, 2
    shared = ["--data.engine", served.tiny_yaml_engine()]
    run_amir([*common, *shared, "--trainer.logger.init_args.name", "part", "--ckpt_path", str(second)], tmp_path)
    difference = max_abs_difference(runs / "full" / "version_0", runs / "part" / "version_0")
    print(f"max abs weight difference, resumed vs uninterrupted ({stale_logps}): {difference}")
    assert difference == 0.0


def test_an_older_checkpoints_rollout_with_its_completions_old_names_still_loads():
    """Checkpoints written before ``score_old`` became the one writer of the old log-probs kept them on each
    completion too, and named the engine's ``logprobs``: such a rollout loads, under today's names."""
    state = sampled_ahead(0).state()
    for group in state["completions"]:
        for completion in group:
            completion["logprobs"] = completion.pop("sampling_logps")  # as the engine's log-probs were named
            completion["old_logprobs"] = [-0.75] * len(completion["token_ids"])
    saved = SavedRollout.from_state(state)
    assert [c.text for c in saved.completions[0]] == ["13", "777"]
    assert [c.sampling_logps for c in saved.completions[0]] == [[-0.5, -0.25], [-1.0]]
    assert not hasattr(saved.completions[0][0], "old_logprobs") and torch.equal(saved.weights["w"], torch.ones(3))
