"""End to end: ``amir fit`` on the tiny config with real vLLM learns, checkpoints, and exports a loadable policy."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_amir

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]
# Logged by the module and the rollout for every run.
CORE_KEYS = {
    "train/loss",
    "train/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "train/lr",
    "rollout/sync_logp_diff",
    "rollout/tokens_per_s",
    "rollout/zero_std_frac",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/accuracy",
    "length/mean",
    "length/truncated_frac",
    "val/accuracy",
}
# Logged by the pair term of AMIR-GRPO only.
AMIR_KEYS = {"amir/pair_loss", "amir/lambda", "amir/pair_term", "amir/implicit_acc"}
# Logged by the monitors (configs/tiny*.yaml attach them) for GRPO and AMIR runs alike.
MONITOR_KEYS = {
    "amir/pair_margin",
    "amir/pair_margin_median",
    "amir/pair_acc",
    "amir/num_pairs",
    "length/correct_mean",
    "length/incorrect_mean",
    "length/gap",
    "length/corr_advantage",
    "length/neg_token_weight_pg",
    "throughput/generate_tokens_per_s",
    "throughput/train_tokens_per_s",
    "throughput/train_frac",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    run_amir(["fit", "--config", str(ROOT / "configs" / "tiny.yaml")], tmp)
    return tmp / "runs" / "tiny" / "version_0"


def test_reward_improves_on_a_learnable_task(tiny_run):
    """Random init copies a digit 4% of the time; after 30 rollouts the logged reward must have risen clearly."""
    scalars = read_scalars(tiny_run)
    reward = scalars["rollout/reward_mean"]
    assert len(reward) == 30
    first, last = sum(reward[:3]) / 3, sum(reward[-5:]) / 5
    assert last > first + 0.15, f"reward did not improve: first epochs {reward[:3]}, last {reward[-5:]}"
    accuracy = scalars["val/accuracy"]
    assert accuracy[-1] > accuracy[0]
    for key in (
        "train/loss",
        "train/pg_loss",
        "train/entropy",
        "train/grad_norm",
        "amir/pair_loss",
        "amir/num_pairs",
        "amir/lambda",
        "amir/pair_acc",
        "amir/pair_margin",
        "rollout/sync_logp_diff",
        "rollout/tokens_per_s",
        "rollout/zero_std_frac",
        "rollout/reward_std",
        "length/mean",
    ):
        assert key in scalars and all(torch.isfinite(torch.tensor(scalars[key]))), key
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-3


def test_checkpoint_and_export_load_in_transformers_and_vllm(tiny_run):
    assert (tiny_run / "checkpoints" / "last.ckpt").is_file()
    export = tiny_run / "policy"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    out = model.generate(**tok("7=", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 2
    code = (
        "from vllm import LLM, SamplingParams; "
        f"llm = LLM(model={str(export)!r}, dtype='float32', enforce_eager=True, max_model_len=64, "
        "kv_cache_memory_bytes=32 << 20); "
        "o = llm.generate(['7='], SamplingParams(max_tokens=3, temperature=0)); "
        "print('GENERATED', len(o[0].outputs[0].token_ids))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "GENERATED" in result.stdout, result.stderr[-3000:]


def test_cli_swaps_loss_and_engine(tmp_path):
    """The same YAML with the GRPO objective and the HF engine swapped in from the command line."""
    run_amir(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--trainer.max_epochs",
            "2",
            "--model.loss",
            "amir_lightning.objectives.GRPOLoss",
            "--data.engine",
            "amir_lightning.rollout.HFEngine",
            "--data.engine.init_args.progress",
            "false",
            "--trainer.check_val_every_n_epoch",
            "1",
        ],
        tmp_path,
    )
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    assert len(scalars["train/loss"]) == 2 and len(scalars["val/accuracy"]) == 2
    assert not AMIR_KEYS & set(scalars)  # no pair term in a GRPO run ...
    for key in CORE_KEYS | MONITOR_KEYS:  # ... but the same measurements, so GRPO and AMIR runs compare
        assert key in scalars and all(torch.isfinite(torch.tensor(scalars[key]))), key
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-4


def test_amir_test_reports_pass_at_k_and_compare_writes_the_analyses(tiny_run, tmp_path):
    """``amir test`` of the trained export and of the untrained model on a digit-copy benchmark, then compare."""
    fixture = ROOT / "tests" / "fixtures" / "benchmarks" / "tiny_gsm8k.jsonl"
    bench = f"[{{class_path: amir_lightning.evaluation.BenchmarkPrompts, init_args: {{name: gsm8k, path: {fixture}}}}}]"
    common = ["test", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.benchmarks", bench]
    run_amir(
        [
            *common,
            "--model.policy",
            "amir_lightning.models.HFModel",
            "--model.policy.init_args.name_or_path",
            str(tiny_run / "policy"),
            "--trainer.logger.init_args.name",
            "trained",
        ],
        tmp_path,
    )
    initial = run_amir(
        [*common, "--trainer.logger.init_args.name", "initial", "--trainer.enable_progress_bar", "true"], tmp_path
    )
    assert "sync_dist=True" not in initial.stderr  # pass@k is reduced over processes already: no such advice
    assert "grading gsm8k:" in initial.stderr and "/80 [" in initial.stderr  # a bar over the 10 x 8 answers
    runs = {name: tmp_path / "runs" / name / "version_0" for name in ("trained", "initial")}
    reports = {name: json.loads((run / "eval" / "gsm8k.json").read_text()) for name, run in runs.items()}
    for name, report in reports.items():
        assert report["samples"] == 8 and len(report["problems"]) == 10
        scalars = read_scalars(runs[name])
        for k in (1, 2, 4):
            value = scalars[f"eval/gsm8k/pass@{k}"][-1]
            assert math.isclose(value, report["pass@k"][str(k)], abs_tol=1e-6)
        assert all(len(p["mean_logp"]) == 8 and all(lp <= 0 for lp in p["mean_logp"]) for p in report["problems"])
    assert reports["trained"]["pass@k"]["1"] > reports["initial"]["pass@k"]["1"]
    out = tmp_path / "compare"
    result = run_amir(
        ["compare", str(runs["trained"]), str(runs["initial"]), "--labels", "trained", "initial", "--out", str(out)],
        tmp_path,
    )
    assert "compare.md" in result.stdout
    text = (out / "compare.md").read_text()
    assert "## gsm8k" in text and text.count("| ✓ | ✓ |") == 1 and (out / "margins_gsm8k.png").is_file()


def test_resume_continues_with_the_next_rollout(tiny_run, tmp_path):
    """Resuming the 30-epoch run from last.ckpt for one more epoch runs exactly one rollout and one step, and the
    run's progress bar picks up at rollout 30 of 31.

    A model value given with ``--ckpt_path`` wins over the checkpoint's saved one (Lightning alone keeps the saved
    one), and the run says which values differ.
    """
    result = run_amir(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--trainer.max_epochs",
            "31",
            "--ckpt_path",
            str(tiny_run / "checkpoints" / "last.ckpt"),
            "--model.max_grad_norm",
            "0.25",
            "--trainer.enable_progress_bar",
            "true",
        ],
        tmp_path,
    )
    run = tmp_path / "runs" / "tiny" / "version_0"
    resumed = read_scalars(run)
    bar = result.stdout.replace("\r", "\n").splitlines()  # one bar for the run, picked up at rollout 30 of 31
    assert any(line.startswith("rollouts:  97%|") and " 30/31 [" in line for line in bar), result.stdout[-2000:]
    assert any(line.startswith("rollouts: 100%|") and " 31/31 [" in line and "reward=" in line for line in bar)
    assert len(resumed["rollout/reward_mean"]) == 1 and len(resumed["train/loss"]) == 1
    assert "model.max_grad_norm 0.25 (checkpoint: 1.0)" in result.stderr
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["max_grad_norm"] == 0.25
    assert (
        torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]["max_grad_norm"]
        == 1.0
    )


def test_every_configured_logger_gets_every_metric(tmp_path):
    """``--trainer.logger '[TensorBoardLogger, CSVLogger]'``: the rollout, loss and monitor scalars reach both."""
    import csv

    config = str(ROOT / "configs" / "tiny.yaml")
    run_amir(
        ["fit", "--config", config, "--trainer.logger", "[TensorBoardLogger, CSVLogger]", "--trainer.max_epochs", "2"],
        tmp_path,
    )
    tensorboard = read_scalars(tmp_path / "runs" / "tiny")
    (metrics,) = (tmp_path / "runs" / "tiny").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    columns = set(rows[0])
    for key in ("rollout/reward_mean", "train/loss", "amir/lambda", "length/gap", "throughput/train_frac"):
        logged = [float(r[key]) for r in rows if r.get(key)]
        assert len(logged) == 2 and logged == pytest.approx(tensorboard[key][:2]), key
    assert {k for k in tensorboard if not k.startswith("hp_")} <= columns | {"epoch"}


def test_wandb_gets_scalars_histograms_and_the_sample_table(tmp_path, monkeypatch):
    """An offline W&B run beside TensorBoard: the scalars, the pair-margin histogram and the sample table reach it."""
    pytest.importorskip("wandb")
    from helpers.wandb_log import history

    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = "{class_path: WandbLogger, init_args: {offline: true, save_dir: wandb_runs, project: tiny}}"
    config = str(ROOT / "configs" / "tiny.yaml")
    run_amir(
        ["fit", "--config", config, "--trainer.logger", f"[TensorBoardLogger, {wandb}]", "--trainer.max_epochs", "2"],
        tmp_path,
    )
    rows = history(tmp_path / "wandb_runs")
    tensorboard = read_scalars(tmp_path / "runs" / "tiny")
    logged = [row["rollout/reward_mean"] for row in rows if "rollout/reward_mean" in row]
    assert logged == pytest.approx(tensorboard["rollout/reward_mean"][:2])
    assert any(row.get("amir/pair_margin_hist/_type") == "histogram" for row in rows)
    (table,) = [row for row in rows if row.get("rollout/samples/_type") == "table-file"]
    saved = json.loads(next((tmp_path / "wandb_runs").rglob("samples_*.table.json")).read_text())
    assert (
        saved["columns"][:3] == ["question", "reference", "completion"]
        and len(saved["data"]) == table["rollout/samples/nrows"]
    )


def test_checkpointing_and_early_stopping_watch_the_rollout_reward(tmp_path):
    """A ``ModelCheckpoint(monitor="rollout/reward_mean", mode="max")`` keeps the best rollout's checkpoint while
    last.ckpt keeps following the newest, and ``EarlyStopping`` on the reward stops the run: both read
    ``trainer.callback_metrics``, which the rollout metrics reach (before, they went to the loggers only, and both
    callbacks failed on a missing metric)."""
    common = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.check_val_every_n_epoch", "50"]
    best = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.mode", "max"]
    best += ["--trainer.callbacks.monitor", "rollout/reward_mean", "--trainer.callbacks.dirpath", str(tmp_path / "b")]
    best += ["--trainer.callbacks.save_on_train_epoch_end", "true"]  # a rollout ends a training epoch
    run_amir([*common, "--trainer.max_epochs", "6", *best], tmp_path)
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    rewards = read_scalars(run_dir)["rollout/reward_mean"]
    kept = list((tmp_path / "b").glob("*.ckpt"))
    assert len(kept) == 1 and f"epoch={rewards.index(max(rewards))}-" in kept[0].name, (kept, rewards)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert state["global_step"] == 6  # the newest state, whatever the reward did
    saved = [v for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint") and v["best_model_score"]]
    assert len(saved) == 1 and float(saved[0]["best_model_score"]) == pytest.approx(max(rewards), abs=1e-6)

    stop = ["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"]
    stop += ["--trainer.callbacks.monitor", "rollout/reward_mean", "--trainer.callbacks.mode", "max"]
    stop += ["--trainer.callbacks.stopping_threshold", "-1.0", "--trainer.callbacks.check_on_train_epoch_end", "true"]
    stop += ["--trainer.logger.init_args.name", "stopped"]
    run_amir([*common, "--trainer.max_epochs", "6", *stop], tmp_path)
    assert len(read_scalars(tmp_path / "runs" / "stopped" / "version_0")["rollout/reward_mean"]) == 1


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_an_overlong_prompt_is_found_when_the_data_opens(tmp_path, mode):
    """A JSONL of 50 prompts, one (line 17) longer than tiny.yaml leaves room for (max_model_len 64 minus 2 new
    tokens). ``skip``: the run trains, the prompt is left out and counted, named once. ``error``: one line naming the
    file and line, before the engine starts. (Before, the error came when the stream reached the prompt, mid-run, and
    again at every resume.)"""
    rows = [{"question": f"{i % 10}=", "answer": str(i % 10)} for i in range(50)]
    rows[16] = {"question": "7" * 80 + "=", "answer": "7"}
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "4"]
    args += ["--trainer.check_val_every_n_epoch", "50", "--data.prompts", "amir_lightning.data.JsonlPrompts"]
    args += ["--data.prompts.init_args.path", str(data), "--data.bad_prompts", mode]
    if mode == "skip":  # 4 rollouts of 16 prompts: the 49 kept are all drawn once, the 50th would be the long one
        result = run_amir(args, tmp_path)
        assert f"skipping 1 of 50 training prompts that cannot be used: {data}:17 (81 tokens); the limit is 62" in (
            result.stderr
        )
        assert "rollout 4 of 4: reward" in result.stderr and "per rollout, 0 s left" in result.stderr
        scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
        assert scalars["data/skipped_prompts"] == [1.0] and len(scalars["rollout/reward_mean"]) == 4
        return
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"))
    failed = subprocess.run([sys.executable, "-m", "amir_lightning", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert failed.returncode == 2
    errors = [line for line in failed.stderr.splitlines() if line.startswith("amir: error:")]
    assert (
        len(errors) == 1
        and f"1 of 50 training prompts cannot be used: {data}:17 (81 tokens); the limit is 62" in (errors[0])
    )
    assert "Initializing a V1 LLM engine" not in failed.stdout + failed.stderr


def test_sampling_knobs_and_chat_template_variables_reach_the_engine(tmp_path):
    """``--data.sampling.min_p 0.05 --data.chat_template_kwargs '{enable_thinking: false}'``: the training rollouts'
    vLLM ``SamplingParams`` carry min_p (validation keeps its own sampling), and every prompt vLLM gets was rendered
    with the variable (the template writes ``==`` after the prompt when thinking is off)."""
    template = (
        "{% for message in messages %}{{ message['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}=={% endif %}"
    )
    (tmp_path / "chat.jinja").write_text(template)
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "1"]
    args += ["--data.engine", "engines.RecordsSampling", "--data.engine.init_args.max_model_len", "64"]
    args += ["--data.engine.init_args.kv_cache_memory_bytes", "33554432", "--data.engine.init_args.progress", "false"]
    args += ["--data.sampling.min_p", "0.05", "--data.chat_template_kwargs", "{enable_thinking: false}"]
    args += ["--data.chat_template", "chat.jinja", "--data.sampling.stop", '["99"]']
    args += ["--data.sampling.generation_kwargs", "{min_tokens: 1}", "--data.evaluation.val_size", "2"]
    args += ["--trainer.check_val_every_n_epoch", "1"]
    helpers = str(Path(__file__).parent / "helpers")
    env = dict(os.environ, PYTHONPATH=helpers + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_amir(args, tmp_path, env=env)
    calls = [json.loads(line) for line in (tmp_path / "sampling.jsonl").read_text().splitlines()]
    training = [c for c in calls if c["min_p"] == 0.05]
    assert len(training) == 1 and len(training[0]["prompts"]) == 16  # one rollout of 16 prompts
    assert training[0]["stop"] == ["99"] and training[0]["min_tokens"] == 1 and training[0]["temperature"] == 1.0
    assert all(c["min_p"] == 0.0 and not c["stop"] for c in calls if c not in training)  # validation sampling
    prompts = [p for c in calls for p in c["prompts"]]
    assert len(prompts) > 16 and [p for p in prompts if not p.endswith("===")] == []  # "{expression}=" then "=="


def test_a_reward_model_config_trains(tmp_path):
    """configs/tiny_reward_model.yaml: the tiny policy scored by a tiny random reward model (built and cached on first
    use) runs 3 rollouts; the reward model's scores are the rollout's rewards."""
    config = str(ROOT / "configs" / "tiny_reward_model.yaml")
    run_amir(["fit", "--config", config, "--trainer.max_epochs", "3"], tmp_path)
    scalars = read_scalars(tmp_path / "runs" / "tiny_reward_model")
    scores = scalars["rollout/reward/reward_model"]
    assert len(scores) == 3 and all(math.isfinite(s) for s in scores)
    assert scores == pytest.approx(scalars["rollout/reward_mean"], abs=1e-6)  # the only reward, weight 1
    assert len(set(scores)) == 3  # scores of what each rollout sampled, not a constant


def test_a_judge_config_trains(tmp_path):
    """configs/tiny_judge.yaml: a vLLM server this run starts serves the judge; 3 rollouts are graded by it, the share
    of its replies without a score is logged, and the server ends with the run."""
    import psutil

    config = str(ROOT / "configs" / "tiny_judge.yaml")
    run_amir(["fit", "--config", config, "--trainer.max_epochs", "3"], tmp_path)
    scalars = read_scalars(tmp_path / "runs" / "tiny_judge")
    scores = scalars["rollout/reward/judge"]
    assert len(scores) == 3 and all(0 <= s <= 1 for s in scores)
    assert scores == pytest.approx(scalars["rollout/reward_mean"], abs=1e-6)
    unparsed = scalars["judge/unparsed_frac"]  # what Reward.metrics says reaches TensorBoard each rollout
    assert len(unparsed) == 3 and all(0 <= f <= 1 for f in unparsed)
    left = [p for p in psutil.process_iter(["cmdline"]) if "--served-model-name" in (p.info["cmdline"] or [])]
    assert left == []  # no judge server outlives its run
