"""Weight sync from the trainer into the rollout engine, verified exactly.

Every push is checked against what the engine reads back from itself (``RolloutEngine.held_weights``): each pushed
tensor is digested on its way to the engine, in the dtype the engine keeps it in (``engines/digest.py``), and after
the load every engine tensor must carry exactly the digest of what was pushed into it, each element at its place in
the engine's layout. So an engine that ignores a push, takes part of the tensors, applies part of an update, or puts
a weight in the wrong place (transposed, heads or fused parts exchanged, shards in another order) is stopped at the
first sync where its weights differ from the trainer's, with one line naming the first tensor that differs; a
correct engine is never stopped, in any dtype, however long the run. A pushed tensor the engine keeps no copy of,
or does not read back, cannot be compared: it is checked to stay what it was at the first sync (where the probe
calibrates the engine against the trainer), and one that changes stops the run, since its update may not reach the
engine.

The probe stays, as a measurement: after each push the engine and the trainer score the same probe (a prompt, its
reference answer and EOS), and the largest absolute difference of their log-probs is logged
(``rollout/sync_logp_diff``). In float32 a correct engine agrees to ~1e-6; in bf16 two correct implementations
differ by their rounding (about 0.1 nat on a 3B model's probe, growing as the policy sharpens), so the probe cannot
tell a stale engine from rounding and never stops a run after the first sync. At the first sync both sides hold
the same weights, so the gap there is pure numerics: above ``calibration_limit`` (0.1 nat for a float32 engine, 1.0
otherwise) the engine does not run the same model (another architecture reading, dtype or configuration), which is
an error. Later gaps above the warning level
(``data.sync.tolerance``, or ``noise_factor`` x the first gap) are logged as a warning.

An engine that cannot read its weights back (``held_weights`` returns ``None``) is checked by the probe alone, and
the run says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from amir_lightning.engines.adapters import adapter_mismatches
from amir_lightning.engines.base import RolloutEngine
from amir_lightning.engines.digest import ColumnSample, Digest, PushedDigests, PushStream, WeightLayout
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.policy import Policy

log = logging.getLogger(__name__)


@dataclass
class SyncSettings:
    """How the weight sync is verified (``data.sync``).

    Attributes:
        verify_weights: Compare the weights the engine holds after every push with the pushed ones, exactly
            (module docstring); off: the probe is the only check.
        kernel_columns: Columns of each weight that an engine keeps only packed in a kernel (vLLM on CPU) is read
            back on, a fresh random choice at every sync, every row of them exactly; ``null``: all columns (on one
            CPU thread about 1 s more per sync per 100M weights).
        tolerance: Probe gap (nats) above which a sync is reported as a warning; ``None``: ``noise_factor`` times
            the gap at the first sync, and at least ``min_tolerance``.
        noise_factor: See ``tolerance``.
        min_tolerance: See ``tolerance`` (float32 engines agree to ~1e-6).
        calibration_limit: A larger probe gap at the first sync, when engine and trainer hold the same weights,
            means they do not run the same model: an error. ``None``: 0.1 nat when the engine keeps every pushed
            tensor in float32 (correct float32 engines agree to ~1e-6), 1.0 otherwise (bf16 rounding differs more).
        probe_tokens: Answer tokens in the probe.
    """

    verify_weights: bool = True
    kernel_columns: int | None = 64
    tolerance: float | None = None
    noise_factor: float = 4.0
    min_tolerance: float = 1e-3
    calibration_limit: float | None = None
    probe_tokens: int = 32

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "data.sync.tolerance", self.tolerance, gt=0, optional=True)
        check_number(errors, "data.sync.noise_factor", self.noise_factor, ge=1)
        check_number(errors, "data.sync.min_tolerance", self.min_tolerance, gt=0)
        check_number(errors, "data.sync.calibration_limit", self.calibration_limit, gt=0, optional=True)
        check_number(errors, "data.sync.probe_tokens", self.probe_tokens, ge=1)
        check_number(errors, "data.sync.kernel_columns", self.kernel_columns, ge=1, optional=True)
        raise_errors(errors)


class StaleEngineError(RuntimeError):
    """After a sync the engine holds other weights than the trainer pushed: it would sample from a wrong policy."""


@dataclass
class SyncReport:
    """What one sync measured.

    Attributes:
        gap: Largest absolute probe log-prob difference, engine against trainer (over processes).
        tolerance: The warning level of ``gap``.
        verified: Engine tensors (and adapter slices) compared with the push (0 when the engine cannot read back).
        pushed_bytes: What this process pushed, in the dtypes it sent.
        copies: The engine's copies of the weights read back and scored (its replicas: ``RolloutEngine.copies``).
    """

    gap: float
    tolerance: float
    verified: int
    pushed_bytes: int = 0
    copies: int = 1

    def metrics(self) -> dict[str, float]:
        """As logged: ``rollout/sync_logp_diff``, ``_tolerance``, ``_verified_tensors``, ``_mib``, ``_copies``."""
        return {
            "rollout/sync_logp_diff": self.gap,
            "rollout/sync_tolerance": self.tolerance,
            "rollout/sync_verified_tensors": float(self.verified),
            "rollout/sync_mib": self.pushed_bytes / 2**20,
            "rollout/sync_copies": float(self.copies),
        }


class SyncCheck:
    """Pushes the policy into the engine and verifies it; holds the probe and its first gap for the run.

    Args:
        settings: How the sync is verified.
    """

    def __init__(self, settings: SyncSettings | None = None) -> None:
        self.settings = settings or SyncSettings()
        self.probe: tuple[list[int], list[int]] | None = None  # (prompt ids, completion ids)
        self.noise_floor: float | None = None  # the probe gap at the first sync
        self.syncs = 0
        self._layout: WeightLayout | None = None
        self._warned_at = 0.0  # the probe gap of the last warning
        self._said_unverified = False
        self._said_unread = False
        self._base_pushed = False  # an engine that takes adapters holds the trainer's base weights (not saved)
        self._bytes = 0
        # pushed names the engine cannot show it holds -> their digest at the first sync (None: no sync yet)
        self._unchecked: dict[str, Digest] | None = None

    def set_probe(self, tokenizer, prompt_ids: list[int], answer: str) -> None:
        """Fix the probe (once per run): ``prompt_ids``, then the answer's first tokens and EOS."""
        if self.probe is None:
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"][: self.settings.probe_tokens]
            self.probe = (list(prompt_ids), answer_ids + [tokenizer.eos_token_id])

    def scores(self, policy: Policy, engine: RolloutEngine) -> tuple[list[float], list[float]]:
        """The probe's log-probs under the engine and under the trainer."""
        prompt, completion = self.probe
        return engine.score(prompt, completion), policy.score_tokens(prompt, completion)

    def gap(self, policy: Policy, engine: RolloutEngine) -> float:
        """Largest absolute log-prob difference, engine against trainer, on the probe."""
        return max(abs(a - b) for a, b in zip(*self.scores(policy, engine)))

    def push_and_verify(
        self,
        policy: Policy,
        engine: RolloutEngine,
        reduce_max: Callable[[list[float]], list[float]] = list,
        version: int = 0,
    ) -> SyncReport:
        """Load the policy's weights into the engine, then check what it holds and measure the probe gap.

        ``version``: the weight version pushed (the optimisation step), which the engine labels tokens with.

        ``reduce_max`` takes element-wise maxima over processes (each process checks its own engine, and all of them
        must agree on stopping). Raises ``StaleEngineError`` naming the first engine tensor that differs from the
        push (or, at the first sync, when the probe shows another model).
        """
        if self.probe is None:
            raise RuntimeError("SyncCheck.set_probe must run before the first sync")
        adapters = getattr(engine, "takes_adapters", False)  # RolloutEngine says; a duck-typed engine does not
        whole = not (adapters and self._base_pushed)  # the weights themselves, merged or (adapters apart) the base
        self._bytes = 0
        pushed = self._push(policy, engine, version, merged=not adapters) if whole else None
        wrong: list[str] = []
        verified = checked = 0  # tensors compared with the push; and every engine tensor the check looked at
        copies = engine.copies() if hasattr(engine, "copies") else [("", engine)]  # a duck-typed engine: itself
        for name, copy in copies if pushed is not None else []:  # each replica of the weights, read back
            held = copy.held_weights(pushed.columns)
            if held is None:
                pushed = None
                break
            found = pushed.mismatches(held) + self._changed_unchecked(pushed, held)
            wrong += [f"{name}: {w}" if name else w for w in found]
            verified, checked = verified + pushed.compared(held), checked + len(set(pushed.parts) | set(held))
            self._say_unread(pushed.unread(held))
        if pushed is None and whole:
            self._say_unverified(engine)
        if adapters:
            self._base_pushed = True
            adapters_pushed = self._push_adapters(policy, engine)
            for name, copy in copies if adapters_pushed is not None else []:
                adapter_wrong, compared = adapter_mismatches(adapters_pushed, copy.held_adapters(), self._layout)
                wrong += [f"{name}: {w}" if name else w for w in adapter_wrong]
                verified, checked = verified + compared, checked + compared + len(adapter_wrong)
        # Every process learns whether any engine is wrong before any scores the probe: under FSDP2 the policy's
        # forward is a collective, so one process skipping it (its engine wrong) left the others waiting in it.
        (any_wrong,) = reduce_max([float(bool(wrong))])
        self.syncs += 1
        if any_wrong:
            self._stop(wrong, checked)
        prompt, completion = self.probe
        trainer = policy.score_tokens(prompt, completion)  # a collective under FSDP2: once, on every process
        gaps = [max(abs(a - b) for a, b in zip(copy.score(prompt, completion), trainer)) for _, copy in copies]
        (gap,) = reduce_max([max(gaps)])
        float32 = pushed is not None and pushed.dtypes == {torch.float32}
        level = self._probe_level(gap, verified > 0, float32)
        return SyncReport(gap, level, verified, self._bytes, len(copies))

    def _push(self, policy: Policy, engine: RolloutEngine, version: int, merged: bool = True) -> PushedDigests | None:
        """Stream the policy's weights into the engine, digesting them on the way (unless the check is off).

        ``merged`` off: the base weights alone, for an engine that takes the adapters apart.
        """
        if self.settings.verify_weights and self._layout is None:
            self._layout = engine.weight_layout()
        columns = ColumnSample(self.syncs, self.settings.kernel_columns)
        watched = set(self._unchecked) if self._unchecked is not None else None
        verify = self.settings.verify_weights and self._layout
        pushed = PushedDigests(self._layout, columns, watched) if verify else None
        with policy.export_weights() if merged else policy.export_weights(merged=False) as named:
            stream = PushStream(named, pushed)
            engine.load_weights(stream, version)
            for _ in stream:  # what the engine did not read still counts as pushed
                pass
        self._bytes += stream.bytes
        if pushed is not None and pushed.unheld and self.syncs == 0:
            log.info("weight sync: the engine keeps no copy of %s: checked to stay as first pushed",
                     ", ".join(pushed.unheld[:8]))  # fmt: skip
        return pushed

    def _changed_unchecked(self, pushed: PushedDigests, held: dict) -> list[str]:
        """The pushed tensors the engine cannot show it holds that changed since the first sync, described.

        The first sync records them (the probe calibrates the engine against the trainer there): a frozen weight
        the engine does not hold passes every sync, a trained one stops the run at its first change.
        """
        names = pushed.unchecked(held)
        if self._unchecked is None:
            self._unchecked = {name: pushed.fingerprints[name] for name in names}
        return [
            f"{name}, which the engine keeps no copy of that it reads back, changed since the first sync (its update "
            "cannot be verified)"
            for name, first in self._unchecked.items()
            if name in pushed.fingerprints and pushed.fingerprints[name] != first
        ]

    def _push_adapters(self, policy: Policy, engine: RolloutEngine) -> dict[str, torch.Tensor] | None:
        """Push the policy's LoRA factors; what was pushed, to compare with each copy's (``None``: not compared)."""
        adapters = policy.export_adapters()
        engine.load_adapters(adapters, policy.lora.r)
        self._bytes += sum(t.numel() * t.element_size() for t in adapters.values())
        if not self.settings.verify_weights or self._layout is None:
            return None
        return adapters

    def _stop(self, wrong: list[str], checked: int) -> None:
        where = "this process's engine" if wrong else "the engine of another process"
        first = f"; the first: {wrong[0]}" if wrong else ""
        raise StaleEngineError(
            f"rollout engine is stale: after weight sync {self.syncs} {where} holds other weights than the trainer "
            f"pushed ({len(wrong) or 'some'} of {checked or 'its'} tensors differ, read back from the engine{first}). "
            "It did not take the update as pushed, so training would continue on rollouts from another policy. Check "
            "that the engine loads every pushed tensor (parameter names, dtypes, a custom load_weights)."
        )

    def _probe_level(self, gap: float, verified: bool, float32: bool) -> float:
        """The probe gap's warning level; the first sync measures the noise floor (and refuses another model)."""
        s = self.settings
        if self.noise_floor is None:
            limit = s.calibration_limit if s.calibration_limit is not None else (0.1 if float32 else 1.0)
            if not gap <= limit:  # also catches NaN
                raise StaleEngineError(
                    f"at the first weight sync the engine's log-probs on the probe differ from the trainer's by "
                    f"{gap:.3g} nat although both hold the same weights (data.sync.calibration_limit {limit:g}): "
                    "they do not run the same model. Check data.engine's dtype against trainer.precision and "
                    "model.dtype, and that both load the same model and configuration."
                )
            self.noise_floor = gap
        level = s.tolerance if s.tolerance is not None else max(s.min_tolerance, s.noise_factor * self.noise_floor)
        if gap > level and gap >= 2 * self._warned_at:
            self._warned_at = gap
            unchecked = " (those it cannot read back are as first pushed)" if self._unchecked else ""
            weights = (
                "every pushed tensor reads back from the engine as pushed (values and places in the layout the engine "
                f"reports){unchecked}, so the difference is in how it computes with them"
                if verified
                else "the weights themselves are not compared"
            )
            log.warning(
                "weight sync %d: the engine's probe log-probs differ from the trainer's by %.3g nat (warning level "
                "%.3g, data.sync.tolerance): their numerics drift apart; %s",
                self.syncs,
                gap,
                level,
                weights,
            )
        return level

    def _say_unread(self, unread: list[str]) -> None:
        if unread and not self._said_unread:
            self._said_unread = True
            log.warning(
                "weight sync: the engine did not read back %s: not compared with the push", ", ".join(unread[:8])
            )

    def _say_unverified(self, engine: RolloutEngine) -> None:
        if not self._said_unverified:
            self._said_unverified = True
            why = "data.sync.verify_weights is off" if not self.settings.verify_weights else "it cannot read them back"
            log.warning(
                "weight sync: the weights %s holds are not compared with the pushed ones (%s); only the probe "
                "log-probs are measured",
                type(engine).__name__,
                why,
            )

    def state_dict(self) -> dict:
        """The probe and the noise floor (the settings come from the configuration)."""
        unchecked = None if self._unchecked is None else {k: [d.mixed, d.plain] for k, d in self._unchecked.items()}
        return {"probe": self.probe, "noise_floor": self.noise_floor, "syncs": self.syncs, "unchecked": unchecked}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        probe = state.get("probe")
        self.probe = (list(probe[0]), list(probe[1])) if probe is not None else None
        self.noise_floor = state.get("noise_floor")
        self.syncs = int(state.get("syncs", 0))
        unchecked = state.get("unchecked")
        self._unchecked = None if unchecked is None else {k: Digest(*v) for k, v in unchecked.items()}
