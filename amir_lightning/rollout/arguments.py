"""Checks of the rollout data module's arguments: every problem found, reported at once, naming its key."""

from __future__ import annotations

from amir_lightning.validation import check_number, raise_errors


def check_arguments(
    group_size: int,
    prompts_per_epoch: int,
    micro_batch_groups: int,
    steps_per_rollout: int,
    mu: int,
    val_size: int,
    val_samples: int,
    eval_samples: int,
    eval_ks: list[int],
    max_prompt_tokens: int,
    sync_tolerance: float | None,
) -> None:
    """Raise one ``ValueError`` listing every invalid ``data.*`` argument."""
    errors = []
    if group_size < 2:
        errors.append(f"data.group_size must be >= 2 (advantages and pairs compare completions), got {group_size}")
    for key, value in (
        ("prompts_per_epoch", prompts_per_epoch),
        ("micro_batch_groups", micro_batch_groups),
        ("steps_per_rollout", steps_per_rollout),
        ("mu", mu),
        ("val_size", val_size),
        ("val_samples", val_samples),
        ("eval_samples", eval_samples),
        ("max_prompt_tokens", max_prompt_tokens),
    ):
        if value < 1:
            errors.append(f"data.{key} must be >= 1, got {value}")
    if steps_per_rollout > prompts_per_epoch:
        errors.append(f"data.steps_per_rollout ({steps_per_rollout}) > data.prompts_per_epoch ({prompts_per_epoch})")
    if min(eval_ks) < 1 or max(eval_ks) > eval_samples:
        errors.append(f"data.eval_ks {eval_ks} must lie in [1, data.eval_samples={eval_samples}] for pass@k")
    check_number(errors, "data.sync_tolerance", sync_tolerance, gt=0, optional=True)
    raise_errors(errors)
