"""Full training step of AMIR-GRPO against GRPO on the same rollout batch of a real model, and the official cost.

    python benchmarks/step_time.py [--groups 2] [--group-size 8] [--repeats 5]
    python benchmarks/step_time.py --paper-shape [--model DIR] [--layers 2] [--skip-official]
    python benchmarks/step_time.py --materialised    # log-probs from materialised logits, for comparison
    python benchmarks/step_time.py --lengths 32 256 --micro-batch-groups 2 [--packing]    # padding against packing
    python benchmarks/step_time.py --paper-shape --attn varlen --packing [--no-checkpointing]    # on a GPU

One step = forward of every micro-batch, both loss terms, backward, gradient clipping, AdamW. The batch is the
same for all variants: chat-templated arithmetic prompts to the bundled SmolLM2-135M with sampled-length random
completions and rewards with variance. Variants, timed interleaved (median of ``--repeats``):
- GRPO: ``GRPOLoss``;
- AMIR-GRPO: ``AmirGRPOLoss`` (pair term on the same forward's log-probs; target AMIR / GRPO <= 1.03);
- official AMIR cost model: the GRPO step plus a re-forward of every mined pair's chosen and rejected
  sequences, two sequences per chunk as the official code, with the DPO loss backpropagated through them.

``--paper-shape`` times the qwen.yaml step instead: 4 groups x 8, 160-token prompts, completions of 128-512
tokens, LoRA r 16 on every linear layer over a bf16 base, float32 adapters, bf16 compute, gradient checkpointing,
micro-batches of one group, on the GPU when there is one (``--packing --attn varlen``: packed rows through
PyTorch's variable-length flash attention; ``--no-checkpointing``). The model is ``--model`` or a random one of
Qwen2.5-3B-Instruct's shape (``--layers`` shrinks it for a dry run on a CPU); it prints tokens/s and peak memory.
"""

from __future__ import annotations

import argparse

import torch
from _common import add_step_arguments, interleaved, machine, median, peak_rss_mb, steady_malloc

from amir_lightning.data import ArithmeticPrompts, render_prompt
from amir_lightning.engines.base import Completion
from amir_lightning.loop.batch import build_steps, plan_steps
from amir_lightning.loop.types import Group
from amir_lightning.models import QWEN25_3B_SHAPE, BundledSmolLM2, HFModel, LoraSettings, TinyModel
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages, mine_pairs, sequence_logps
from amir_lightning.objectives.amir import PairTermSettings, PairWeightSettings
from amir_lightning.systems.module import AmirGRPOModule


def make_groups(module, groups: int, group_size: int, seed: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    tok = module.policy.tokenizer
    source = ArithmeticPrompts(template="What is {expression}? Answer with just the number.")
    out = []
    for g in range(groups):
        prompt = render_prompt(tok, source[g])
        completions = []
        for _ in range(group_size):
            length = int(torch.randint(16, 48, (1,), generator=gen))
            low = min(100, len(tok) // 4)
            ids = torch.randint(low, len(tok) - low, (length,), generator=gen).tolist() + [tok.eos_token_id]
            completions.append(Completion(ids, "", [0.0] * len(ids), "stop"))
        rewards = torch.randint(0, 3, (group_size,), generator=gen).float()
        out.append(Group(prompt, completions, rewards, group_advantages(rewards, group_size), rewards.clone()))
    return out


def random_groups(module, groups: int, group_size: int, prompt_len: int, lengths: tuple[int, int]) -> list[Group]:
    """Random-token prompts and completions of the given lengths, rewards in {0, 0.7, 1.4, 2.1} (pairs form)."""
    gen = torch.Generator().manual_seed(0)
    vocab, eos = len(module.policy.tokenizer), module.policy.tokenizer.eos_token_id
    low = min(100, vocab // 4)
    out = []
    for _ in range(groups):
        prompt = torch.randint(low, vocab - low, (prompt_len,), generator=gen).tolist()
        completions = []
        for _ in range(group_size):
            n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
            ids = torch.randint(low, vocab - low, (n,), generator=gen).tolist() + [eos]
            completions.append(Completion(ids, "", [0.0] * len(ids), "stop"))
        rewards = torch.randint(0, 4, (group_size,), generator=gen).float() * 0.7
        out.append(Group(prompt, completions, rewards, group_advantages(rewards, group_size), rewards.clone()))
    return out


def paper_shape_module(
    model: str | None, layers: int | None, checkpointing: bool = True, attention: str | None = None
) -> AmirGRPOModule:
    """The qwen.yaml policy set-up on a given model, or on a random one of Qwen2.5-3B's shape."""
    shape = dict(QWEN25_3B_SHAPE, dtype="bfloat16", **({"num_layers": layers} if layers else {}))
    source = HFModel(model) if model else TinyModel(**shape)
    module = AmirGRPOModule(
        policy=source,
        dtype="bfloat16",
        gradient_checkpointing=checkpointing,
        lora=LoraSettings(r=16, alpha=16, target_modules="all-linear"),
        scoring=ScoringSettings(entropy=False, attn_implementation=attention),
    )
    module.compute_dtype = torch.bfloat16  # what trainer.precision=bf16-mixed sets
    module.configure_model()
    return module.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def synchronized(fn):
    """``fn`` followed by a CUDA synchronisation, so that wall time covers the GPU work."""

    def run() -> None:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return run


def step(module, optimizer, loss, rollout_step, official_pairs: bool = False) -> None:
    module.loss = loss
    context = module.step_context(rollout_step)
    for batch in rollout_step.micro_batches:
        out, _ = module.compute_loss(batch, context)
        out.loss.backward()
        if official_pairs:
            _official_pair_term(module, batch)
    torch.nn.utils.clip_grad_norm_(module.model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _official_pair_term(module, batch, chunk: int = 2, beta: float = 0.2, lam: float = 0.01) -> None:
    """The official implementation's pair term: chosen and rejected re-forwarded per pair, two rows at a time."""
    pairs = mine_pairs(batch.rewards, batch.group_size)  # [P, 2]
    rows = pairs.flatten()  # chosen, rejected, chosen, rejected, ...
    total = max(len(pairs), 1)
    for start in range(0, len(rows), chunk):
        index = rows[start : start + chunk]
        sub = batch.select(index)
        logps, _ = module.policy.completion_logps(
            module.model, sub.input_ids, sub.attention_mask, sub.completion_width, module.temperature
        )
        seq = sequence_logps(logps, sub.completion_mask, "mean")  # [chunk]
        if len(seq) == 2:
            (-lam * torch.nn.functional.logsigmoid(beta * (seq[0] - seq[1])) / total).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--skip-official", action="store_true")
    parser.add_argument("--paper-shape", action="store_true", help="the qwen.yaml step (module docstring)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the random paper-shape model")
    parser.add_argument(
        "--materialised",
        action="store_true",
        help="log-probs from materialised logits (model.scoring.fused_head false)",
    )
    parser.add_argument(
        "--lengths", type=int, nargs=2, default=None, help="random completions of LO..HI tokens (64-token prompts)"
    )
    parser.add_argument("--micro-batch-groups", type=int, default=1)
    parser.add_argument(
        "--packing", action="store_true", help="model.scoring.packing on: one row of real tokens, no padding"
    )
    parser.add_argument("--attn", default=None, help="model.scoring.attn_implementation (varlen: packed rows on a GPU)")
    parser.add_argument("--no-checkpointing", action="store_true", help="--paper-shape without gradient checkpointing")
    args = parser.parse_args()
    steady_malloc()
    if args.paper_shape:
        args.groups = 4
        module = paper_shape_module(args.model, args.layers, not args.no_checkpointing, args.attn)
        groups = random_groups(module, args.groups, args.group_size, 160, (128, 512))
        source = module.source
    else:
        source = HFModel(args.model) if args.model else BundledSmolLM2()
        module = AmirGRPOModule(policy=source, scoring=ScoringSettings(entropy=False))
        module.configure_model()
        if args.lengths:
            groups = random_groups(module, args.groups, args.group_size, 64, tuple(args.lengths))
        else:
            groups = make_groups(module, args.groups, args.group_size)
    module.policy.fused, module.policy.packed = not args.materialised, args.packing
    optimizer = torch.optim.AdamW([p for p in module.model.parameters() if p.requires_grad], lr=1e-12)
    (rollout_step,) = build_steps(plan_steps(groups, 1, args.micro_batch_groups), module.policy.pad_token_id)
    rollout_step = module.transfer_batch_to_device(rollout_step, module.device, 0)
    grpo, amir = (
        GRPOLoss(),
        AmirGRPOLoss(
            pair_term=PairTermSettings(margin=0.5), pair_weight=PairWeightSettings(value=0.01, schedule="fixed")
        ),
    )
    pairs = int(amir.step_context(rollout_step.lengths, rollout_step.rewards, args.group_size).num_pairs)
    functions = {
        "GRPO": synchronized(lambda: step(module, optimizer, grpo, rollout_step)),
        "AMIR-GRPO": synchronized(lambda: step(module, optimizer, amir, rollout_step)),
    }
    if not args.skip_official:
        official = synchronized(lambda: step(module, optimizer, grpo, rollout_step, official_pairs=True))
        functions["official AMIR cost model"] = official
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = interleaved(functions, args.repeats)
    tokens = sum(int(b.attention_mask.sum()) for b in rollout_step.micro_batches)
    padded = sum(b.attention_mask.numel() for b in rollout_step.micro_batches)
    base = median(times["GRPO"])
    setting = "paper shape: LoRA r16, bf16 compute, " if args.paper_shape else ""
    setting += "no grad ckpt, " if args.paper_shape and args.no_checkpointing else "grad ckpt, " * args.paper_shape
    setting += f"attention {module.model.config._attn_implementation}, "
    setting += "materialised log-probs, " if args.materialised else "fused log-probs, "
    setting += "packed (no padding), " if args.packing else f"padded ({1 - tokens / padded:.0%} of {padded} padding), "
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else machine()
    print(
        f"training step on {args.groups} groups x {args.group_size} = {args.groups * args.group_size} sequences "
        f"({tokens} tokens, {pairs} pairs), {setting}{type(source).__name__}, {device}, median of {args.repeats}"
    )
    print("| variant | step s | / GRPO | tokens/s | extra forwards |")
    print("|---|---|---|---|---|")
    extra = {"GRPO": "0", "AMIR-GRPO": "0", "official AMIR cost model": f"{2 * pairs} sequences"}
    for name, ts in times.items():
        print(f"| {name} | {median(ts):.2f} | {median(ts) / base:.3f} | {tokens / median(ts):.0f} | {extra[name]} |")
    print(f"\npeak RSS of this process: {peak_rss_mb():.0f} MiB")
    if torch.cuda.is_available():
        print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
