"""Weight sync from the trainer into the rollout engine, verified with a probe sequence."""

from __future__ import annotations

from amir_lightning.rollout.engine import RolloutEngine


class StaleEngineError(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a sync: it would sample from old weights."""


def sync_and_verify(
    module, engine: RolloutEngine, probe_prompt: list[int], probe_answer: str, tolerance: float
) -> float:
    """Load the module's weights into the engine, then compare both log-probs of a probe completion.

    The probe is the prompt followed by the tokenised reference answer and EOS. Returns the largest absolute
    log-prob difference; raises ``StaleEngineError`` above ``tolerance``.
    """
    with module.export_weights() as named:
        engine.load_weights(named)
    tokenizer = module.tokenizer
    completion = tokenizer(probe_answer, add_special_tokens=False)["input_ids"][:32] + [tokenizer.eos_token_id]
    engine_logps = engine.score(probe_prompt, completion)
    policy_logps = module.score_tokens(probe_prompt, completion)
    diff = max(abs(a - b) for a, b in zip(engine_logps, policy_logps))
    if not diff <= tolerance:  # also catches NaN
        raise StaleEngineError(
            f"rollout engine is stale: after the weight sync its log-probs differ from the trainer's by {diff:.3g} "
            f"(data.sync_tolerance={tolerance}). The engine did not take the new weights (parameter names or "
            "dtypes differ?), so training would continue on rollouts from an old policy."
        )
    return diff
