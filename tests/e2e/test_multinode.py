"""Two nodes by simulation: two training processes and two vLLM servers that share no file with them.

Each server runs in a mount namespace of its own (``unshare -m``) where ``/dev/shm``, the run's transfer folder and
its own temporary folder (``TMPDIR``) are empty file systems of their own: a push that went through a file
(``transfer: file``, or anything written where a server reads) could not reach it, and what a server writes (the
adapter its worker receives) the trainer cannot see. The weights travel over the gloo transfer alone.
"""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import read_scalars, run_amir
from helpers.served import SETTINGS
from safetensors.torch import load_file

from amir_lightning.engines import VLLMServerEngine
from amir_lightning.helpers.serving import ServerProcess, free_port, reachable_url
from amir_lightning.models import LoraSettings, TinyModel

ROOT = Path(__file__).parents[2]
FSDP2 = "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}"


def own_namespace_works() -> bool:
    """Whether this machine lets a process mount an empty ``/dev/shm`` of its own (root, or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    for prefix in (["unshare", "-m", "--propagation", "private"], ["unshare", "-rm", "--propagation", "private"]):
        done = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs none /dev/shm"], capture_output=True, check=False)
        if done.returncode == 0:
            return True
    return False


def apart(command: list[str], hidden: list[Path]) -> list[str]:
    """``command`` in a mount namespace of its own where each of ``hidden`` is an empty file system."""
    mounts = " && ".join(f"mount -t tmpfs none {folder}" for folder in hidden)
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "apart", *command]


@pytest.mark.slow  # two vLLM servers and two training runs of two processes
@pytest.mark.skipif(not own_namespace_works(), reason="this machine lets no process mount a /dev/shm of its own")
@pytest.mark.parametrize("lora", [False, True], ids=["merged", "adapters"])
def test_two_processes_train_from_two_servers_that_share_no_file_and_resume_exactly(tmp_path, lora):
    """3 rollouts on 2 FSDP2 processes, each sending its groups to both servers (a rollout sampled ahead,
    ``max_staleness: 1``); every sync is read back from both servers (``rollout/sync_copies`` 2), exactly. Resumed
    from rollout 2's checkpoint, written while rollout 3 was sampled ahead, the run ends with the uninterrupted run's
    weights, bitwise. Nothing reaches the servers through a file: they cannot see the trainer's ``/dev/shm``, its
    transfer folder or what it writes to their temporary folder, and the transfer folder holds no weights after the
    runs. With LoRA (``push_adapters``) each sync after the first sends the adapter alone, which each server's worker
    writes into its own temporary folder for vLLM to load."""
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    model = TinyModel(**config["model"]["policy"]["init_args"], cache_dir=str(tmp_path / "models")).resolve()
    transfer_dir = tmp_path / "transfer"
    transfer_dir.mkdir()
    server_tmp = Path(tempfile.mkdtemp(prefix="amir_srv_"))  # short: vLLM's sockets live there (107 characters)
    shape = VLLMServerEngine(**SETTINGS, push_adapters=lora)
    shape.take_adapters(LoraSettings(r=8) if lora else None)
    servers = []
    try:
        for index in range(2):
            port = free_port("127.0.0.1")
            hidden = [Path("/dev/shm"), transfer_dir, server_tmp]
            command = apart(shape.server_command(model, port, 0, False), hidden)
            log_path = tmp_path / f"server{index}.log"
            env = shape.server_env() | {"TMPDIR": str(server_tmp)}
            servers.append(ServerProcess(command, env, reachable_url("127.0.0.1", port), log_path, f"server {index}"))
        for server in servers:
            server.wait_until_ready(600, "startup")
        given = {"url": [s.url for s in servers], "max_model_len": SETTINGS["max_model_len"]}
        given |= {"transfer_dir": str(transfer_dir), "push_adapters": lora}
        engine = json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": given})
        common = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.engine", engine]
        common += ["--model.lora", "{r: 8, alpha: 16}"] if lora else []
        common += ["--trainer.devices", "2", "--trainer.strategy", FSDP2, "--trainer.deterministic", "true"]
        common += ["--data.rollout.max_staleness", "1", "--data.rollout.stale_logps", "sampler"]
        common += ["--data.rollout.prompts_per_process", "4", "--data.rollout.micro_batch_groups", "4"]
        common += ["--trainer.check_val_every_n_epoch", "50", "--trainer.max_epochs", "3"]
        run_amir([*common, "--checkpoint.save_top_k", "-1", "--trainer.logger.init_args.name", "full"], tmp_path)
        runs = tmp_path / "runs"
        scalars = read_scalars(runs / "full" / "version_0")
        assert len(scalars["train/loss"]) == 3 and scalars["rollout/sync_copies"] == [2.0, 2.0, 2.0]
        verified = scalars["rollout/sync_verified_tensors"]
        assert min(verified) > 0 and max(scalars["rollout/sync_logp_diff"]) < 1e-4
        assert verified == [verified[0]] * 3 if not lora else verified[1] == verified[2] < verified[0]  # base once
        assert scalars["rollout/staleness_rollouts"] == [0.0, 1.0, 1.0]
        (second,) = (runs / "full" / "version_0" / "checkpoints").glob("epoch=1-*")  # rollout 2's, of 0, 1, 2
        run_amir([*common, "--trainer.logger.init_args.name", "part", "--ckpt_path", str(second)], tmp_path)
        full = load_file(runs / "full" / "version_0" / "policy" / "model.safetensors")
        part = load_file(runs / "part" / "version_0" / "policy" / "model.safetensors")
        assert full.keys() == part.keys() and all((full[k] == part[k]).all() for k in full)
        left = [p for p in [*transfer_dir.rglob("*"), *server_tmp.rglob("*")] if p.is_file()]
        assert left == [], left  # a gloo push writes nothing here; the runs removed their folders
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(server_tmp, ignore_errors=True)
