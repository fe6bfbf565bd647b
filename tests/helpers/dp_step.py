"""One optimisation step of AmirGRPOModule on fixed rollouts, for each of several settings in turn, on 1 or 2 CPU
processes (one launch for all of them); rank 0 saves each run's policy as OUT_DIR/NAME.pt.

    python tests/helpers/dp_step.py MODEL_DIR OUT_DIR --devices 2 \
        --runs '[{"name": "dapo", "strategy": "ddp", "aggregation": "dapo", "loss": "amir"},
                 {"name": "clip", "strategy": "fsdp2", "max_grad_norm": 0.05},
                 {"name": "uneven", "uneven": true, "micro_batch_tokens": 30, "packing": "on"}]'

The global batch is the same whatever the number of processes: 4 groups of 4 completions, split into equal
per-process shares of whole groups (``uneven``: 3 groups on rank 0, 1 on rank 1; a number: that many on rank 0, the
rest on rank 1), each process accumulating over
micro-batches of one group (or of ``micro_batch_tokens``), agreed over processes as the data module does. Every
run prints, per rank, its micro-batches per step and its log-prob forwards by path (``run NAME, rank R: ...``).
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from amir_lightning.engines.base import Completion
from amir_lightning.helpers.distributed import all_reduce
from amir_lightning.loop.batch import agree_on_plan, build_steps, plan_steps
from amir_lightning.loop.types import Group
from amir_lightning.models import HFModel, LoraSettings
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages
from amir_lightning.objectives.amir import PairWeightSettings
from amir_lightning.systems.module import AmirGRPOModule

G, GROUPS = 4, 4


def fixed_groups(tokenizer):
    gen = torch.Generator().manual_seed(0)
    eos, groups = tokenizer.eos_token_id, []
    for text in ["3=", "12+4=", "7*8-1=", "9="][:GROUPS]:
        prompt = tokenizer(text)["input_ids"]
        completions = []
        for _ in range(G):
            length = int(torch.randint(1, 7, (1,), generator=gen))
            ids = torch.randint(3, 20, (length,), generator=gen).tolist() + [eos]
            completions.append(Completion(ids, "", [0.0] * len(ids), "stop"))
        rewards = torch.randint(0, 3, (G,), generator=gen).float()
        groups.append(Group(prompt, completions, rewards, group_advantages(rewards, G), rewards.clone()))
    return groups


class FixedRollouts(L.LightningDataModule):
    def __init__(self, uneven: bool | int = False, micro_batch_tokens: int | None = None):
        super().__init__()
        self.uneven, self.micro_batch_tokens = uneven, micro_batch_tokens

    def train_dataloader(self):
        module = self.trainer.lightning_module
        groups = fixed_groups(module.policy.tokenizer)
        world, rank = self.trainer.world_size, self.trainer.global_rank
        cut = 3 if self.uneven is True else int(self.uneven)
        bounds = [0, cut, GROUPS] if self.uneven and world == 2 else [GROUPS * r // world for r in range(world + 1)]
        mine = groups[bounds[rank] : bounds[rank + 1]]

        def max_over_processes(values):
            return all_reduce(torch.tensor(values), "max").tolist()

        plan = agree_on_plan(plan_steps(mine, 1, 1, self.micro_batch_tokens), 1, max_over_processes)
        self.micro_batches = [len(step) for step in plan]
        batches = build_steps(plan, module.policy.pad_token_id, filler=groups[0])
        return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def count_logprob_paths() -> dict[str, int]:
    """Counts the policy forwards by log-prob path (packed, fused or materialised) from here on."""
    from amir_lightning.models import scoring

    counts = {"packed": 0, "fused": 0, "materialised": 0}
    original, packed = scoring.completion_logps, scoring._packed_completion_logps

    def counting(model, input_ids, attention_mask, width, temperature=1.0, chunk=512, entropy=False, fused=True,
                 packing=False):  # fmt: skip
        head = scoring.fused_head(model) if fused else None
        if head is None:
            counts["materialised"] += 1
        elif not packing:
            counts["fused"] += 1
        return original(model, input_ids, attention_mask, width, temperature, chunk, entropy, fused, packing)

    def counting_packed(*args, **kwargs):
        counts["packed"] += 1
        return packed(*args, **kwargs)

    import amir_lightning.models.policy as policy_file

    policy_file.completion_logps = counting
    scoring._packed_completion_logps = counting_packed
    return counts


#: A run's settings and their defaults (strategy ``ddp`` or ``fsdp2``, ``auto`` on one process).
DEFAULTS = {"strategy": "ddp", "aggregation": "grpo", "loss": "amir", "max_grad_norm": None, "uneven": False,
            "micro_batch_tokens": None, "packing": "auto", "kl_coef": 0.0, "lora": False}  # fmt: skip


def one_run(model_dir: str, devices: int, run: dict, paths: dict[str, int]) -> dict[str, torch.Tensor]:
    settings = {**DEFAULTS, **{k: v for k, v in run.items() if k != "name"}}
    torch.manual_seed(0)
    if settings["loss"] == "amir":
        pair_weight = PairWeightSettings(value=0.5, max=1.0, schedule="fixed")
        loss = AmirGRPOLoss(aggregation=settings["aggregation"], pair_weight=pair_weight, kl_coef=settings["kl_coef"])
    else:
        loss = GRPOLoss(aggregation=settings["aggregation"], kl_coef=settings["kl_coef"])
    module = AmirGRPOModule(
        policy=HFModel(model_dir),
        loss=loss,
        lora=LoraSettings(r=4, alpha=8) if settings["lora"] else None,
        max_grad_norm=settings["max_grad_norm"],
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        scoring=ScoringSettings(entropy=False, packing=settings["packing"]),
    )
    strategy = settings["strategy"]
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy()  # its default mesh is tensor-parallel; the module shards over all ranks
    elif devices == 1:
        strategy = "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
    )
    data = FixedRollouts(settings["uneven"], settings["micro_batch_tokens"])
    for path in paths:
        paths[path] = 0
    # the first run of 2 launches the second process (Lightning's launcher re-runs this script); later runs, and
    # every run there, find the process group made
    trainer.fit(module, data)
    rank = trainer.global_rank
    print(f"run {run['name']}, rank {rank}: micro-batches per step {data.micro_batches}", flush=True)
    print(f"run {run['name']}, rank {rank}: log-prob forwards {dict(sorted(paths.items()))}", flush=True)
    from amir_lightning.models.loading import full_state_dict

    state = {k: v.detach().cpu().clone() for k, v in full_state_dict(module.model).items()}
    return state if trainer.is_global_zero else {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--runs", type=json.loads, required=True, help="a JSON list of runs: name and settings")
    args = parser.parse_args()
    paths = count_logprob_paths()
    for run in args.runs:
        state = one_run(args.model_dir, args.devices, run, paths)
        if state:
            torch.save(state, Path(args.out_dir) / f"{run['name']}.pt")


if __name__ == "__main__":
    main()
