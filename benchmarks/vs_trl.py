"""Our optimisation step against TRL's GRPOTrainer on the same model, batch and loss (rollout excluded).

    python benchmarks/vs_trl.py [--groups 2] [--group-size 8] [--repeats 5]

Both sides take the same batch (chat-templated arithmetic prompts to the bundled SmolLM2-135M, left-padded; random
sampled-length completions, right-padded; the same advantages), the GRPO loss with ``loss_type="grpo"``, beta 0,
on-policy, and one AdamW step; only the optimisation step is timed, interleaved (median of ``--repeats``). TRL
computes token entropies in every step; ours is timed with and without ``model.scoring.entropy``. First both compute
the loss and the gradient norm on the same weights, which must agree. Needs ``trl`` (``pip install trl``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import add_step_arguments, interleaved, machine, median, steady_malloc  # noqa: E402
from step_time import make_groups  # noqa: E402

from amir_lightning.loop.batch import make_batch  # noqa: E402
from amir_lightning.models import BundledSmolLM2, HFModel  # noqa: E402
from amir_lightning.objectives import GRPOLoss  # noqa: E402
from amir_lightning.systems.module import AmirGRPOModule  # noqa: E402


def trl_trainer(model_dir, group_size: int, batch: int, max_completion: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir="/tmp/amir-vs-trl",
        per_device_train_batch_size=batch,
        num_generations=group_size,
        max_completion_length=max_completion,
        report_to=[],
        use_cpu=True,
        beta=0.0,
        loss_type="grpo",
        bf16=False,
        learning_rate=1e-12,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "1"}] * batch),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets; one micro-batch per step here
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-12)
    return trainer, optimizer


def trl_inputs(batch) -> dict:
    width = batch.completion_width
    return {
        "prompt_ids": batch.input_ids[:, :-width],
        "prompt_mask": batch.attention_mask[:, :-width],
        "completion_ids": batch.completion_ids,
        "completion_mask": batch.completion_mask.long(),
        "advantages": batch.advantages,
        "num_items_in_batch": batch.completion_mask.sum(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    args = parser.parse_args()
    steady_malloc()
    source = HFModel(args.model) if args.model else BundledSmolLM2()
    ours = AmirGRPOModule(policy=source, loss=GRPOLoss(aggregation="grpo"))
    ours.configure_model()
    groups = make_groups(ours, args.groups, args.group_size)
    batch = make_batch(groups, ours.policy.pad_token_id)  # one micro-batch, like TRL's
    rows, width = len(batch.rewards), batch.completion_width
    trainer, trl_optimizer = trl_trainer(ours.policy.model_dir, args.group_size, rows, width)
    our_optimizer = torch.optim.AdamW(ours.model.parameters(), lr=1e-12)
    inputs = trl_inputs(batch)

    def our_loss(entropy: bool) -> torch.Tensor:
        logps, _ = ours.policy.completion_logps(
            ours.model, batch.input_ids, batch.attention_mask, batch.completion_width, 1.0, entropy=entropy
        )
        return ours.loss(logps, batch.completion_mask, batch.advantages, batch.rewards, args.group_size).loss

    def step(loss_fn, model, optimizer) -> float:
        loss_fn().backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    with torch.no_grad():  # on-policy GRPO: the loss is -mean(advantage) = 0 up to rounding; the gradient is not
        ours_loss, trl_loss = float(our_loss(False)), float(trainer._compute_loss(trainer.model, inputs))
    ours_norm = step(lambda: our_loss(False), ours.model, our_optimizer)
    trl_norm = step(lambda: trainer._compute_loss(trainer.model, inputs), trainer.model, trl_optimizer)
    times = interleaved(
        {
            "ours (AmirGRPOModule + GRPOLoss)": lambda: step(lambda: our_loss(False), ours.model, our_optimizer),
            "ours, with token entropy": lambda: step(lambda: our_loss(True), ours.model, our_optimizer),
            "TRL GRPOTrainer._compute_loss": lambda: step(
                lambda: trainer._compute_loss(trainer.model, inputs), trainer.model, trl_optimizer
            ),
        },
        args.repeats,
    )
    import trl

    trl_time = median(times["TRL GRPOTrainer._compute_loss"])
    print(
        f"optimisation step, {len(batch.rewards)} sequences ({int(batch.attention_mask.sum())} tokens), "
        f"{type(source).__name__}, TRL {trl.__version__}, {machine()}, median of {args.repeats}"
    )
    print(
        f"same batch: loss ours {ours_loss:.3e} vs TRL {trl_loss:.3e}; gradient norm ours {ours_norm:.6f} vs TRL "
        f"{trl_norm:.6f} (relative difference {abs(ours_norm - trl_norm) / max(trl_norm, 1e-12):.2e})"
    )
    print("| implementation | step s | / TRL |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {median(ts):.3f} | {median(ts) / trl_time:.2f} |")
    print("\ntarget: ours <= 0.8x TRL")


if __name__ == "__main__":
    main()
