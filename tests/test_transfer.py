"""The ``amir_gloo`` weight transfer (``engines/transfer.py``): the trainer's first process broadcasts each tensor's
bytes to every worker of the server over a gloo group of their own; nothing is written to a file."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers.engines import (
    ServerDropsHalf,
    ServerIgnoresPushesAfter,
    ServerLayoutFault,
    ServerPartialUpdate,
    ServerSwapsParts,
)
from helpers.served import SETTINGS

from amir_lightning.engines import VLLMServerEngine
from amir_lightning.engines import server as server_module
from amir_lightning.engines.transfer import GlooUpdate, gloo_group, receive, send, update_info
from amir_lightning.helpers.http import ServerError
from amir_lightning.models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def tensors() -> list[tuple[str, torch.Tensor]]:
    """One of each dtype a push carries, an empty one and a 0-d one among them."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 4, generator=generator)),
        ("b.weight", torch.randn(5, generator=generator).to(torch.bfloat16)),
        ("c.weight", torch.randn(2, 2, generator=generator).to(torch.float16)),
        ("d.ids", torch.arange(6).reshape(2, 3)),
        ("e.mask", torch.tensor([True, False, True])),
        ("f.scale", torch.tensor(0.5, dtype=torch.float64)),
        ("g.empty", torch.empty(0, 4)),
        ("h.fp8", torch.randn(4, generator=generator).to(torch.float8_e4m3fn)),
    ]


def _rank(rank: int, port: int, out: str) -> None:
    group = gloo_group("127.0.0.1", port, rank, 3, 60)
    if rank == 0:
        send(group, tensors())
        return
    got = list(receive(group, GlooUpdate(**update_info(tensors()))))

    def raw(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).view(torch.uint8)

    same = [
        name == want and t.dtype == w.dtype and t.shape == w.shape and torch.equal(raw(t), raw(w))
        for (name, t), (want, w) in zip(got, tensors(), strict=True)
    ]
    with open(f"{out}.{rank}", "w") as f:
        f.write(repr(same))


def test_every_worker_receives_each_tensor_bit_for_bit_in_its_own_dtype(tmp_path):
    """The trainer and two workers: bf16, fp16, fp8, int, bool, 0-d and empty tensors arrive as sent, each rebuilt
    from the name, dtype and shape the update route carries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path / "same")), nprocs=3, start_method="spawn")
    for rank in (1, 2):
        assert (tmp_path / f"same.{rank}").read_text() == repr([True] * len(tensors()))


@pytest.mark.slow  # a vLLM server
def test_a_gloo_push_writes_no_file_and_every_sync_reads_back_the_pushed_weights(tiny_dir, served, monkeypatch):
    """Pushed over the gloo group, the weights never pass through a file (writing one fails the test) and the
    server's workers hold exactly what was pushed at every sync; ``transfer: file`` is the one that writes."""
    from helpers.engines import perturb
    from test_server_engine import new_check, policy_of

    def no_file(*args, **kwargs):
        raise AssertionError("a gloo push wrote a file")

    monkeypatch.setattr(server_module, "write_weights", no_file)
    engine = VLLMServerEngine(url=served.url(tiny_dir), max_model_len=SETTINGS["max_model_len"])
    engine.start(tiny_dir, seed=0)
    try:
        assert engine.transfer == "gloo" and engine.replicas[0].group is not None
        policy = policy_of(tiny_dir)
        check = new_check(policy)
        first = check.push_and_verify(policy, engine)
        for seed in (1, 2):
            perturb(policy.model, 0.01, seed=seed)  # the weights change: only a real push keeps the check green
            report = check.push_and_verify(policy, engine)
            assert report.verified == first.verified > 0 and report.gap < 1e-4
    finally:
        engine.close()
    filed = VLLMServerEngine(**SETTINGS, transfer="file")  # a server of its own: it registers the file transfer
    filed.start(tiny_dir, seed=0)
    try:
        with pytest.raises(AssertionError, match="wrote a file"):
            policy = policy_of(tiny_dir)
            new_check(policy).push_and_verify(policy, filed)
        reaching = VLLMServerEngine(url=filed.url, max_model_len=SETTINGS["max_model_len"])  # gloo, by default
        with pytest.raises(ServerError, match=r"needs data.engine.init_args.transfer set to its own \(file for amir"):
            reaching.start(tiny_dir, seed=0)
        reaching.close()
    finally:
        filed.close()


def test_an_unknown_transfer_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"data.engine.init_args.transfer must be gloo .*, nccl .* or file, got 'ipc'"):
        VLLMServerEngine(transfer="ipc")


#: The vLLM faults of tests/test_sync.py's table, on a server reached over the gloo transfer: (engine, settings, the
#: first sync whose pushed weights the server does not hold, what the error names).
SERVER_FAULTS = [
    (ServerIgnoresPushesAfter, {}, 4, "model."),
    (ServerDropsHalf, {}, 1, ""),  # its probe or its read-back, whichever sees the half-rebuilt layers first
    (ServerPartialUpdate, {}, 2, "model."),
    (ServerSwapsParts, {"parts": "kv"}, 1, "qkv_proj.weight"),
    (ServerSwapsParts, {"parts": "gate_up"}, 1, "gate_up_proj.weight"),
    (ServerLayoutFault, {"fault": "transposed_q"}, 1, "qkv_proj.weight"),
    (ServerLayoutFault, {"fault": "reversed_heads"}, 1, "qkv_proj.weight"),
    (ServerLayoutFault, {"fault": "rotary_interleaved"}, 1, "qkv_proj.weight"),
    (ServerLayoutFault, {"fault": "negated_down"}, 1, "down_proj.weight"),
]


@pytest.mark.slow  # a vLLM server
@pytest.mark.parametrize(
    ("engine_cls", "kwargs", "first_wrong", "names"),
    SERVER_FAULTS,
    ids=[f"{c.__name__}-{'-'.join(k.values())}" if k else c.__name__ for c, k, _, _ in SERVER_FAULTS],
)
def test_a_server_that_takes_a_gloo_push_wrong_is_stopped_at_its_first_wrong_sync(
    tiny_dir, served, engine_cls, kwargs, first_wrong, names
):
    from test_server_engine import policy_of
    from test_sync import Trainer, syncs_until_stopped

    engine = engine_cls(url=served.url(tiny_dir), max_model_len=SETTINGS["max_model_len"], **kwargs)
    engine.start(tiny_dir, seed=0)
    errors: list[str] = []
    try:
        assert engine.transfer == "gloo"
        assert syncs_until_stopped(engine, Trainer(tiny_dir), syncs=6, errors=errors) == first_wrong
        assert "holds other weights than the trainer pushed" in errors[0] or engine_cls is ServerDropsHalf, errors
        assert names in errors[0].partition("the first: ")[2], errors
    finally:
        with policy_of(tiny_dir).export_weights() as named:  # whole weights again, for the tests that come next
            VLLMServerEngine.load_weights(engine, named)
        engine.close()
