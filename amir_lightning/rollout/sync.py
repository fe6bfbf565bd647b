"""Weight sync from the trainer into the rollout engine, verified on a probe sequence against a measured noise floor.

After every push the engine and the trainer score the same probe (a prompt, its reference answer and EOS); the
largest absolute difference of their log-probs is the sync gap. In float32 a correct engine agrees to ~1e-6. In
bf16 two correct implementations differ by their rounding: about 0.1 nat on a 3B model's probe, so a fixed
tolerance either stops a correct run at step 0 or misses a stale engine. So the tolerance is calibrated:

- The probe is fixed at the first sync and kept for the whole run (saved in checkpoints), so gaps compare.
- The first sync of a run measures the noise floor: at step 0 engine and trainer hold the same weights whether or
  not the push worked, so the gap is pure numerics. It must stay under ``CALIBRATION_LIMIT``; more means they do
  not run the same model at all.
- Every later sync must stay within ``max(MIN_TOLERANCE, NOISE_FACTOR * noise floor)``. An engine that ignores
  pushes drifts away from the training policy as it learns, and is stopped once the drift exceeds that.

``data.sync_tolerance`` set to a number replaces the calibrated tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

from amir_lightning.rollout.engine import RolloutEngine

#: The calibrated tolerance is this many times the noise floor...
NOISE_FACTOR = 4.0
#: ...and never below this (float32 engines agree to ~1e-6).
MIN_TOLERANCE = 1e-3
#: A larger gap between engine and trainer holding the same weights means they run different models or dtypes.
CALIBRATION_LIMIT = 1.0
#: Answer tokens in the probe.
PROBE_TOKENS = 32


class StaleEngineError(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a sync: it would sample from old weights."""


class SyncCheck:
    """Pushes the policy into the engine and verifies it; holds the probe and the noise floor of the run.

    Args:
        tolerance: A fixed tolerance on the sync gap; ``None`` calibrates it (module docstring).
    """

    def __init__(self, tolerance: float | None = None) -> None:
        self.tolerance = tolerance
        self.probe: tuple[list[int], list[int]] | None = None  # (prompt ids, completion ids)
        self.noise_floor: float | None = None

    def set_probe(self, tokenizer, prompt_ids: list[int], answer: str) -> None:
        """Fix the probe (once per run): ``prompt_ids``, then the answer's first tokens and EOS."""
        if self.probe is None:
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:PROBE_TOKENS]
            self.probe = (list(prompt_ids), answer_ids + [tokenizer.eos_token_id])

    def gap(self, module, engine: RolloutEngine) -> float:
        """Largest absolute log-prob difference, engine against trainer, on the probe."""
        prompt, completion = self.probe
        engine_logps = engine.score(prompt, completion)
        policy_logps = module.score_tokens(prompt, completion)
        return max(abs(a - b) for a, b in zip(engine_logps, policy_logps))

    def push_and_verify(
        self, module, engine: RolloutEngine, reduce_max: Callable[[float], float] = float
    ) -> tuple[float, float]:
        """Load the module's weights into the engine, then check the probe gap; returns (gap, tolerance).

        ``reduce_max`` takes the maximum over processes (every process checks its own engine, and all of them must
        agree on stopping). Raises ``StaleEngineError`` when the gap exceeds the tolerance.
        """
        if self.probe is None:
            raise RuntimeError("SyncCheck.set_probe must run before the first sync")
        with module.export_weights() as named:
            engine.load_weights(named)
        gap = reduce_max(self.gap(module, engine))
        if self.tolerance is not None:
            tolerance = self.tolerance
            source = f"data.sync_tolerance={tolerance}"
        elif self.noise_floor is None:
            if not gap <= CALIBRATION_LIMIT:  # also catches NaN
                raise StaleEngineError(
                    f"at the first weight sync the engine's log-probs on the probe differ from the trainer's by "
                    f"{gap:.3g} nat although both hold the same weights (limit {CALIBRATION_LIMIT}): they do not run "
                    "the same model. Check data.engine's dtype against trainer.precision and model.dtype, and that "
                    "both load the same model; or set data.sync_tolerance to a number to accept the gap."
                )
            self.noise_floor = gap
            return gap, max(MIN_TOLERANCE, NOISE_FACTOR * gap)
        else:
            tolerance = max(MIN_TOLERANCE, NOISE_FACTOR * self.noise_floor)
            source = f"{NOISE_FACTOR:g} x the noise floor {self.noise_floor:.3g} measured at the first sync"
        if not gap <= tolerance:
            raise StaleEngineError(
                f"rollout engine is stale: after the weight sync its log-probs on the probe differ from the trainer's "
                f"by {gap:.3g}, above the tolerance {tolerance:.3g} ({source}). The engine did not take the new "
                "weights (parameter names or dtypes differ?), so training would continue on rollouts from an old "
                "policy."
            )
        return gap, tolerance

    def state_dict(self) -> dict:
        """The probe and the noise floor (the tolerance comes from the configuration)."""
        return {"probe": self.probe, "noise_floor": self.noise_floor}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved; older checkpoints without it recalibrate at the next sync."""
        probe = state.get("probe")
        self.probe = (list(probe[0]), list(probe[1])) if probe is not None else None
        self.noise_floor = state.get("noise_floor")
