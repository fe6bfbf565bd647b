"""End to end: ``amir fit`` on the tiny config with real vLLM learns, checkpoints, and exports a loadable policy.

The 30-rollout run is a process of its own, as a user starts it, and so is the W&B run (W&B writes its last rows as
the process ends); the runs that test what the CLI wires on top of it (``amir test`` and ``compare``, a resume,
sampling knobs, a judge server) run ``amir`` in this process (``run_here``): vLLM is imported already and no
interpreter starts."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_amir, run_here

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    run_amir(["fit", "--config", str(ROOT / "configs" / "tiny.yaml")], tmp, console_script=True)
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


def test_amir_test_reports_pass_at_k_and_compare_writes_the_analyses(tiny_run, tmp_path, monkeypatch, capsys, caplog):
    """``amir test`` of the trained export and of the untrained model on a digit-copy benchmark, then compare (in this
    process: what is under test is the CLI's wiring, not a process of its own)."""
    import warnings

    here = lambda args: run_here(args, tmp_path, monkeypatch, capsys, caplog)  # noqa: E731
    fixture = ROOT / "tests" / "fixtures" / "benchmarks" / "tiny_gsm8k.jsonl"
    bench = f"[{{class_path: amir_lightning.evaluation.BenchmarkPrompts, init_args: {{name: gsm8k, path: {fixture}}}}}]"
    common = ["test", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.benchmarks", bench]
    policy = ["--model.policy", "amir_lightning.models.HFModel", "--model.policy.init_args.name_or_path"]
    here([*common, *policy, str(tiny_run / "policy"), "--trainer.logger.init_args.name", "trained"])
    with warnings.catch_warnings(record=True) as warned:  # Lightning's advice is a warning: in this process, caught
        warnings.simplefilter("always")
        initial = here([*common, "--trainer.logger.init_args.name", "initial", "--trainer.enable_progress_bar", "true"])
    said = [str(w.message) for w in warned] + [initial.stderr]
    assert not [m for m in said if "sync_dist=True" in m]  # pass@k is reduced over processes already: no such advice
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
    result = here(["compare", str(runs["trained"]), str(runs["initial"]), "--labels", "trained", "initial", "--out",
                   str(out)])  # fmt: skip
    assert "compare.md" in result.stdout
    text = (out / "compare.md").read_text()
    assert "## gsm8k" in text and text.count("| ✓ | ✓ |") == 1 and (out / "margins_gsm8k.png").is_file()


def test_resume_continues_with_the_next_rollout(tiny_run, tmp_path, monkeypatch, capsys, caplog):
    """Resuming the 30-epoch run from last.ckpt for one more epoch runs exactly one rollout and one step, and the
    run's progress bar picks up at rollout 30 of 31.

    A model value given with ``--ckpt_path`` wins over the checkpoint's saved one (Lightning alone keeps the saved
    one), and the run says which values differ.
    """
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "31", "--ckpt_path"]
    args += [str(tiny_run / "checkpoints" / "last.ckpt"), "--model.max_grad_norm", "0.25"]
    result = run_here([*args, "--trainer.enable_progress_bar", "true"], tmp_path, monkeypatch, capsys, caplog)
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


def test_wandb_gets_scalars_histograms_and_the_sample_table(tmp_path, monkeypatch):
    """An offline W&B run beside TensorBoard: the scalars, the pair-margin histogram and the sample table reach it.

    A process of its own: W&B writes its last rows when the process ends (Lightning leaves the run open)."""
    pytest.importorskip("wandb")
    from helpers.wandb_log import history

    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = "{class_path: WandbLogger, init_args: {offline: true, save_dir: wandb_runs, project: tiny}}"
    config = str(ROOT / "configs" / "tiny.yaml")
    args = ["fit", "--config", config, "--trainer.logger", f"[TensorBoardLogger, {wandb}]", "--trainer.max_epochs", "2"]
    run_amir(args, tmp_path)
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


def test_sampling_knobs_and_chat_template_variables_reach_the_engine(tmp_path, monkeypatch, capsys, caplog):
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
    run_here(args, tmp_path, monkeypatch, capsys, caplog)  # tests/helpers (engines.RecordsSampling) importable
    calls = [json.loads(line) for line in (tmp_path / "sampling.jsonl").read_text().splitlines()]
    training = [c for c in calls if c["min_p"] == 0.05]
    assert len(training) == 1 and len(training[0]["prompts"]) == 16  # one rollout of 16 prompts
    assert training[0]["stop"] == ["99"] and training[0]["min_tokens"] == 1 and training[0]["temperature"] == 1.0
    assert all(c["min_p"] == 0.0 and not c["stop"] for c in calls if c not in training)  # validation sampling
    prompts = [p for c in calls for p in c["prompts"]]
    assert len(prompts) > 16 and [p for p in prompts if not p.endswith("===")] == []  # "{expression}=" then "=="


def test_a_judge_config_trains(tmp_path, monkeypatch, capsys, caplog):
    """configs/tiny_judge.yaml: a vLLM server this run starts serves the judge; 3 rollouts are graded by it, the share
    of its replies without a score is logged, and the server ends with the run."""
    import psutil

    config = str(ROOT / "configs" / "tiny_judge.yaml")
    run_here(["fit", "--config", config, "--trainer.max_epochs", "3"], tmp_path, monkeypatch, capsys, caplog)
    scalars = read_scalars(tmp_path / "runs" / "tiny_judge")
    scores = scalars["rollout/reward/judge"]
    assert len(scores) == 3 and all(0 <= s <= 1 for s in scores)
    assert scores == pytest.approx(scalars["rollout/reward_mean"], abs=1e-6)
    unparsed = scalars["judge/unparsed_frac"]  # what Reward.metrics says reaches TensorBoard each rollout
    assert len(unparsed) == 3 and all(0 <= f <= 1 for f in unparsed)
    left = [p for p in psutil.process_iter(["cmdline"]) if "--served-model-name" in (p.info["cmdline"] or [])]
    assert left == []  # no judge server outlives its run
