"""``amir fit`` in this process on ``configs/tiny.yaml`` with the HF engine: what the CLI wires around the loop.

Loggers, checkpoint and early-stopping callbacks, the data check of overlong prompts and a reward model config, each
a few rollouts of a few seconds, with no interpreter to start and no vLLM to import (``run_here``). What needs a
process of its own (signals, kills, several processes, vLLM itself) is in ``tests/e2e/``.
"""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import HF_ENGINE, read_scalars, run_here

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
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


@pytest.fixture
def amir(tmp_path, monkeypatch, capsys, caplog):
    """``amir(*args, expect=0)``: the CLI run here, in ``tmp_path``."""
    return lambda *args, expect=0: run_here(args, tmp_path, monkeypatch, capsys, caplog, expect)


def test_cli_swaps_loss_and_engine(amir, tmp_path):
    """The same YAML with the GRPO objective and the HF engine swapped in from the command line."""
    amir("fit", "--config", TINY, "--trainer.max_epochs", "2", "--model.loss", "amir_lightning.objectives.GRPOLoss",
         *HF_ENGINE, "--trainer.check_val_every_n_epoch", "1")  # fmt: skip
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    assert len(scalars["train/loss"]) == 2 and len(scalars["val/accuracy"]) == 2
    assert not AMIR_KEYS & set(scalars)  # no pair term in a GRPO run ...
    for key in CORE_KEYS | MONITOR_KEYS:  # ... but the same measurements, so GRPO and AMIR runs compare
        assert key in scalars and all(torch.isfinite(torch.tensor(scalars[key]))), key
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-4


def test_every_configured_logger_gets_every_metric(amir, tmp_path):
    """``--trainer.logger '[TensorBoardLogger, CSVLogger]'``: the rollout, loss and monitor scalars reach both."""
    amir("fit", "--config", TINY, "--trainer.logger", "[TensorBoardLogger, CSVLogger]", "--trainer.max_epochs", "2",
         *HF_ENGINE)  # fmt: skip
    tensorboard = read_scalars(tmp_path / "runs" / "tiny")
    (metrics,) = (tmp_path / "runs" / "tiny").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    columns = set(rows[0])
    for key in ("rollout/reward_mean", "train/loss", "amir/lambda", "length/gap", "throughput/train_frac"):
        logged = [float(r[key]) for r in rows if r.get(key)]
        assert len(logged) == 2 and logged == pytest.approx(tensorboard[key][:2]), key
    assert {k for k in tensorboard if not k.startswith("hp_")} <= columns | {"epoch"}


def test_checkpointing_and_early_stopping_watch_the_rollout_reward(amir, tmp_path):
    """A ``ModelCheckpoint(monitor="rollout/reward_mean", mode="max")`` keeps the best rollout's checkpoint while
    last.ckpt keeps following the newest, and ``EarlyStopping`` on the reward stops the run: both read
    ``trainer.callback_metrics``, which the rollout metrics reach (before, they went to the loggers only, and both
    callbacks failed on a missing metric)."""
    common = ["fit", "--config", TINY, "--trainer.check_val_every_n_epoch", "50", *HF_ENGINE]
    best = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.mode", "max"]
    best += ["--trainer.callbacks.monitor", "rollout/reward_mean", "--trainer.callbacks.dirpath", str(tmp_path / "b")]
    best += ["--trainer.callbacks.save_on_train_epoch_end", "true"]  # a rollout ends a training epoch
    amir(*common, "--trainer.max_epochs", "6", *best)
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    rewards = read_scalars(run_dir)["rollout/reward_mean"]
    kept = list((tmp_path / "b").glob("*.ckpt"))
    assert len(set(rewards)) > 1, rewards  # a best rollout to find
    assert len(kept) == 1 and f"epoch={rewards.index(max(rewards))}-" in kept[0].name, (kept, rewards)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert state["global_step"] == 6  # the newest state, whatever the reward did
    saved = [v for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint") and v["best_model_score"]]
    assert len(saved) == 1 and float(saved[0]["best_model_score"]) == pytest.approx(max(rewards), abs=1e-6)

    stop = ["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"]
    stop += ["--trainer.callbacks.monitor", "rollout/reward_mean", "--trainer.callbacks.mode", "max"]
    stop += ["--trainer.callbacks.stopping_threshold", "-1.0", "--trainer.callbacks.check_on_train_epoch_end", "true"]
    stop += ["--trainer.logger.init_args.name", "stopped"]
    amir(*common, "--trainer.max_epochs", "6", *stop)
    assert len(read_scalars(tmp_path / "runs" / "stopped" / "version_0")["rollout/reward_mean"]) == 1


def overlong_prompts(tmp_path) -> tuple[Path, list[str]]:
    """A JSONL of 50 prompts, one (line 17) longer than tiny.yaml leaves room for (max_model_len 64 minus 2 new
    tokens), and the arguments that train on it."""
    rows = [{"question": f"{i % 10}=", "answer": str(i % 10)} for i in range(50)]
    rows[16] = {"question": "7" * 80 + "=", "answer": "7"}
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["fit", "--config", TINY, "--trainer.max_epochs", "4", "--trainer.check_val_every_n_epoch", "50"]
    args += ["--data.prompts", "amir_lightning.data.JsonlPrompts", "--data.prompts.init_args.path", str(data)]
    return data, args


def test_an_overlong_prompt_is_skipped_counted_and_named_once(amir, tmp_path):
    """``data.bad_prompts: skip``: the run trains, the prompt is left out and counted, named once. 4 rollouts of 16
    prompts: the 49 kept are all drawn once, the 50th would be the long one."""
    data, args = overlong_prompts(tmp_path)
    # The HF engine has no max_model_len: the same limit as the config's vLLM engine's, given as data.max_prompt_tokens
    result = amir(*args, "--data.bad_prompts", "skip", *HF_ENGINE, "--data.max_prompt_tokens", "62")
    named = f"skipping 1 of 50 training prompts that cannot be used: {data}:17 (81 tokens); the limit is 62"
    assert result.stderr.count(named) == 1, result.stderr[-3000:]
    assert "rollout 4 of 4: reward" in result.stderr and "per rollout, 0 s left" in result.stderr
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    assert scalars["data/skipped_prompts"] == [1.0] and len(scalars["rollout/reward_mean"]) == 4


def test_an_overlong_prompt_is_one_line_naming_file_and_line_before_the_engine_starts(amir, tmp_path, monkeypatch):
    """``data.bad_prompts: error``: one line naming the file and line, before vLLM starts. (Before, the error came
    when the stream reached the prompt, mid-run, and again at every resume.)"""
    from amir_lightning.engines import VLLMEngine

    started = []
    monkeypatch.setattr(VLLMEngine, "start", lambda self, *args, **kwargs: started.append(args))
    data, args = overlong_prompts(tmp_path)
    result = amir(*args, "--data.bad_prompts", "error", expect=2)
    errors = [line for line in result.stderr.splitlines() if line.startswith("amir: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"1 of 50 training prompts cannot be used: {data}:17 (81 tokens); the limit is 62" in errors[0]
    assert started == []


def test_a_reward_model_config_trains(amir, tmp_path):
    """configs/tiny_reward_model.yaml: the tiny policy scored by a tiny random reward model (built and cached on first
    use) runs 3 rollouts; the reward model's scores are the rollout's rewards."""
    amir("fit", "--config", str(ROOT / "configs" / "tiny_reward_model.yaml"), "--trainer.max_epochs", "3", *HF_ENGINE)
    scalars = read_scalars(tmp_path / "runs" / "tiny_reward_model")
    scores = scalars["rollout/reward/reward_model"]
    assert len(scores) == 3 and all(math.isfinite(s) for s in scores)
    assert scores == pytest.approx(scalars["rollout/reward_mean"], abs=1e-6)  # the only reward, weight 1
    assert len(set(scores)) == 3  # scores of what each rollout sampled, not a constant


def test_help_lists_every_subcommand_and_a_subcommands_help_is_its_own(tmp_path, monkeypatch, capsys):
    """Only the subcommand named gets its parser built; the top-level help, which names none, still lists them all."""
    from conftest import amir_here

    code, out, _ = amir_here(["--help"], tmp_path, monkeypatch, capsys)
    assert code == 0 and all(f"    {name} " in out for name in ("fit", "validate", "test"))
    code, out, _ = amir_here(["validate", "--help"], tmp_path, monkeypatch, capsys)
    assert code == 0 and out.startswith("usage: amir [options] validate") and "--trainer.max_epochs" in out


def test_the_pipe_safe_stdout_is_closed_when_the_stream_it_writes_to_is():
    """A logging handler holding ``amir``'s stdout sees it closed once the stream beneath closes (a test's capture,
    a file), as it would see that stream itself; the broken pipe it survives is another matter."""
    import io

    from amir_lightning.helpers.console import PipeSafeStdout

    beneath = io.StringIO()
    stdout = PipeSafeStdout(beneath)
    assert stdout.write("a line\n") == 7 and not stdout.closed
    beneath.close()
    assert stdout.closed
