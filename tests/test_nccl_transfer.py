"""The ``nccl`` transfer (``engines/nccl.py``), where a CPU can check it: NCCL itself needs GPUs, so what runs here
is vLLM's own check of the push's source, the routes the client sends every replica (each at its own ranks, in
the bodies vLLM's worker-side dataclasses take; the gloo push drives the same client in every server test), and the
refusal on a machine without CUDA."""

import json
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload  # noqa: E402
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: E402
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from amir_lightning.engines import VLLMServerEngine  # noqa: E402
from amir_lightning.engines.nccl import PlannedSource, init_info  # noqa: E402
from amir_lightning.engines.replicas import Replica, ReplicasClient, server_name  # noqa: E402
from amir_lightning.helpers.http import Endpoint, ServerError  # noqa: E402
from amir_lightning.models import build_tiny_model  # noqa: E402
from amir_lightning.models.loading import load_policy  # noqa: E402
from amir_lightning.models.sharded import WeightStream  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_policy(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=4))


def planned(model):
    stream = WeightStream(model)
    return [(p[0], tuple(p[1]), p[2]) for p in stream.plan], stream


def test_vllms_own_check_takes_the_push_as_planned_tensor_for_tensor(model):
    """vLLM's trainer engine checks every tensor it sends against the plan it declared to the workers
    (``_checked_iter``): the push's stream passes whole and as the model holds it; read twice, it refuses."""
    plan, stream = planned(model)
    source = PlannedSource(plan, stream, torch.device("cpu"))
    assert [(m.name, m.shape, m.dtype) for m in source.metadata()] == plan
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
    state = model.state_dict()
    assert [name for name, _ in sent] == [name for name, _, _ in plan]
    assert all(torch.equal(tensor, state[name]) for name, tensor in sent if name in state)
    with pytest.raises(RuntimeError, match="a push's stream is read once"):
        list(source)


def test_a_stream_that_is_not_its_plan_is_stopped_by_vllms_check_before_a_worker_waits(model):
    plan, stream = planned(model)
    wrong = [plan[0], (plan[1][0], plan[1][1], torch.float16), *plan[2:]]
    source = PlannedSource(wrong, stream, torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"disagrees with iteration at index 1: declared '{plan[1][0]}'"):
        list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))


class Recording:
    """A local HTTP server that records each route's JSON body and answers ``{}`` (``fail``: 500 on that route)."""

    def __init__(self, fail: str | None = None) -> None:
        self.bodies: list[tuple[str, dict | None]] = []
        recording = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                text = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recording.bodies.append((self.path, json.loads(text) if text else None))
                status, answer = (500, b'{"error": "no NCCL peer"}') if self.path == fail else (200, b"{}")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def replica(url: str, index: int, count: int, workers: int) -> Replica:
    where = Endpoint(url, server_name(index, count), "data.engine.init_args.url", "a vLLM server", "start one")
    return Replica(index, count, where, 30.0, workers=workers)


def test_the_client_sends_every_replica_its_own_ranks_and_the_push_in_vllms_own_bodies(model):
    """Two replicas of 1 and 2 workers: one group of 4 ranks (the trainer 0, the first replica 1, the second 2 and 3);
    every route reaches both, its body taken by vLLM's worker-side dataclasses; the push's version ends it."""
    servers = [Recording(), Recording()]
    try:
        client = ReplicasClient([replica(s.url, i, 2, [1, 2][i]) for i, s in enumerate(servers)], version=7)
        trainer = init_info("127.0.0.1", 29555, client.workers)
        assert trainer.world_size == 4 and trainer.is_sender and trainer.backend == "nccl"
        # what vLLM's NCCLTrainerWeightTransferEngine.trainer_init hands the client, then the round of send_weights
        worker = NCCLWeightTransferInitInfo(master_address=trainer.master_address, master_port=trainer.master_port,
                                            rank_offset=1, world_size=trainer.world_size)  # fmt: skip
        client.init_weight_transfer_engine(worker_init_payload(worker))
        client.start_weight_update()
        plan, _ = planned(model)
        update = NCCLWeightTransferUpdateInfo([n for n, _, _ in plan], [str(d).split(".")[-1] for _, _, d in plan],
                                              [list(s) for _, s, _ in plan])  # fmt: skip
        client.update_weights(asdict(update))
        client.finish_weight_update()
        for index, server in enumerate(servers):
            routes = [route for route, _ in server.bodies]
            assert routes == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                              "/finish_weight_update"]  # fmt: skip
            bodies = dict(server.bodies)
            joined = NCCLWeightTransferInitInfo(**bodies["/init_weight_transfer_engine"]["init_info"])
            assert joined.rank_offset == [1, 2][index] and joined.world_size == 4 and joined.master_port == 29555
            assert NCCLWeightTransferUpdateInfo(**bodies["/update_weights"]["update_info"]).names == update.names
            assert bodies["/finish_weight_update"] == {"weight_version": "7"}
    finally:
        for server in servers:
            server.close()


def test_a_replica_that_refuses_a_route_is_named_in_one_line():
    servers = [Recording(), Recording(fail="/update_weights")]
    try:
        client = ReplicasClient([replica(s.url, i, 2, 1) for i, s in enumerate(servers)], version=1)
        with pytest.raises(ServerError, match=rf"the vLLM server \(replica 2 of 2\) at {servers[1].url} refused "
                                              r"/update_weights \(500\)") as refused:  # fmt: skip
            client.update_weights({"names": [], "dtype_names": [], "shapes": []})
        assert "\n" not in str(refused.value)
    finally:
        for server in servers:
            server.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA can run the nccl transfer")
def test_the_nccl_transfer_without_cuda_is_one_line_naming_the_key(tmp_path):
    engine = VLLMServerEngine(transfer="nccl", url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"data.engine.init_args.transfer nccl sends from the trainer's GPU, and this "
                                         r"process has no CUDA device: set transfer gloo"):  # fmt: skip
        engine.start(tmp_path, seed=0)
