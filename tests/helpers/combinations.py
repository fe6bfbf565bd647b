"""The combinations of settings users make, as cells of a grid, and what a cell that trains must keep.

A cell is one choice of: the schedule (in turn, 1 rollout ahead, 2 ahead with pushes in flight), 1 or 2 processes
(FSDP2), LoRA (none, merged pushes, adapter pushes), multi-turn episodes (an environment that replies between turns,
as a tool does), dynamic sampling, and the aggregation (dr_grpo, dapo): 144 cells on ``configs/tiny.yaml``. Each is
either refused at start in one line naming its keys (``refusal``), or trains exactly: every sync verified, no two
groups of one prompt sampled alike (distinct seeds over ranks, rounds and turns), the step's normalisers counting the
policy's own tokens, and a run resumed from a checkpoint ending with the uninterrupted run's weights, bitwise.

Used by ``tests/test_combinations.py`` and ``benchmarks/combinations.py``; ``Invariants`` is a callback ``amir``
loads by ``class_path`` (the tests put this folder on PYTHONPATH).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lightning import Callback

SCHEDULES = ("in turn", "1 ahead", "2 ahead")
LORAS = ("none", "merged", "adapters")
AGGREGATIONS = ("dr_grpo", "dapo")
#: Every run's length: the checkpoint after rollout 2 is resumed to rollout 3.
ROLLOUTS = 3
MAX_NEW_TOKENS = 4
MAX_TURNS = 2
LORA_RANK = 4
FSDP2 = "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}"


@dataclass(frozen=True)
class Cell:
    """One combination of settings."""

    schedule: str
    processes: int
    lora: str
    episodes: bool
    dynamic: bool
    aggregation: str

    @property
    def name(self) -> str:
        """A short name: ``1 ahead, 2 proc, lora adapters, episodes, dynamic, dapo``."""
        parts = [self.schedule, f"{self.processes} proc", f"lora {self.lora}" if self.lora != "none" else "no lora"]
        parts += ["episodes"] * self.episodes + ["dynamic"] * self.dynamic + [self.aggregation]
        return ", ".join(parts)

    @property
    def id(self) -> str:
        """A test id: ``ahead1-2p-adapters-episodes-dynamic-dapo``."""
        parts = [{"in turn": "inturn", "1 ahead": "ahead1", "2 ahead": "ahead2"}[self.schedule], f"{self.processes}p"]
        parts += [self.lora] + ["episodes"] * self.episodes + ["dynamic"] * self.dynamic + [self.aggregation]
        return "-".join(parts)

    def refusal(self) -> list[str] | None:
        """The keys the start-up refusal must name, each refusal a list; ``None``: the cell trains."""
        if self.schedule != "2 ahead":
            return None
        refusals = []
        if self.lora == "adapters":
            refusals.append(["data.rollout.partial_rollouts", "data.engine.init_args.push_adapters", "Instead:"])
        if self.episodes:
            refusals.append(["data.rollout.partial_rollouts", "data.environment", "Instead:"])
        return refusals or None

    def args(self, server_engine: str | None) -> list[str]:
        """``amir fit``'s arguments for the cell on configs/tiny.yaml; ``server_engine``: ``--data.engine``'s
        value for a vLLM server (the schedules ahead need one), ``None``: a server of the run's own."""
        root = Path(__file__).parents[2]
        args = ["fit", "--config", str(root / "configs" / "tiny.yaml"), "--trainer.max_epochs", str(ROLLOUTS)]
        args += ["--trainer.check_val_every_n_epoch", "50", "--trainer.deterministic", "true"]
        args += ["--data.sampling.max_new_tokens", str(MAX_NEW_TOKENS), "--data.rollout.prompts_per_process", "4"]
        args += ["--data.rollout.micro_batch_groups", "2", "--model.loss.init_args.aggregation", self.aggregation]
        if self.schedule != "in turn":
            engine = server_engine or '{class_path: amir_lightning.engines.VLLMServerEngine, init_args: ' \
                '{max_model_len: 64, kv_cache_memory_bytes: 33554432, threads: 1}}'  # fmt: skip
            args += ["--data.engine", engine, "--data.rollout.max_staleness", self.schedule[0]]
        if self.schedule == "2 ahead":
            args += ["--data.rollout.partial_rollouts", "true"]
        if self.processes == 2:
            args += ["--trainer.devices", "2", "--trainer.strategy", FSDP2]
        if self.lora != "none":
            args += ["--model.lora", f"{{r: {LORA_RANK}, alpha: 8}}"]
        if self.lora == "adapters":  # (a given server must serve adapters too)
            args += ["--data.engine.init_args.push_adapters", "true"]
        if self.episodes:
            args += ["--data.environment", "tools.Echo", "--data.environment.init_args.max_turns", str(MAX_TURNS)]
        if self.dynamic:
            args += ["--data.rollout.dynamic_sampling", "true", "--data.rollout.max_sampling_rounds", "2"]
        return args


def every_cell() -> list[Cell]:
    """The 144 cells."""
    grid = itertools.product(SCHEDULES, (1, 2), LORAS, (False, True), (False, True), AGGREGATIONS)
    return [Cell(*values) for values in grid]


def pairwise(cells: list[Cell]) -> list[Cell]:
    """Cells that between them hold every pair of values of two settings that some cell of ``cells`` holds.

    Greedy: each pick covers the most pairs not yet covered (ties: the first in grid order), until none is left.
    """

    def pairs(cell: Cell) -> set[tuple]:
        values = list(enumerate(asdict(cell).values()))
        return set(itertools.combinations(values, 2))

    uncovered = set().union(*(pairs(c) for c in cells))
    chosen = []
    while uncovered:
        best = max(cells, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


class Invariants(Callback):
    """Checks each step's normalisers and records each rollout's groups, per process, into ``out.rank<r>.json``.

    The step's normalisers (``RolloutStep.lengths``) are the policy's own tokens: the loss masks' sums, which leave
    out an environment's replies; dr_grpo's L is ``max_new_tokens`` x the episode's turns.
    """

    def __init__(self, out: str, episodes: bool = False) -> None:
        self.out, self.episodes = out, episodes
        self.groups: list[list] = []  # [rollout, prompt ids, [completion token ids]]
        self.replies = 0  # tokens of the environment's replies inside completions

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: D102
        steps = list(trainer.train_dataloader)
        rollout = next((s.rollout for s in steps if s.rollout is not None), None)
        for group in rollout.groups if rollout is not None else []:
            completions = [c.token_ids for c in group.completions]
            self.groups.append([trainer.current_epoch, list(group.prompt_ids), completions])
            self.replies += sum(len(c.token_ids) - c.policy_tokens for c in group.completions)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: D102
        real = [micro for micro in batch.micro_batches if not micro.filler]
        if not real:
            return
        masks = torch.cat([micro.completion_mask.sum(-1).float().cpu() for micro in real])
        if not torch.equal(masks, batch.lengths.float().cpu()):
            raise AssertionError(f"step {batch.index}: normalisers {batch.lengths.tolist()}, masks {masks.tolist()}")
        expected_l = MAX_NEW_TOKENS * (MAX_TURNS if self.episodes else 1)
        length = getattr(pl_module.loss, "max_completion_length", None)
        if pl_module.loss.aggregation == "dr_grpo" and length != expected_l:
            raise AssertionError(f"dr_grpo's L is {length}, not {expected_l}")

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: D102
        record = {"groups": self.groups, "replies": self.replies}
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def copied_groups(out: str, processes: int) -> list[str]:
    """Groups of one prompt whose completions are the same, over every rollout and process of a run."""
    seen: dict[tuple, str] = {}
    copies = []
    for rank in range(processes):
        record = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        for rollout, prompt, completions in record["groups"]:
            key = (tuple(prompt), json.dumps(completions))
            where = f"rank {rank} rollout {rollout + 1}"
            if key in seen:
                copies.append(f"{where} copies {seen[key]}")
            seen.setdefault(key, where)
    return copies


def reply_tokens(out: str, processes: int) -> int:
    """Tokens of an environment's replies inside the completions of a run, over its processes."""
    return sum(json.loads(Path(f"{out}.rank{rank}.json").read_text())["replies"] for rank in range(processes))


def train_and_resume(cell: Cell, folder: Path, engine: str | None, run: Callable[[list[str], Path], object]) -> dict:
    """Run ``cell`` uninterrupted, then resumed from its checkpoint after rollout 2; what the invariants found.

    ``run(args, folder)`` runs ``amir`` in ``folder`` (with this folder on PYTHONPATH) and raises if it fails.
    Returns ``rollouts`` (logged), ``verified`` (the fewest tensors a sync read back), ``probe_gap`` (the largest),
    ``copies`` (groups of one prompt sampled alike), ``replies`` (environment tokens left out of the normalisers) and
    ``differs`` (the first weight the resumed run ends with otherwise, ``None``: none).
    """
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = folder / "invariants"
    checks = ["--trainer.callbacks+=combinations.Invariants", "--trainer.callbacks.out", str(out)]
    checks += ["--trainer.callbacks.episodes", str(cell.episodes).lower()]
    args, runs = cell.args(engine), folder / "runs"
    run([*args, *checks, "--checkpoint.save_top_k", "-1", "--trainer.logger.init_args.name", "full"], folder)
    (cut,) = (runs / "full" / "version_0" / "checkpoints").glob("epoch=1-*")
    run([*args, "--trainer.logger.init_args.name", "part", "--ckpt_path", str(cut)], folder)
    scalars: dict[str, list[float]] = {}
    for events in sorted((runs / "full" / "version_0").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in accumulator.Scalars(tag))
    full, part = (load_file(runs / name / "version_0" / "policy" / "model.safetensors") for name in ("full", "part"))
    differs = next((key for key in full if key not in part or not full[key].equal(part[key])), None)
    return {
        "rollouts": len(scalars["rollout/reward_mean"]),
        "verified": min(scalars["rollout/sync_verified_tensors"]),
        "probe_gap": max(scalars["rollout/sync_logp_diff"]),
        "copies": copied_groups(str(out), cell.processes),
        "replies": reply_tokens(str(out), cell.processes),
        "differs": differs if full.keys() == part.keys() else "the weights' names",
    }
