"""Every shipped YAML parses against the CLI (class paths resolve, types check), and the twins differ only in
the objective."""

import sys
from pathlib import Path

import pytest
import yaml

from amir_lightning.cli import main

CONFIGS = sorted((Path(__file__).parents[1] / "configs").rglob("*.yaml"))


@pytest.fixture(autouse=True)
def _clean_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["amir"])  # the CLI is driven by its args, not pytest's


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"qwen.yaml", "qwen_grpo.yaml", "demo.yaml", "demo_grpo.yaml", "tiny.yaml", "tiny_grpo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["loss"]["class_path"].startswith("amir_lightning.objectives.")
    assert printed["trainer"]["reload_dataloaders_every_n_epochs"] == 1


@pytest.mark.parametrize("name", ["qwen", "demo", "tiny"])
def test_grpo_twin_differs_only_in_the_objective(name):
    root = Path(__file__).parents[1] / "configs"
    amir = yaml.safe_load((root / f"{name}.yaml").read_text())
    grpo = yaml.safe_load((root / f"{name}_grpo.yaml").read_text())
    assert amir["model"]["loss"]["class_path"].endswith("AmirGRPOLoss")
    assert grpo["model"]["loss"]["class_path"].endswith(".GRPOLoss")
    amir_args, grpo_args = amir["model"].pop("loss")["init_args"], grpo["model"].pop("loss")["init_args"]
    assert {k: v for k, v in amir_args.items() if k in grpo_args} == grpo_args  # shared GRPO settings agree
    amir["trainer"]["logger"]["init_args"].pop("name"), grpo["trainer"]["logger"]["init_args"].pop("name")
    assert amir == grpo


def test_bad_config_value_names_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (Path(__file__).parents[1] / "configs" / "tiny.yaml").read_text().replace("group_size: 8", "group_size: eight")
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(bad), "--print_config"])
    assert exit_info.value.code != 0
    assert "group_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        (["--data.group_size", "4"], "data.group_size is now data.rollout.group_size"),
        (["--data.eval_ks", "[1]"], "data.eval_ks is now data.evaluation.ks"),
        (["--data.sync_tolerance", "0.1"], "data.sync_tolerance is now data.sync.tolerance"),
        (["--data.overlong_prompts", "error"], "data.overlong_prompts is now data.bad_prompts"),
        (["--model.log_entropy", "false"], "model.log_entropy is now model.scoring.entropy"),
        (["--model.packing", "on"], "model.packing is now model.scoring.packing"),
        (["--model.export_dir", "out"], "model.export_dir is now model.export.dir"),
        (["--data.rollout.mu", "2"], "data.rollout.mu is now data.rollout.passes"),
        (["--data.rollout.prompts_per_epoch", "2"], "prompts_per_epoch is now data.rollout.prompts_per_process"),
        (["--model.loss.init_args.lambda_", "0.1"], "init_args.lambda_ is now model.loss.init_args.pair_weight.value"),
        (["--model.loss.init_args.beta", "0.1"], "model.loss.init_args.beta is now model.loss.init_args.kl_coef"),
    ],
)
def test_moved_keys_name_their_new_place(given, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"), *given, "--print_config"])
    assert exit_info.value.code == 2
    assert hint in capsys.readouterr().err


@pytest.mark.parametrize(
    ("old_line", "hint"),
    [
        ("  val_size: 4\n  evaluation: {", "data.val_size is now data.evaluation.val_size"),
        ("  log_entropy: true\n  max_grad_norm:", "model.log_entropy is now model.scoring.entropy"),
        ("      pair_beta: 0.3\n      pair_term:", "init_args.pair_beta is now model.loss.init_args.pair_term.beta"),
    ],
)
def test_a_config_file_with_an_old_key_names_its_new_place(tmp_path, capsys, old_line, hint):
    old = tmp_path / "old.yaml"
    text = (Path(__file__).parents[1] / "configs" / "tiny.yaml").read_text()
    anchor = old_line.split("\n", 1)[1]
    assert anchor in text
    old.write_text(text.replace(anchor, old_line, 1))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(old), "--print_config"])
    assert hint in capsys.readouterr().err


CALCULATOR = "amir_lightning.environments.CalculatorEnvironment"


@pytest.mark.parametrize(
    ("given", "length"),
    [
        ([], 2),
        (["--model.loss.init_args.max_completion_length", "5"], 5),
        (["--data.environment", CALCULATOR], 8),
        (["--data.environment", CALCULATOR, "--data.environment.max_turns", "3"], 6),
        (["--data.tools", '["amir_lightning.environments.calculator.calculator"]'], 8),
    ],
)
def test_dr_grpo_divides_by_the_completion_length_limit(given, length):
    """Dr. GRPO's L is a constant: ``data.sampling.max_new_tokens`` (2 in tiny.yaml) unless given, never the step's
    longest completion; for episodes, the policy-token limit: each of ``max_turns`` turns (4 by default) may write
    ``max_new_tokens`` (a tool's replies are not the policy's tokens)."""
    from amir_lightning.cli import build_cli

    tiny = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")
    cli = build_cli(["--config", tiny, "--model.loss.init_args.aggregation", "dr_grpo", *given], run=False)
    assert cli.model.loss.max_completion_length == length


def test_training_dr_grpo_without_its_length_is_an_error():
    import lightning as L

    from amir_lightning.models import HFModel
    from amir_lightning.objectives import GRPOLoss
    from amir_lightning.systems.module import AmirGRPOModule

    module = AmirGRPOModule(policy=HFModel("unused"), loss=GRPOLoss(aggregation="dr_grpo"))
    module.trainer = L.Trainer(accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match="max_completion_length must be set for aggregation dr_grpo"):
        module.setup("fit")


def test_sleep_mode_without_a_gpu_is_refused_in_one_line(capsys):
    """vLLM's sleep mode frees GPU memory through its CUDA allocator: asked for on a machine without CUDA, the run
    stops before any model loads, naming the key."""
    tiny = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")
    engine = "{class_path: amir_lightning.engines.VLLMEngine, init_args: {enable_sleep_mode: true}}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", tiny, "--data.engine", engine])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "data.engine.init_args.enable_sleep_mode needs a CUDA device" in err and "set it to false" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_short_reward_class_path_resolves_in_a_fresh_process():
    """``class_path: JudgeReward`` resolves as ``amir_lightning.rewards.JudgeReward`` does, though the package imports
    its classes on first use (the CLI imports every reward class). A fresh process: this one has imported them."""
    import subprocess

    rewards = "[{class_path: JudgeReward, init_args: {url: 'http://127.0.0.1:1'}}, {class_path: OverlongPenalty}]"
    args = ["fit", "--config", str(CONFIGS[0].parent / "tiny.yaml"), "--data.rewards", rewards, "--print_config"]
    command = [sys.executable, "-m", "amir_lightning", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = yaml.safe_load(result.stdout)["data"]["rewards"]
    paths = [reward["class_path"] for reward in printed]
    assert paths == ["amir_lightning.rewards.JudgeReward", "amir_lightning.rewards.OverlongPenalty"]


def test_a_config_that_leaves_the_loss_out_is_told_it_trains_amir_grpo(tmp_path, caplog):
    """A config ported from TRL or verl, without model.loss, trains AMIR-GRPO with its pair term: said at start."""
    import logging

    from amir_lightning.cli import build_cli

    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "tiny.yaml").read_text())
    del config["model"]["loss"]
    path = tmp_path / "ported.yaml"
    path.write_text(yaml.safe_dump(config))
    with caplog.at_level(logging.WARNING, logger="amir_lightning.cli.app"):
        build_cli(["--config", str(path)], run=False)
    assert "model.loss is not set: training AMIR-GRPO with its pair term" in caplog.text
    assert "set model.loss to amir_lightning.objectives.GRPOLoss for plain GRPO" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="amir_lightning.cli.app"):
        build_cli(["--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml")], run=False)
    assert "model.loss is not set" not in caplog.text
