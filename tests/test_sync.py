"""The exact weight-sync check: digests, and real engines that take pushes wrong, each stopped at its first wrong sync.

The faulty engines (``helpers/engines.py``) are the real ``VLLMEngine`` and ``HFEngine`` with a broken
``load_weights``. The "trainer" is a float32 transformers copy of the tiny policy, moved by a random step before every
sync, as an optimiser moves it.
"""

import logging
from contextlib import contextmanager

import pytest
import torch
from helpers.engines import (
    HFDropsHalf,
    HFForgetsOne,
    HFIgnoresPushesAfter,
    HFLayoutFault,
    HFPartialUpdate,
    VLLMDropsHalf,
    VLLMIgnoresPushesAfter,
    VLLMPartialUpdate,
    VLLMSwapsParts,
    perturb,
)

from amir_lightning.engines import HFEngine, VLLMEngine
from amir_lightning.engines.base import RolloutEngine
from amir_lightning.engines.digest import ColumnSample, Digest, Place, PushedDigests, Reading, WeightSlot, tensor_digest
from amir_lightning.engines.hf import _NamedLayout
from amir_lightning.loop.sync import StaleEngineError, SyncCheck, SyncSettings
from amir_lightning.models import build_tiny_model


# ---------------------------------------------------------------------------------------------------- digests
def test_a_digest_adds_over_fused_parts_and_shards_at_their_places_and_ignores_zero_padding():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 4, generator=gen) for rows in (8, 2, 2))
    fused = torch.cat([q, k, v])  # vLLM's qkv_proj
    assert tensor_digest(fused) == tensor_digest(q) + tensor_digest(k, Place(8)) + tensor_digest(v, Place(10))
    assert tensor_digest(torch.cat([fused, torch.zeros(6, 4)])) == tensor_digest(fused)  # vocabulary padding
    zeros, cols = torch.tensor([[-0.0, 1.0]]), torch.tensor([0, 1])
    assert tensor_digest(zeros) != tensor_digest(zeros.abs())  # whole: the sign of a zero counts
    assert tensor_digest(zeros, columns=cols) == tensor_digest(zeros.abs(), columns=cols)  # read through a kernel
    w = torch.randn(6, 8, generator=gen)  # a row-parallel weight in two shards of columns
    assert tensor_digest(w) == tensor_digest(w[:, :4], Place(0, 0, 8)) + tensor_digest(w[:, 4:], Place(0, 4, 8))
    cols = torch.tensor([1, 6])  # a kernel's sampled columns, read back as W[:, cols].T and placed back
    assert tensor_digest(w[:, cols], Place(width=8), cols) == tensor_digest(w[:, cols].T.T, Place(width=8), cols)
    assert tensor_digest(w[:, cols], Place(width=8), cols) != tensor_digest(w[:, cols])


def _negated(x):
    return -x


def _two_negated(x):
    y = x.clone().reshape(-1)
    y[[3, 7]] = -y[[3, 7]]
    return y.reshape(x.shape)


# Each is a weight in the wrong place or with the wrong sign; an order-free digest of (sum b, sum b^2) misses all.
MISPLACED = {
    "transposed": lambda x: x.T.contiguous(),
    "rows reversed (heads in another order)": lambda x: x.flip(0),
    "rotary rows interleaved": lambda x: torch.cat([x[0::2], x[1::2]]),
    "k and v exchanged": lambda x: torch.cat([x[:8], x[12:], x[8:12]]),
    "shards in another order": lambda x: torch.cat([x[:, 8:], x[:, :8]], 1),
    "negated": _negated,
    "two elements negated": _two_negated,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fault", list(MISPLACED), ids=list(MISPLACED))
def test_a_digest_sees_a_weight_in_the_wrong_place_or_sign(fault, dtype):
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert tensor_digest(MISPLACED[fault](x)) != tensor_digest(x)


def test_a_digest_sees_one_changed_bit_and_differences_that_cancel_in_a_plain_sum():
    x = torch.randn(1000)
    flipped = x.clone()
    flipped.view(torch.int32)[500] ^= 1  # the last bit of one element
    assert tensor_digest(flipped) != tensor_digest(x)
    # two elements whose bit patterns move by +1 and -1: the plain sum of bits is unchanged, the mixed one is not
    a = torch.tensor([1.0, 2.0])
    b = a.clone()
    b.view(torch.int32)[0] += 1
    b.view(torch.int32)[1] -= 1
    assert tensor_digest(b).plain == tensor_digest(a).plain and tensor_digest(b) != tensor_digest(a)


def test_a_slot_digests_in_the_engines_dtype_at_its_part_row_and_through_a_narrower_load_dtype():
    x = torch.randn(64) * 1e-3
    assert WeightSlot("w", "", torch.bfloat16).digests(x) == (tensor_digest(x.to(torch.bfloat16)),)
    direct, through = WeightSlot("b", "", torch.float32, torch.bfloat16).digests(x)
    assert direct == tensor_digest(x) and through == tensor_digest(x.to(torch.bfloat16).float()) != direct
    assert WeightSlot("b", "v_proj", torch.float32, row=80).digests(x) == (tensor_digest(x, Place(80)),)
    assert Digest(2**32 - 1, 1) + Digest(1, 1) == Digest(0, 2)  # sums wrap at 32 bits


def test_kernel_columns_are_a_fresh_reproducible_choice_at_every_sync():
    first, again, next_sync = ColumnSample(3, 8).pick(576), ColumnSample(3, 8).pick(576), ColumnSample(4, 8).pick(576)
    assert torch.equal(first, again) and not torch.equal(first, next_sync)
    assert len(first) == 8 and torch.equal(first, first.sort().values) and int(first.max()) < 576
    assert torch.equal(ColumnSample(3, None).pick(10), torch.arange(10))
    x = torch.randn(4, 576)
    slot = WeightSlot("w", "", torch.float32, kernel=True)
    assert slot.digests(x, ColumnSample(3, 8)) == (tensor_digest(x[:, first], Place(width=576), first),)


def test_a_pushed_tensor_the_engine_does_not_read_back_is_named_and_only_compared_tensors_count():
    x, y = torch.randn(4, 4), torch.randn(4)
    pushed = PushedDigests(_NamedLayout({"a": torch.float32, "b": torch.float32}), ColumnSample(0, None))
    pushed.add("a", x)
    pushed.add("b", y)
    held = {"a": [Reading(tensor_digest(x))], "c": [Reading(tensor_digest(y))]}
    assert pushed.mismatches(held) == ["c, which no pushed tensor fills"]
    assert pushed.unread(held) == ["b"]  # said in a warning, never skipped silently
    assert pushed.compared(held) == 1  # "a": "c" is a reading but no pushed tensor, "b" a pushed tensor unread
    assert pushed.mismatches({"a": [Reading(tensor_digest(x))], "b": [Reading(tensor_digest(y))]}) == []


# ---------------------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2)


class Trainer:
    """What ``SyncCheck`` needs from the module: float32 weights to push and the probe's log-probs."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    @contextmanager
    def export_weights(self):
        yield list(self.policy.state_dict().items())

    @torch.no_grad()
    def score_tokens(self, prompt, completion):
        ids = torch.tensor([prompt + completion])
        logits = self.policy(ids).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist()


def make_engine(cls, dtype, **kwargs):
    if issubclass(cls, VLLMEngine):
        return cls(dtype=dtype, max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False, **kwargs)
    return cls(dtype=dtype, progress=False, **kwargs)


def syncs_until_stopped(engine, trainer, syncs, settings=None, errors=None):
    """Push, verify, take an optimiser step, ``syncs`` times; the 1-based sync that stopped (its message appended to
    ``errors``), or None."""
    check = SyncCheck(settings)
    check.set_probe(trainer.tokenizer, trainer.tokenizer("3+4=")["input_ids"], "7")
    for sync in range(1, syncs + 1):
        try:
            check.push_and_verify(trainer, engine)
        except StaleEngineError as err:
            (errors if errors is not None else []).append(str(err))
            return sync
        perturb(trainer.policy, 0.01, seed=sync)
    return None


# The first sync whose pushed weights the engine does not hold. Ignoring pushes after the third: the fourth (the
# policy moved since the third). A partial update: the second (the first push equals the engine's initial weights).
# Dropping half of the tensors: the second for HFEngine; the first for vLLM, whose reload rebuilds a layer that
# received only some of its tensors (its probe shows it: test_vllm_engine_fed_half_of_the_tensors_is_wrong_at_once).
# A weight loaded in the wrong place or sign: the first, and the tensor it names is the one misplaced.
FAULTS = [
    (HFIgnoresPushesAfter, {}, 4, "model."),
    (HFDropsHalf, {}, 2, "model."),
    (HFPartialUpdate, {}, 2, "model."),
    (HFLayoutFault, {"fault": "transposed_q"}, 1, "q_proj.weight"),
    (HFLayoutFault, {"fault": "reversed_heads"}, 1, "q_proj.weight"),
    (HFLayoutFault, {"fault": "rotary_interleaved"}, 1, "q_proj.weight"),
    (HFLayoutFault, {"fault": "negated_down"}, 1, "down_proj.weight"),
    (VLLMIgnoresPushesAfter, {}, 4, "model."),
    (VLLMDropsHalf, {}, 1, ""),  # its probe or its read-back, whichever sees the half-rebuilt layers first
    (VLLMPartialUpdate, {}, 2, "model."),
    (VLLMSwapsParts, {"parts": "kv"}, 1, "qkv_proj.weight"),
    (VLLMSwapsParts, {"parts": "gate_up"}, 1, "gate_up_proj.weight"),
]
FAULT_IDS = [f"{c.__name__}-{'-'.join(map(str, k.values()))}" if k else c.__name__ for c, k, _, _ in FAULTS]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("engine_cls", "kwargs", "first_wrong", "names"), FAULTS, ids=FAULT_IDS)
def test_a_faulty_engine_is_stopped_at_its_first_wrong_sync(tiny_dir, engine_cls, kwargs, first_wrong, names, dtype):
    engine = make_engine(engine_cls, dtype, **kwargs)
    engine.start(tiny_dir, seed=0)
    errors = []
    try:
        assert syncs_until_stopped(engine, Trainer(tiny_dir), syncs=6, errors=errors) == first_wrong
        assert "holds other weights than the trainer pushed" in errors[0] or engine_cls is VLLMDropsHalf, errors
        assert names in errors[0].partition("the first: ")[2], errors
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("in_layout", [False, True], ids=["no copy", "not read back"])
def test_a_tensor_the_engine_neither_loads_nor_reads_back_stops_the_run_when_it_changes(tiny_dir, in_layout):
    """The engine drops model.norm.weight from every push and does not read it back (it says it keeps no copy of
    it, or says where but does not read it): frozen, it passes 4 syncs (it is what the first sync calibrated);
    trained, the sync after its first change stops the run naming it. Before, it passed every sync (5 syncs, probe
    gap up to 0.156), and the probe's warnings said every pushed tensor read back as pushed."""
    trainer = Trainer(tiny_dir)
    engine = HFForgetsOne(in_layout=in_layout, progress=False)
    engine.start(tiny_dir, seed=0)
    check = SyncCheck()
    check.set_probe(trainer.tokenizer, trainer.tokenizer("3+4=")["input_ids"], "7")
    norm = trainer.policy.model.norm.weight
    for seed in range(1, 5):  # the other weights train, the norm stays
        check.push_and_verify(trainer, engine)
        kept = norm.detach().clone()
        perturb(trainer.policy, 0.01, seed=seed)
        with torch.no_grad():
            norm.copy_(kept)
    with torch.no_grad():
        norm.add_(0.01)
    with pytest.raises(StaleEngineError, match=r"the first: model\.norm\.weight, which the engine keeps no copy"):
        check.push_and_verify(trainer, engine)
    resumed = SyncCheck()  # a resumed run remembers what the first sync pushed
    resumed.load_state_dict(check.state_dict())
    with pytest.raises(StaleEngineError, match=r"model\.norm\.weight"):
        resumed.push_and_verify(trainer, engine)


@pytest.mark.slow
def test_two_kernel_columns_a_sync_still_stop_a_partial_update_at_once(tiny_dir):
    """On CPU vLLM keeps linear weights only packed, read back on sampled columns; a partial update moves every
    column, so two of them suffice."""
    engine = make_engine(VLLMPartialUpdate, "float32")
    engine.start(tiny_dir, seed=0)
    try:
        assert syncs_until_stopped(engine, Trainer(tiny_dir), 4, SyncSettings(kernel_columns=2)) == 2
    finally:
        engine.close()


@pytest.mark.slow
def test_vllm_engine_fed_half_of_the_tensors_is_wrong_at_once(tiny_dir):
    """Without the weight check, the probe shows what the first sync left in a vLLM engine fed every other tensor."""
    trainer = Trainer(tiny_dir)
    engine = make_engine(VLLMDropsHalf, "float32")
    engine.start(tiny_dir, seed=0)
    try:
        check = SyncCheck(SyncSettings(verify_weights=False))
        check.set_probe(trainer.tokenizer, trainer.tokenizer("3+4=")["input_ids"], "7")
        try:
            gap = check.push_and_verify(trainer, engine).gap
        except StaleEngineError as err:  # the half-rebuilt layers compute NaN here: far from the same model
            assert "do not run the same model" in str(err)
            gap = float("inf")
        assert not gap <= 1e-3  # a correct float32 engine: ~1e-6
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("engine_cls", [HFEngine, VLLMEngine])
def test_a_correct_bf16_engine_is_never_stopped_while_the_policy_drifts(tiny_dir, engine_cls):
    """150 syncs of a bf16 engine behind a float32 trainer that keeps moving: the probe gap grows with the drift
    (the old statistical check's failure mode), the weight check never fires."""
    trainer, engine = Trainer(tiny_dir), make_engine(engine_cls, "bfloat16")
    engine.start(tiny_dir, seed=0)
    try:
        check = SyncCheck()
        check.set_probe(trainer.tokenizer, trainer.tokenizer("3+4=")["input_ids"], "7")
        gaps = []
        for sync in range(150):
            report = check.push_and_verify(trainer, engine)
            assert report.verified == (16 if engine_cls is VLLMEngine else 27)  # vLLM fuses q, k, v and gate, up
            gaps.append(report.gap)
            perturb(trainer.policy, 0.003, seed=sync)
        assert max(gaps[100:]) > 4 * gaps[0]  # where a probe tolerance measured at the first sync would stop it
    finally:
        engine.close()


class _BlindEngine(RolloutEngine):
    """An engine that cannot read its weights back (the base class's defaults)."""

    def __init__(self, engine):
        self.engine = engine

    def start(self, model_dir, seed, device=None, local_rank=0, in_flight=False):
        self.engine.start(model_dir, seed, device, local_rank, in_flight)

    def generate(self, prompts, n, sampling, seed=None):
        return self.engine.generate(prompts, n, sampling, seed)

    def load_weights(self, named_tensors, version=0):
        self.engine.load_weights(named_tensors, version)

    def score(self, prompt, completion):
        return self.engine.score(prompt, completion)


@pytest.mark.slow
def test_an_engine_that_cannot_read_its_weights_back_is_checked_by_the_probe_and_the_run_says_so(tiny_dir, caplog):
    trainer, engine = Trainer(tiny_dir), _BlindEngine(HFEngine(progress=False))
    engine.start(tiny_dir, seed=0)
    with caplog.at_level(logging.WARNING, logger="amir_lightning.loop.sync"):
        assert syncs_until_stopped(engine, trainer, syncs=3) is None
    said = [r.getMessage() for r in caplog.records if "not compared with the pushed ones" in r.getMessage()]
    assert said == ["weight sync: the weights _BlindEngine holds are not compared with the pushed ones (it cannot "
                    "read them back); only the probe log-probs are measured"]  # fmt: skip


@pytest.mark.slow
def test_amir_fit_stops_an_engine_that_applies_part_of_each_update_at_its_second_sync(tmp_path):
    """End to end on configs/tiny.yaml: the engine takes 55 % of each update; the run trains on its first rollout
    (the first push is the initial weights, which the engine holds), then stops at the second sync with one line
    and exit status 2."""
    import os
    import sys
    from pathlib import Path

    from conftest import read_scalars
    from helpers import forks

    root = Path(__file__).parents[1]
    args = ["fit", "--config", str(root / "configs" / "tiny.yaml"), "--trainer.max_epochs", "4"]
    args += ["--data.engine", "engines.VLLMPartialUpdate", "--data.engine.init_args.fraction", "0.55"]
    args += ["--data.engine.init_args.max_model_len", "64", "--data.engine.init_args.progress", "false"]
    args += ["--data.engine.init_args.kv_cache_memory_bytes", "33554432"]
    helpers = str(Path(__file__).parent / "helpers")
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONPATH=helpers + os.pathsep + os.environ.get(
        "PYTHONPATH", ""))  # fmt: skip
    result = forks.run(
        [sys.executable, "-m", "amir_lightning", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("amir: error:")]
    assert len(errors) == 1 and "rollout engine is stale: after weight sync 2" in errors[0]
    assert "Traceback" not in result.stderr
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    assert len(scalars["train/loss"]) == 1 and scalars["rollout/sync_verified_tensors"] == [16.0]
