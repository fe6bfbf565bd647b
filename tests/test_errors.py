"""Bad input gets one clear message naming the key or the file and line, exit status 2, and no traceback."""

import json
import sys
from pathlib import Path

import pytest

from amir_lightning.cli import main

ROOT = Path(__file__).parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
FIXTURES = ROOT / "tests" / "fixtures"
JSONL = "amir_lightning.data.JsonlPrompts"
ARITH = "amir_lightning.data.ArithmeticPrompts"


def files(tmp: Path) -> dict[str, str]:
    (tmp / "missing_answer.jsonl").write_text(
        json.dumps({"question": "a", "answer": "1"}) + "\n" + json.dumps({"question": "b"}) + "\n"
    )
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "list.jsonl").write_text("[1, 2]\n")
    (tmp / "no_config").mkdir(exist_ok=True)
    (tmp / "a_file").write_text("x")
    (tmp / "bad.yaml").write_text("data: [unclosed\n")
    return {
        name: str(tmp / name)
        for name in ("missing_answer.jsonl", "empty.jsonl", "list.jsonl", "no_config", "a_file", "bad.yaml")
    }


# (case id, extra arguments (@name@ stands for a file made by files()), expected fragment of the message)
CASES = [
    ("unknown key", ["--data.group_sizee", "8"], "--data.group_sizee 8 (did you mean --data.rollout.group_size?)"),
    ("wrong type", ["--data.rollout.group_size", "eight"], "data.rollout.group_size must be an integer, got 'eight'"),
    ("group_size 1 with pairs", ["--data.rollout.group_size", "1"], "data.rollout.group_size must be >= 2"),
    (
        "negative margin",
        ["--model.loss.init_args.pair_term.margin", "-1"],
        "model.loss.init_args.pair_term.margin must be >= 0",
    ),
    (
        "zero prompts per epoch",
        ["--data.rollout.prompts_per_process", "0"],
        "data.rollout.prompts_per_process must be >= 1",
    ),
    ("zero micro-batch", ["--data.rollout.micro_batch_groups", "0"], "data.rollout.micro_batch_groups must be >= 1"),
    ("zero token budget", ["--data.rollout.micro_batch_tokens", "0"], "data.rollout.micro_batch_tokens must be >= 1"),
    (
        "packing without the fused head",
        ["--model.scoring.packing", "on", "--model.scoring.fused_head", "false"],
        "model.scoring.packing: on needs model.scoring.fused_head: true",
    ),
    ("more steps than prompts", ["--data.rollout.steps_per_rollout", "99"], "data.rollout.steps_per_rollout (99)"),
    ("zero passes", ["--data.rollout.passes", "0"], "data.rollout.passes must be >= 1"),
    ("pass@k over samples", ["--data.evaluation.ks", "[1, 16]"], "data.evaluation.ks [1, 16]"),
    ("zero sync tolerance", ["--data.sync.tolerance", "0"], "data.sync.tolerance must be > 0"),
    ("zero temperature", ["--data.sampling.temperature", "0"], "sampling.temperature must be > 0"),
    ("top_p above one", ["--data.sampling.top_p", "1.5"], "sampling.top_p must be in (0, 1]"),
    ("no new tokens", ["--data.sampling.max_new_tokens", "0"], "sampling.max_new_tokens must be >= 1"),
    (
        "unknown aggregation",
        ["--model.loss.init_args.aggregation", "mean"],
        "model.loss.init_args.aggregation must be one of grpo, bnpo, dr_grpo, dapo, got 'mean'",
    ),
    (
        "zero pair beta",
        ["--model.loss.init_args.pair_term.beta", "0"],
        "model.loss.init_args.pair_term.beta must be > 0",
    ),
    ("lambda bounds crossed", ["--model.loss.init_args.pair_weight.min", "0.1"], "pair_weight: need 0 < min <= max"),
    ("clip range", ["--model.loss.init_args.epsilon", "1.5"], "model.loss.init_args.epsilon must be in [0, 1)"),
    ("negative KL", ["--model.loss.init_args.kl_coef", "-1"], "model.loss.init_args.kl_coef must be >= 0"),
    ("zero bad steps", ["--model.max_bad_steps", "0"], "model.max_bad_steps must be >= 1"),
    ("zero bad rollouts", ["--data.rollout.max_bad_rollouts", "0"], "data.rollout.max_bad_rollouts must be >= 1"),
    (
        "unknown loss class",
        ["--model.loss", "amir_lightning.objectives.NoSuchLoss"],
        "model.loss: amir_lightning.objectives has no class NoSuchLoss (it has: AmirGRPOLoss, GRPOLoss,",
    ),
    ("bad dtype", ["--model.dtype", "float33"], "model.dtype must be a floating torch dtype name"),
    ("bad trainable dtype", ["--model.trainable_dtype", "int8"], "model.trainable_dtype must be a floating torch"),
    ("FSDP1", ["--trainer.strategy", "fsdp"], "trainer.strategy fsdp is not supported: use lightning.pytorch.strat"),
    ("fp16", ["--trainer.precision", "16-true"], "trainer.precision='16-true' is not supported: use 32-true"),
    ("bad lora rank", ["--model.lora", "{r: 0}"], "model.lora needs r >= 1"),
    (
        "model path missing",
        [
            "--model.policy",
            "amir_lightning.models.HFModel",
            "--model.policy.init_args.name_or_path",
            "/nonexistent/model",
        ],
        "model path '/nonexistent/model' does not exist and is not a hub id like 'org/name' "
        "(model.policy.init_args.name_or_path)",
    ),
    (
        "model dir without config",
        ["--model.policy", "amir_lightning.models.HFModel", "--model.policy.init_args.name_or_path", "@no_config@"],
        "has no config.json",
    ),
    (
        "malformed JSONL line",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", str(FIXTURES / "malformed.jsonl")],
        "malformed.jsonl:2: not valid JSON",
    ),
    (
        "JSONL line not an object",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@list.jsonl@"],
        "list.jsonl:1: expected a JSON object",
    ),
    (
        "missing answer field",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@missing_answer.jsonl@"],
        "missing_answer.jsonl:2: missing field 'answer'",
    ),
    (
        "empty prompt set",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@empty.jsonl@"],
        "empty.jsonl: no prompts",
    ),
    (
        "prompt file missing",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "/nonexistent.jsonl"],
        "prompt file /nonexistent.jsonl does not exist",
    ),
    (
        "empty value range",
        ["--data.prompts", ARITH, "--data.prompts.init_args.min_value", "5", "--data.prompts.init_args.max_value", "3"],
        "min_value 5 > max_value 3",
    ),
    (
        "bad operators",
        ["--data.prompts", ARITH, "--data.prompts.init_args.operators", "/"],
        "operators must be drawn from '+-*', got '/'",
    ),
    (
        "unknown benchmark",
        ["--data.benchmarks", "[{class_path: amir_lightning.evaluation.BenchmarkPrompts, init_args: {name: gsm9k}}]"],
        "unknown benchmark 'gsm9k'",
    ),
    (
        "benchmark file missing",
        [
            "--data.benchmarks",
            "[{class_path: amir_lightning.evaluation.BenchmarkPrompts, init_args: {name: gsm8k, path: /none.jsonl}}]",
        ],
        "benchmark file /none.jsonl does not exist",
    ),
    (
        "unknown reasoning-gym task",
        ["--data.prompts", "amir_lightning.data.ReasoningGymPrompts", "--data.prompts.init_args.task", "no_such_task"],
        "no_such_task",
    ),
    (
        "dataloaders not reloaded",
        ["--trainer.reload_dataloaders_every_n_epochs", "2"],
        "trainer.reload_dataloaders_every_n_epochs must be 1",
    ),
    ("unwritable output dir", ["--trainer.logger.init_args.save_dir", "@a_file@/runs"], "Not a directory: '"),
    (
        "prompt longer than the context",
        ["--data.max_prompt_tokens", "1", "--data.engine", "amir_lightning.engines.HFEngine"],
        "over the limit of 1 (data.max_prompt_tokens",
    ),
    ("config file with a syntax error", ["--config", "@bad.yaml@"], "bad.yaml is not valid YAML: while parsing"),
    ("config file missing", ["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
]


def more_files(tmp: Path) -> dict[str, str]:
    """Files of the second table: undecodable, empty, wrongly typed, and checkpoints that are not ours."""
    import torch

    (tmp / "latin1.yaml").write_bytes("trainer: {max_epochs: 1}  # caf\xe9\n".encode("latin-1"))
    (tmp / "latin1.jsonl").write_bytes('{"question": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    (tmp / "empty.yaml").write_text("")
    (tmp / "object_question.jsonl").write_text(json.dumps({"question": {"text": "2+2"}, "answer": "4"}) + "\n")
    (tmp / "list_question.jsonl").write_text(json.dumps({"question": ["2+2"], "answer": "4"}) + "\n")
    (tmp / "bool_answer.jsonl").write_text(json.dumps({"question": "Is 2 even?", "answer": True}) + "\n")
    held_out = [{"question": f"{i}=", "answer": str(i)} for i in range(5)]
    held_out[3]["question"] = "3" * 80 + "="
    (tmp / "long_heldout.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held_out))
    (tmp / "text.ckpt").write_text("not a checkpoint\n")
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0}, tmp / "whole.ckpt")
    whole = (tmp / "whole.ckpt").read_bytes()
    (tmp / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    foreign = {"model.model.embed_tokens.weight": torch.zeros(7, 16), "model.lm_head.weight": torch.zeros(7, 16)}
    torch.save(
        {"state_dict": foreign, "epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6"}, tmp / "o.ckpt"
    )
    older = {k.replace("model.", "policy.", 1): v for k, v in foreign.items()}  # the weight names before model.*
    torch.save(
        {"state_dict": older, "epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6"}, tmp / "old.ckpt"
    )
    names = ("latin1.yaml", "latin1.jsonl", "empty.yaml", "object_question.jsonl", "list_question.jsonl")
    names += ("bool_answer.jsonl", "text.ckpt", "truncated.ckpt", "o.ckpt", "old.ckpt", "long_heldout.jsonl")
    return {name: str(tmp / name) for name in names}


RG = "amir_lightning.rewards.MathAnswerReward"
# The second table: bad inputs a new user tried after the first table existed (NaN and infinities, Lightning's own
# errors, the OS, undecodable files, wrongly typed data, foreign checkpoints). Same runner, same rules.
MORE_CASES = [
    (
        "tensor-parallel in-process engine",
        ["--data.engine", "amir_lightning.engines.VLLMEngine", "--data.engine.init_args.tensor_parallel_size", "2"],
        "data.engine.init_args.tensor_parallel_size 2: the in-process VLLMEngine streams weights into its worker",
    ),
    ("negative grad clip", ["--model.max_grad_norm", "-1"], "model.max_grad_norm must be > 0 or null, got -1"),
    ("NaN grad clip", ["--model.max_grad_norm", ".nan"], "model.max_grad_norm must be > 0 or null, got nan"),
    (
        "infinite margin",
        ["--model.loss.init_args.pair_term.margin", ".inf"],
        "init_args.pair_term.margin must be finite",
    ),
    ("NaN lambda", ["--model.loss.init_args.pair_weight.value", ".nan"], "pair_weight.value must be >= 0, got nan"),
    ("infinite pair beta", ["--model.loss.init_args.pair_term.beta", ".inf"], "pair_term.beta must be finite"),
    ("NaN KL", ["--model.loss.init_args.kl_coef", ".nan"], "model.loss.init_args.kl_coef must be >= 0, got nan"),
    ("infinite lambda growth", ["--model.loss.init_args.pair_weight.grow", ".inf"], "pair_weight.grow must be finite"),
    ("NaN epsilon_high", ["--model.loss.init_args.epsilon_high", ".nan"], "epsilon_high must be >= 0 or null, got nan"),
    (
        "NaN share band",
        ["--model.loss.init_args.pair_weight.share_high", ".nan"],
        "pair_weight.share_high must be >= 0, got nan",
    ),
    ("NaN sampling cap", ["--model.loss.init_args.sampling_cap", ".nan"], "sampling_cap must be >= 1"),
    ("NaN temperature", ["--data.sampling.temperature", ".nan"], "sampling.temperature must be > 0, got nan"),
    ("infinite temperature", ["--data.sampling.temperature", ".inf"], "sampling.temperature must be finite"),
    ("NaN top_p", ["--data.sampling.top_p", ".nan"], "sampling.top_p must be in (0, 1]"),
    ("negative top_k", ["--data.sampling.top_k", "-3"], "sampling.top_k must be >= 0"),
    (
        "NaN eval temperature",
        ["--data.evaluation.val_sampling", "{temperature: .nan}"],
        "sampling.temperature must be > 0",
    ),
    ("zero logprob chunk", ["--model.scoring.chunk_size", "0"], "model.scoring.chunk_size must be >= 1, got 0"),
    ("NaN LoRA dropout", ["--model.lora", "{r: 4, dropout: .nan}"], "model.lora.dropout nan: must be 0"),
    (
        "infinite LoRA alpha",
        ["--model.lora", "{r: 4, alpha: .inf}"],
        "model.lora.init_args.alpha must be an integer, got 'inf'",
    ),
    ("NaN sync tolerance", ["--data.sync.tolerance", ".nan"], "data.sync.tolerance must be > 0 or null"),
    ("infinite sync tolerance", ["--data.sync.tolerance", ".inf"], "data.sync.tolerance must be finite"),
    ("zero engine context", ["--data.engine.init_args.max_model_len", "0"], "init_args.max_model_len must be >= 1"),
    (
        "GPU share above one",
        ["--data.engine.init_args.gpu_memory_utilization", "1.5"],
        "data.engine.init_args.gpu_memory_utilization must be > 0 and <= 1, got 1.5",
    ),
    ("negative KV cache", ["--data.engine.init_args.kv_cache_memory_bytes", "-1"], "kv_cache_memory_bytes must be"),
    ("zero sequences", ["--data.engine.init_args.max_num_seqs", "0"], "init_args.max_num_seqs must be >= 1"),
    (
        "NaN reward weight",
        ["--data.rewards", f"[{{class_path: {RG}, init_args: {{weight: .nan}}}}]"],
        "amir: error: data.rewards: MathAnswerReward.weight must be a number, got nan\n",
    ),
    (
        "zero grading timeout",
        ["--data.rewards", f"[{{class_path: {RG}, init_args: {{timeout_s: 0}}}}]"],
        "amir: error: data.rewards: MathAnswerReward.timeout_s must be > 0, got 0\n",
    ),
    (
        "no grading workers",
        ["--data.rewards", f"[{{class_path: {RG}, init_args: {{num_workers: 0}}}}]"],
        "amir: error: data.rewards: MathAnswerReward.num_workers must be >= 1 or null, got 0\n",
    ),
    ("negative max_epochs", ["--trainer.max_epochs", "-5"], "trainer.max_epochs must be >= -1 or null, got -5"),
    (
        "validation every 0 epochs",
        ["--trainer.check_val_every_n_epoch", "0"],
        "trainer.check_val_every_n_epoch must be >= 1 or null, got 0",
    ),
    ("zero devices", ["--trainer.devices", "0"], "trainer: `Trainer(devices='0')` value is not a valid input"),
    ("unknown accelerator", ["--trainer.accelerator", "tpu"], "trainer.accelerator must be one of auto, cpu, gpu"),
    ("config is a directory", ["--config", "@no_config@"], "is a directory"),
    ("empty config file", ["--config", "@empty.yaml@"], "empty.yaml is empty"),
    ("undecodable config", ["--config", "@latin1.yaml@"], "latin1.yaml is not UTF-8"),
    (
        "undecodable JSONL",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@latin1.jsonl@"],
        "latin1.jsonl:1: not UTF-8 text (byte 18 of the line)",
    ),
    (
        "question is an object",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@object_question.jsonl@"],
        "object_question.jsonl:1: field 'question' must be text, got an object",
    ),
    (
        "question is a list",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@list_question.jsonl@"],
        "list_question.jsonl:1: field 'question' must be text, got a list",
    ),
    (
        "answer is a boolean",
        ["--data.prompts", JSONL, "--data.prompts.init_args.path", "@bool_answer.jsonl@"],
        "bool_answer.jsonl:1: field 'answer' must be text or a number, got a boolean",
    ),
    (
        "template without its placeholder",
        ["--data.prompts", ARITH, "--data.prompts.init_args.template", "What is it?"],
        "template must contain '{expression}'",
    ),
    ("checkpoint is text", ["--ckpt_path", "@text.ckpt@"], "text.ckpt is not a checkpoint"),
    ("checkpoint truncated", ["--ckpt_path", "@truncated.ckpt@"], "truncated.ckpt is not a checkpoint"),
    (
        "checkpoint missing",
        ["--ckpt_path", "/nonexistent/last.ckpt"],
        "--ckpt_path /nonexistent/last.ckpt does not exist",
    ),
    ("checkpoint of another model", ["--ckpt_path", "@o.ckpt@"], "o.ckpt was written by another model"),
    (
        "checkpoint of another model, older weight names",
        ["--ckpt_path", "@old.ckpt@"],
        "old.ckpt was written by another model",
    ),
    (
        "held-out prompt longer than the context",
        ["--data.val_prompts", JSONL, "--data.val_prompts.init_args.path", "@long_heldout.jsonl@"],
        "long_heldout.jsonl:4 has 81 tokens after the chat template, over the limit of 62",
    ),
    ("remote checkpoint missing", ["--ckpt_path", "memory://nowhere/last.ckpt"], "memory://nowhere/last.ckpt"),
    (
        "distributed checkpoints to a remote folder",
        ["--trainer.strategy", "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}"]
        + ["--checkpoint.dirpath", "memory://bucket/run"],
        "checkpoint.dirpath memory://bucket/run: FSDP2's distributed checkpoints (ModelParallelStrategy) are written",
    ),
    (
        "NaN heldout fraction",
        ["--data.prompts", ARITH, "--data.prompts.init_args.heldout_fraction", ".nan"],
        "heldout_fraction must be in (0, 1), got nan",
    ),
    ("NaN max bad steps", ["--model.max_bad_steps", ".nan"], "model.max_bad_steps must be an integer, got 'nan'"),
    (
        "more rollouts ahead than the run has",
        ["--data.engine", "amir_lightning.engines.VLLMServerEngine", "--data.rollout.max_staleness", "1000"]
        + ["--data.rollout.partial_rollouts", "true", "--trainer.max_epochs", "2"],
        "data.rollout.max_staleness 1000 is more than the run's 2 rollouts",
    ),
]


def run_bad_input(extra, expected, tmp_path, monkeypatch, capsys):
    paths = {**files(tmp_path), **more_files(tmp_path)}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AMIR_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["amir"])
    for name, path in paths.items():
        extra = [a.replace(f"@{name}@", path) for a in extra]
    args = ["fit", "--config", TINY, "--trainer.max_epochs", "1", *extra]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-2000:]
    assert expected in err, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize(("case", "extra", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_message(case, extra, expected, tmp_path, monkeypatch, capsys):
    run_bad_input(extra, expected, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize(("case", "extra", "expected"), MORE_CASES, ids=[c[0] for c in MORE_CASES])
def test_more_bad_input_gives_one_clear_message(case, extra, expected, tmp_path, monkeypatch, capsys):
    run_bad_input(extra, expected, tmp_path, monkeypatch, capsys)


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


def test_checkpoint_of_another_shape_or_objective_is_named():
    """The first mismatched parameter is named with both shapes; loss state of another objective is named too."""
    import torch

    from amir_lightning.checkpoints.checks import check_compatible

    own = {"model.lm_head.weight": (7, 16), "model.model.norm.weight": (16,), "loss.schedule.lambda_value": ()}
    saved = {"model.lm_head.weight": torch.zeros(7, 16), "model.model.norm.weight": torch.zeros(16)}
    saved["loss.schedule.lambda_value"] = torch.zeros(())
    check_compatible(own, saved, "a.ckpt")  # the same run: no error
    wider = {**saved, "model.lm_head.weight": torch.zeros(7, 32)}
    with pytest.raises(
        ValueError, match=r"another model: model.lm_head.weight has shape \(7, 32\) there and \(7, 16\)"
    ):
        check_compatible(own, wider, "a.ckpt")
    grpo = {k: v for k, v in own.items() if not k.startswith("loss.")}
    with pytest.raises(
        ValueError, match=r"another objective \(model.loss\): this run has no loss.schedule.lambda_value"
    ):
        check_compatible(grpo, saved, "a.ckpt")
    lora = {**own, "model.model.q_proj.lora_A.default.weight": (4, 16)}
    with pytest.raises(ValueError, match=r"another model: it has no model.model.q_proj.lora_A"):
        check_compatible(lora, saved, "a.ckpt")
    # A LoRA checkpoint leaves the frozen base weights out: they may be missing, the adapters may not.
    adapters = {k: v for k, v in saved.items() if k != "model.model.norm.weight"}
    adapters["model.model.q_proj.lora_A.default.weight"] = torch.zeros(4, 16)
    check_compatible(lora, adapters, "a.ckpt", optional={"model.model.norm.weight"})
    with pytest.raises(ValueError, match=r"it has no model.model.q_proj.lora_A"):
        check_compatible(lora, saved, "a.ckpt", optional={"model.model.norm.weight"})


def test_checkpoint_with_the_older_weight_names_is_mapped_and_other_names_are_not():
    """Weights saved as ``policy.<x>`` (before the module named them ``model``) are read as ``model.<x>``."""
    from collections import OrderedDict

    import torch

    from amir_lightning.checkpoints.checks import check_compatible, renamed_keys

    own = {"model.lm_head.weight": (7, 16), "model.model.norm.weight": (16,), "loss.schedule.lambda_value": ()}
    names = ["policy.lm_head.weight", "policy.model.norm.weight", "loss.schedule.lambda_value"]
    older = OrderedDict(zip(names, [torch.randn(7, 16), torch.randn(16), torch.tensor(0.5)], strict=True))
    older._metadata = OrderedDict([("", {}), ("policy", {}), ("policy.model", {}), ("loss", {})])
    mapped, renamed = renamed_keys(older)
    assert renamed and list(mapped) == ["model.lm_head.weight", "model.model.norm.weight", "loss.schedule.lambda_value"]
    for name, value in older.items():
        assert torch.equal(mapped[name.replace("policy.", "model.", 1)], value), name
    assert list(mapped._metadata) == ["", "model", "model.model", "loss"]
    check_compatible(own, mapped, "old.ckpt")  # the same run's weights: no error
    assert renamed_keys(mapped) == (mapped, False)  # the current names come back as they are
    # Mapped, then checked as before: another shape is still named, with the current name.
    wider, _ = renamed_keys({**older, "policy.lm_head.weight": torch.zeros(7, 32)})
    with pytest.raises(ValueError, match=r"another model: model.lm_head.weight has shape \(7, 32\) there"):
        check_compatible(own, wider, "old.ckpt")
    # Unrelated names are neither renamed nor let through.
    unrelated = {"encoder.weight": torch.zeros(7, 16), "loss.schedule.lambda_value": torch.tensor(0.5)}
    assert renamed_keys(unrelated) == (unrelated, False)
    with pytest.raises(ValueError, match=r"o.ckpt was written by another model: it has no model.lm_head.weight"):
        check_compatible(own, unrelated, "o.ckpt")
    both = {**unrelated, "policy.lm_head.weight": torch.zeros(7, 16), "model.model.norm.weight": torch.zeros(16)}
    assert renamed_keys(both) == (both, False)  # current names beside older ones: not ours to rename


def test_lightning_loads_an_older_checkpoint_into_the_model(tmp_path, caplog):
    """``on_load_checkpoint`` renames the older names before Lightning loads ``state_dict`` (one warning)."""
    import logging
    from types import SimpleNamespace

    import torch

    from amir_lightning.models import HFModel, build_tiny_model
    from amir_lightning.systems.module import AmirGRPOModule

    module = AmirGRPOModule(policy=HFModel(str(build_tiny_model(tmp_path / "model", seed=2))))
    module.configure_model()
    state = module.state_dict()
    assert any(k.startswith("model.") for k in state) and not any(k.startswith("policy.") for k in state)
    older = {
        (k.replace("model.", "policy.", 1) if k.startswith("model.") else k): v + 1 if v.is_floating_point() else v
        for k, v in state.items()
    }  # other values than the module's, to see them land
    torch.save({"state_dict": older, "epoch": 0, "global_step": 1}, tmp_path / "old.ckpt")
    checkpoint = torch.load(tmp_path / "old.ckpt", map_location="cpu", weights_only=True)
    module._trainer = SimpleNamespace(ckpt_path=str(tmp_path / "old.ckpt"), is_global_zero=True)
    with caplog.at_level(logging.WARNING):
        module.on_load_checkpoint(checkpoint)  # what Lightning's restore_model runs first
    module.load_state_dict(checkpoint["state_dict"])  # then this (the strategy's load_model_state_dict)
    assert caplog.text.count("was written with the older weight names policy.*: mapped to model.*") == 1
    loaded = module.state_dict()
    for name, value in older.items():
        assert torch.equal(loaded[name.replace("policy.", "model.", 1)], value), name
    # A checkpoint of another model still stops with the check's message, not a load error.
    foreign = {"state_dict": {"policy.lm_head.weight": torch.zeros(3, 5)}}
    with pytest.raises(ValueError, match=r"old.ckpt was written by another model"):
        module.on_load_checkpoint(foreign)


def test_distributed_checkpoint_with_the_older_weight_names_is_one_line(tmp_path):
    """FSDP2's folders load shard by shard into the current names: older ones stop at the start-up check."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from amir_lightning.checkpoints.checks import check_checkpoint

    for folder, prefix in (("older", "policy."), ("current", "model.")):
        weights = {f"{prefix}lm_head.weight": torch.zeros(7, 16)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process writes it
            dcp.save({"state_dict": weights}, checkpoint_id=str(tmp_path / folder), no_dist=True)
    check_checkpoint(str(tmp_path / "current"))
    with pytest.raises(ValueError, match=r"older\S* is a distributed checkpoint written with the older weight names"):
        check_checkpoint(str(tmp_path / "older"))


def test_older_whole_checkpoint_under_fsdp2_is_one_line(tmp_path, monkeypatch, capsys):
    """ModelParallelStrategy loads a whole checkpoint itself, before the module could rename the older names."""
    import torch

    from amir_lightning.cli.app import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["amir"])
    own, _ = build_cli(["--config", TINY], run=False).model.expected_shapes()
    older = {(f"policy.{k[6:]}" if k.startswith("model.") else k): torch.zeros(shape) for k, shape in own.items()}
    torch.save({"state_dict": older, "epoch": 0, "global_step": 1}, tmp_path / "older.ckpt")
    fsdp2 = ["--trainer.strategy", "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}"]
    expected = "older.ckpt was written with the older weight names (policy.*, now model.*), which ModelParallelStrategy"
    run_bad_input(["--ckpt_path", str(tmp_path / "older.ckpt"), *fsdp2], expected, tmp_path, monkeypatch, capsys)
