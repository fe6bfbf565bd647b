"""Weight sync from the trainer into the rollout engine, verified on a probe sequence against measured numerics.

After every push the engine and the trainer score the same probe (a prompt, its reference answer and EOS); the
largest absolute difference of their log-probs is the sync gap. In float32 a correct engine agrees to ~1e-6. In
bf16 two correct implementations differ by their rounding: about 0.1 nat on a 3B model's probe, and more as the
policy sharpens (a tiny model learning from scratch: 0.001 at step 0, 0.015 twenty steps later). A fixed tolerance
either stops a correct run or misses a stale engine, so the tolerance is measured:

- The probe is fixed at the first sync and kept for the whole run (saved in checkpoints), so gaps compare.
- The first sync of a run measures the noise floor: at step 0 engine and trainer hold the same weights whether or
  not the push worked, so the gap is pure numerics. It must stay under ``calibration_limit``; more means they do
  not run the same model at all. The trainer's probe log-probs at that sync are kept as the reference.
- Every later sync must stay within ``max(min_tolerance, noise_factor * noise floor, drift_share * drift)``, where
  drift is how far the trainer's probe log-probs moved from the reference. An engine that ignores pushes still
  holds the reference weights, so its gap is the whole drift and it is stopped once that exceeds the noise; a
  correct engine's gap is rounding, far below the drift of a policy that has changed enough to sharpen.

``data.sync.tolerance`` set to a number replaces the measured tolerance; the other ``SyncSettings`` tune the
measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from amir_lightning.rollout.engine import RolloutEngine
from amir_lightning.validation import check_number, raise_errors


@dataclass
class SyncSettings:
    """How the weight sync is verified (``data.sync``).

    Attributes:
        tolerance: A fixed tolerance on the sync gap in nats; ``None`` measures it (module docstring).
        noise_factor: The measured tolerance is at least this many times the noise floor...
        drift_share: ...and this share of the trainer's drift since the first sync (a stale engine shows all of
            it)...
        min_tolerance: ...and never below this (float32 engines agree to ~1e-6).
        calibration_limit: A larger gap at the first sync, when engine and trainer hold the same weights, means
            they run different models or dtypes.
        probe_tokens: Answer tokens in the probe.
    """

    tolerance: float | None = None
    noise_factor: float = 4.0
    drift_share: float = 0.5
    min_tolerance: float = 1e-3
    calibration_limit: float = 1.0
    probe_tokens: int = 32

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "data.sync.tolerance", self.tolerance, gt=0, optional=True)
        check_number(errors, "data.sync.noise_factor", self.noise_factor, ge=1)
        check_number(errors, "data.sync.drift_share", self.drift_share, gt=0, lt=1)
        check_number(errors, "data.sync.min_tolerance", self.min_tolerance, gt=0)
        check_number(errors, "data.sync.calibration_limit", self.calibration_limit, gt=0)
        check_number(errors, "data.sync.probe_tokens", self.probe_tokens, ge=1)
        raise_errors(errors)


class StaleEngineError(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a sync: it would sample from old weights."""


class SyncCheck:
    """Pushes the policy into the engine and verifies it; holds the probe and the noise floor of the run.

    Args:
        settings: The tolerance, or how to measure it.
    """

    def __init__(self, settings: SyncSettings | None = None) -> None:
        self.settings = settings or SyncSettings()
        self.probe: tuple[list[int], list[int]] | None = None  # (prompt ids, completion ids)
        self.noise_floor: float | None = None
        self.reference: list[float] | None = None  # the trainer's probe log-probs at the first sync

    def set_probe(self, tokenizer, prompt_ids: list[int], answer: str) -> None:
        """Fix the probe (once per run): ``prompt_ids``, then the answer's first tokens and EOS."""
        if self.probe is None:
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"][: self.settings.probe_tokens]
            self.probe = (list(prompt_ids), answer_ids + [tokenizer.eos_token_id])

    def scores(self, module, engine: RolloutEngine) -> tuple[list[float], list[float]]:
        """The probe's log-probs under the engine and under the trainer."""
        prompt, completion = self.probe
        return engine.score(prompt, completion), module.score_tokens(prompt, completion)

    def gap(self, module, engine: RolloutEngine) -> float:
        """Largest absolute log-prob difference, engine against trainer, on the probe."""
        return max(abs(a - b) for a, b in zip(*self.scores(module, engine)))

    def push_and_verify(
        self, module, engine: RolloutEngine, reduce_max: Callable[[list[float]], list[float]] = list
    ) -> tuple[float, float]:
        """Load the module's weights into the engine, then check the probe gap; returns (gap, tolerance).

        ``reduce_max`` takes element-wise maxima over processes (every process checks its own engine, and all of
        them must agree on stopping). Raises ``StaleEngineError`` when the gap exceeds the tolerance.
        """
        if self.probe is None:
            raise RuntimeError("SyncCheck.set_probe must run before the first sync")
        with module.export_weights() as named:
            engine.load_weights(named)
        engine_logps, policy_logps = self.scores(module, engine)
        gap = max(abs(a - b) for a, b in zip(engine_logps, policy_logps))
        if self.reference is None:
            drift = 0.0
        else:
            drift = max(abs(a - b) for a, b in zip(policy_logps, self.reference))
        gap, drift = reduce_max([gap, drift])
        s = self.settings
        if s.tolerance is not None:
            tolerance, source = s.tolerance, f"data.sync.tolerance={s.tolerance}"
        elif self.noise_floor is None:
            self._calibrate(gap, policy_logps)
            tolerance, source = max(s.min_tolerance, s.noise_factor * gap), "calibration"
        else:
            tolerance = max(s.min_tolerance, s.noise_factor * self.noise_floor, s.drift_share * drift)
            source = (
                f"the largest of {s.noise_factor:g} x the noise floor {self.noise_floor:.3g} measured at the first "
                f"sync and {s.drift_share:g} x the {drift:.3g} nat the trainer's probe log-probs moved since then"
            )
        if not gap <= tolerance:  # also catches NaN
            raise StaleEngineError(
                f"rollout engine is stale: after the weight sync its log-probs on the probe differ from the trainer's "
                f"by {gap:.3g}, above the tolerance {tolerance:.3g} ({source}). The engine did not take the new "
                "weights (parameter names or dtypes differ?), so training would continue on rollouts from an old "
                "policy."
            )
        return gap, tolerance

    def _calibrate(self, gap: float, policy_logps: list[float]) -> None:
        limit = self.settings.calibration_limit
        if not gap <= limit:  # also catches NaN
            raise StaleEngineError(
                f"at the first weight sync the engine's log-probs on the probe differ from the trainer's by "
                f"{gap:.3g} nat although both hold the same weights (data.sync.calibration_limit {limit:g}): they do "
                "not run the same model. Check data.engine's dtype against trainer.precision and model.dtype, and "
                "that both load the same model; or set data.sync.tolerance to a number to accept the gap."
            )
        self.noise_floor, self.reference = gap, list(policy_logps)

    def state_dict(self) -> dict:
        """The probe, the noise floor and the reference log-probs (the tolerance comes from the configuration)."""
        return {"probe": self.probe, "noise_floor": self.noise_floor, "reference": self.reference}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved; older checkpoints without it recalibrate at the next sync."""
        probe = state.get("probe")
        self.probe = (list(probe[0]), list(probe[1])) if probe is not None else None
        self.noise_floor = state.get("noise_floor")
        self.reference = state.get("reference")
        if self.reference is None:
            self.noise_floor = None
