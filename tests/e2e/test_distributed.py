"""Two CPU processes (gloo): the same global batch gives the same update as one process; DDP and FSDP2 fits run,
and a distributed checkpoint resumes."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_amir
from helpers import forks
from helpers.qwen_setting import check_qwen_run, qwen_setting_args, tiny_policy

from amir_lightning.models import build_tiny_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
HELPER = Path(__file__).parents[1] / "helpers" / "dp_step.py"
STRATEGIES = ["ddp", "fsdp2"]
LOSSES = [("grpo", "grpo"), ("grpo", "amir"), ("dapo", "grpo"), ("dapo", "amir")]
PACKINGS = [("ddp", "off"), ("fsdp2", "off"), ("fsdp2", "on")]
UNEVEN = {"uneven": True, "micro_batch_tokens": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


def launch(model_dir, out_dir, devices: int, runs: dict[str, dict]) -> str:
    """One launch of dp_step.py on ``devices`` processes, running every one of ``runs`` (name: settings) in turn;
    its output (both ranks'). The first process is forked (``tests/helpers/forks.py``); Lightning starts the second."""
    runs = json.dumps([{"name": name, **settings} for name, settings in runs.items()])
    cmd = [sys.executable, str(HELPER), str(model_dir), str(out_dir), "--devices", str(devices), "--runs", runs]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = forks.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def updates(model_dir, tmp_path_factory):
    """Every one-step update the tests below compare: the references on one process, the rest on two (the
    2-process launch costs most of each run's time, so all runs share two launches)."""
    out = tmp_path_factory.mktemp("updates")
    single = {f"one-{agg}-{loss}": {"aggregation": agg, "loss": loss} for agg, loss in LOSSES}
    single["one-clip"] = {"max_grad_norm": 0.05}
    single["one-kl-lora"] = {"kl_coef": 0.1, "lora": True}
    single["one-kl"] = {"kl_coef": 0.1}
    double = {
        f"two-{strategy}-{agg}-{loss}": {"strategy": strategy, "aggregation": agg, "loss": loss}
        for strategy in STRATEGIES
        for agg, loss in LOSSES
    }
    double |= {f"two-uneven-{s}-{p}": {"strategy": s, "packing": p, **UNEVEN} for s, p in PACKINGS}
    double["two-clip"] = {"strategy": "fsdp2", "max_grad_norm": 0.05}
    double["two-uneven-fsdp2-kl-lora"] = {"strategy": "fsdp2", "kl_coef": 0.1, "lora": True, **UNEVEN}
    double["two-idle-fsdp2-kl-lora"] = {"strategy": "fsdp2", "kl_coef": 0.1, "lora": True, **UNEVEN, "uneven": 4}
    double["two-uneven-fsdp2-kl"] = {"strategy": "fsdp2", "kl_coef": 0.1, **UNEVEN}
    printed = launch(model_dir, out, 1, single) + launch(model_dir, out, 2, double)
    return {name: torch.load(out / f"{name}.pt") for name in [*single, *double]}, printed.splitlines()


def largest_update(model_dir, update: dict[str, torch.Tensor]) -> float:
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return max((update[k] - start[k]).abs().max().item() for k in update)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("aggregation", "loss"), LOSSES)
def test_two_processes_make_the_same_update_as_one(model_dir, updates, strategy, aggregation, loss):
    """Tolerance: 1e-5 relative to the largest update (float32 sums in a different order)."""
    single, double = updates[0][f"one-{aggregation}-{loss}"], updates[0][f"two-{strategy}-{aggregation}-{loss}"]
    largest = largest_update(model_dir, single)
    assert largest > 1e-3  # the step moved the weights
    for key in single:
        torch.testing.assert_close(double[key], single[key], atol=1e-5 * largest, rtol=0)


@pytest.mark.parametrize(("strategy", "packing"), PACKINGS)
def test_processes_with_unequal_micro_batches_agree_and_make_the_same_update(model_dir, updates, strategy, packing):
    """Rank 0 holds 3 groups, rank 1 one (as when groups without reward variance are dropped), and a token budget
    of one group per micro-batch: rank 1 runs 2 fillers to keep in step. The update equals one process's (padded),
    with packed rows too (model.scoring.packing on, FSDP2)."""
    name = f"two-uneven-{strategy}-{packing}"
    single, double, printed = updates[0]["one-grpo-amir"], updates[0][name], updates[1]
    for rank in (0, 1):
        assert f"run {name}, rank {rank}: micro-batches per step [3]" in printed
    # one log-prob path per run, whatever FSDP2's shard state (the fused head, packed when asked), on every rank
    for rank in (0, 1):
        line = next(x for x in printed if x.startswith(f"run {name}, rank {rank}: log-prob forwards"))
        counts = ast.literal_eval(line.split("forwards ", 1)[1])  # a dict printed by dp_step.py
        used = {path for path, n in counts.items() if n}
        assert used == ({"packed"} if packing == "on" else {"fused"}), line
    largest = largest_update(model_dir, single)
    for key in single:
        torch.testing.assert_close(double[key], single[key], atol=1e-5 * largest, rtol=0)


@pytest.mark.parametrize("run", ["two-uneven-fsdp2-kl-lora", "two-idle-fsdp2-kl-lora"])
def test_a_filler_runs_the_reference_forward_too_under_fsdp2(model_dir, updates, run):
    """The same uneven micro-batches with a KL term and LoRA (the reference is the policy with its adapters off, a
    forward that gathers the sharded weights): rank 1's fillers run it too, and the update equals one process's;
    also where rank 1 has no group at all (every micro-batch of its step a filler). A filler that ran the policy's
    forward alone left rank 0 waiting in the reference's gather: the run hung; a process of fillers alone summed
    no statistics with the others (and returned a float loss): it crashed."""
    single, double = updates[0]["one-kl-lora"], updates[0][run]
    largest = max(single[key].abs().max().item() for key in single if "lora_B" in key)  # B starts at 0
    assert largest > 1e-4  # the adapters moved
    for key in single:
        torch.testing.assert_close(double[key], single[key], atol=1e-5 * largest, rtol=0)


def test_clipping_uses_the_global_gradient_norm_under_fsdp2(model_dir, updates):
    """Each process holds a shard of every gradient (FSDP2 DTensors); clipping by a per-shard norm would scale the
    shards differently. The clipped 2-process update equals the 1-process one."""
    from transformers import AutoModelForCausalLM

    single, double = updates[0]["one-clip"], updates[0]["two-clip"]
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    update = torch.cat([(single[k] - start[k]).flatten() for k in single if k != "lm_head.weight"])  # tied
    # SGD at lr 1: the update is the clipped gradient, whose norm is the clip (the raw norm is far above it)
    assert update.norm().item() == pytest.approx(0.05, rel=1e-4)
    for key in single:
        torch.testing.assert_close(double[key], single[key], atol=1e-6, rtol=0)


def test_two_process_ddp_fit_with_an_engine_per_rank(tmp_path):
    """``amir fit`` on 2 CPU processes under DDP, each with its own vLLM engine and prompt shard. FSDP2 on 2 processes
    runs whole in ``test_qwen_yaml_setting_on_two_processes`` and resumes from its distributed checkpoint in
    ``test_a_distributed_checkpoint_cut_short_leaves_the_last_whole_one_and_the_run_resumes_from_it``."""
    config = str(ROOT / "configs" / "tiny.yaml")
    common = ["fit", "--config", config, "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    run_amir([*common, "--trainer.check_val_every_n_epoch", "2", "--trainer.max_epochs", "2"], tmp_path)
    first = tmp_path / "runs" / "tiny" / "version_0"
    scalars = read_scalars(first)
    assert len(scalars["rollout/reward_mean"]) == 2 and len(scalars["train/loss"]) == 2
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-3 and "val/accuracy" in scalars
    assert (first / "policy" / "model.safetensors").is_file()


def test_qwen_yaml_setting_on_two_processes(tmp_path):
    """configs/qwen.yaml's strategy (FSDP2), precision (bf16 compute, float32 adapters), LoRA, bf16 vLLM engine and
    exact sync check, with only the model (a tiny random Qwen2), the prompts and the accelerator overridden:
    2 rollouts on 2 CPU processes (the second sync is the first of trained weights), every sync verified, the export
    loads. Gradient checkpointing (on in qwen.yaml, off on an H200) is switched off, so that this combination stays
    tested."""
    extra = ["--model.gradient_checkpointing", "false"]
    run_amir(qwen_setting_args(tiny_policy(), "cpu", 2, rollouts=2, extra=extra), tmp_path, timeout=900)
    check_qwen_run(tmp_path / "runs" / "qwen" / "version_0", rollouts=2)


def test_two_slurm_nodes_give_each_engine_its_own_local_rank(tmp_path):
    """Two "nodes" of one process each, launched as srun does: SLURM's variables (SLURM_LOCALID, no LOCAL_RANK),
    which Lightning's SLURMEnvironment reads. Each vLLM engine must get its process's local rank (0 on both nodes),
    not its global rank (on 8-GPU nodes, the second node's ranks 8-15 asked vLLM for cuda:8..15); only the first
    process shows the engine's progress bar."""
    from amir_lightning.helpers.serving import free_port

    port = free_port("127.0.0.1")  # below the ephemeral range: no socket takes it meanwhile
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "1"]
    args += ["--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.strategy", "ddp"]
    args += ["--trainer.check_val_every_n_epoch", "5", "--data.engine", "engines.RecordsLocalRank"]
    args += ["--data.engine.init_args.max_model_len", "64", "--data.engine.init_args.progress", "true"]
    args += ["--data.engine.init_args.kv_cache_memory_bytes", "33554432"]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(MASTER_PORT=str(port), AMIR_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NAME="amir", SLURM_JOB_ID="4242")
    env.update(SLURM_NODELIST="127.0.0.1", SLURM_LOCALID="0")
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "helpers") + os.pathsep + env.get("PYTHONPATH", "")
    nodes = [
        forks.Forked(
            [sys.executable, "-m", "amir_lightning", *args],
            cwd=tmp_path,
            env=dict(env, SLURM_PROCID=str(rank), SLURM_NODEID=str(rank)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    errors = [node.communicate(timeout=600)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors[1][-3000:]
    assert [(tmp_path / f"vllm_local_rank.{rank}").read_text() for rank in (0, 1)] == ["0", "0"]
    assert "Processed prompts" in errors[0] and "Processed prompts" not in errors[1]  # one progress bar, rank 0's


def test_a_distributed_checkpoint_cut_short_leaves_the_last_whole_one_and_the_run_resumes_from_it(tmp_path):
    """FSDP2 on 2 processes with ``save_last: true`` (last.ckpt rewritten each rollout), both killed after writing
    their shards of rollout 2's last.ckpt, before Lightning's meta.pt: last.ckpt is still rollout 1's, its shards
    and its meta.pt agree, and the copy cut short lies aside. Written in place, it held rollout 2's weights under
    rollout 1's step: a checkpoint that loads and mixes two steps. Resumed from it, the run trains rollouts 2 and 3
    (the step count, the prompt stream and the curves go on) and exports the policy."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    common = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.devices", "2", "--trainer.max_epochs"]
    common += ["3", "--trainer.strategy", "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}"]
    common += ["--trainer.check_val_every_n_epoch", "50", "--checkpoint.save_last", "true"]
    args = [*common, "--trainer.callbacks+=faults.KillAfterShards", "--trainer.callbacks.at_save", "4"]
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "helpers") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "amir_lightning", *args]
    result = forks.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == -9, result.stderr[-3000:]  # killed, as injected (save 4: rollout 2's last.ckpt)
    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [".last.ckpt.tmp", "epoch=1-step=2.ckpt", "last.ckpt"]
    assert torch.load(folder / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 1

    def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
        dcp_to_torch_save(checkpoint, tmp_path / f"{checkpoint.name}.pt")
        return torch.load(tmp_path / f"{checkpoint.name}.pt", weights_only=True)["state_dict"]

    last, second = weights(folder / "last.ckpt"), weights(folder / "epoch=1-step=2.ckpt")
    assert last.keys() == second.keys()
    assert not all(torch.equal(last[k], second[k]) for k in last)  # rollout 1's weights, not rollout 2's

    run_amir([*common, "--ckpt_path", str(folder / "last.ckpt")], tmp_path)
    resumed = tmp_path / "runs" / "tiny" / "version_1"
    scalars = read_scalars(resumed)
    assert len(scalars["rollout/reward_mean"]) == 2 and len(scalars["train/loss"]) == 2  # rollouts 2 and 3 alone
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-3 and (resumed / "policy" / "model.safetensors").is_file()
    assert torch.load(resumed / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 3


def test_the_sharded_reference_copy_makes_the_update_one_process_makes_with_the_whole_copy(model_dir, updates):
    """A KL term without LoRA: under FSDP2 the frozen copy is sharded as the policy is (each process read its own
    rows), its forward a collective that rank 1's fillers run too; the update equals one process's with the whole
    copy."""
    single, double = updates[0]["one-kl"], updates[0]["two-uneven-fsdp2-kl"]
    largest = largest_update(model_dir, single)
    assert largest > 1e-3  # the step moved the weights
    for key in single:
        torch.testing.assert_close(double[key], single[key], atol=1e-5 * largest, rtol=0)
