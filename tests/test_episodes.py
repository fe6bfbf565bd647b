"""Multi-turn rollouts: tool replies inside the completion, masked out of the loss; the calculator; learning to call."""

import pytest
import torch
from conftest import read_scalars, run_here
from helpers.policy_tokens import SETTINGS, TOKEN_STATS, episode_groups, objective_step
from helpers.scripted import Scripted
from helpers.tools import Echo

from amir_lightning.data.base import Prompt
from amir_lightning.engines import HFEngine, SamplingConfig
from amir_lightning.environments import CalculatorEnvironment, ToolError
from amir_lightning.environments.base import EpisodeBatch, run_episodes
from amir_lightning.environments.calculator import evaluate_arithmetic
from amir_lightning.loop.batch import make_batch, make_groups
from amir_lightning.models import build_tiny_model
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12*7", 84),
        ("(3 + 4) ^ 2", 49),
        ("7 / 2", 3.5),
        ("-2 ** 3", -8),
        ("10 // 3 % 2", 1),
        ("+".join(["1"] * 150), 150),
        ("9 ** 64 * 9 ** 64", 9**128),
    ],
)
def test_the_calculator_computes_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    "expression", ["__import__('os').system('true')", "x + 1", "2 ** 100000", "1 / 0", "open('f')", "(1,2)"]
)
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        evaluate_arithmetic(expression)


def test_the_calculator_replies_to_the_turns_last_call_and_ends_an_episode_without_one():
    calculator = CalculatorEnvironment()
    assert calculator.stop == ["</calc>"]
    assert calculator.step(None, "First <calc>2+2</calc> then <calc>12*7</calc>") == "<result>84</result>"
    assert calculator.step(None, "<calc>7/2</calc>") == "<result>3.5</result>"
    with pytest.raises(ToolError, match=r"^<result>error: ZeroDivisionError"):  # an error reply, counted
        calculator.step(None, "<calc>1/0</calc>")
    assert calculator.step(None, "So the answer is \\boxed{84}.") is None


def test_a_call_whose_last_token_runs_past_the_closing_tag_is_still_a_call():
    """Engines stop at the token that completes a stop string, and a token can hold more: a tokenizer with the
    token ``><`` ends a call ``...</calc><``. The calculator still replies (to the turn cut at ``</calc>``), the
    reply does not repeat the ``<`` the policy wrote, and the episode's text reads as one call and one result."""
    from amir_lightning.engines import Completion
    from amir_lightning.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789*=<>/calrseut")
    tokenizer.add_tokens(["><"])
    merged = tokenizer.convert_tokens_to_ids("><")
    call = tokenizer("<calc>84*42</calc><", add_special_tokens=False)["input_ids"]
    assert call[-1] == merged  # the token that completes "</calc>" also writes the next "<"
    answer = tokenizer("=3528", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    seen = []

    class Calculator(CalculatorEnvironment):
        def step(self, state, message):
            seen.append(message)
            return super().step(state, message)

    def generate(ids, n, sampling, turn):
        assert sampling.stop == ["</calc>"]
        turn_ids = call if turn == 0 else answer
        return [[Completion(list(turn_ids), "", [-0.5] * len(turn_ids), "stop") for _ in range(n)] for _ in ids]

    prompt = Prompt(question="84*42", answer="3528")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    [[episode]] = run_episodes(
        Calculator(max_turns=3), EpisodeBatch([prompt], [[5, 6]], 1, sampling, Scripted(generate), None, tokenizer)
    )
    assert seen == ["<calc>84*42</calc>"]
    assert episode.text == "<calc>84*42</calc><result>3528</result>=3528" and episode.episode.tool_calls == 1
    reply = tokenizer("result>3528</result>", add_special_tokens=False)["input_ids"]
    assert episode.token_ids == call + reply + answer
    assert episode.loss_mask == [1] * len(call) + [0] * len(reply) + [1] * len(answer)


def test_a_checkpoint_keeps_a_pending_episode_whole(tmp_path):
    """A rollout sampled a rollout ahead is saved in the checkpoint as plain data: an episode comes back with its
    loss mask (the tool's reply still masked out) and its tool-call count, through ``torch.load(weights_only=True)``."""
    from amir_lightning.engines.base import Completion, Episode
    from amir_lightning.loop.pending import PendingRollout, SavedRollout

    logps, mask = [-0.1, 0.0, 0.0, -0.2, -0.3], [1, 0, 0, 1, 1]
    episode = Completion([5, 6, 7, 8, 9], "3+4?=7=7", logps, "stop", episode=Episode(mask, tool_calls=1))
    plain = Completion([5, 9], "3+4=7", [-0.4, -0.5], "length")
    prompt = Prompt(question="3+4=", answer="7")
    pending = PendingRollout([prompt], [[1, 2]], drawn_at=3, version=2, weights={}, completions=[[episode, plain]])
    torch.save(pending.state(), tmp_path / "pending.pt")
    saved = SavedRollout.from_state(torch.load(tmp_path / "pending.pt", weights_only=True))
    assert (saved.drawn_at, saved.version) == (3, 2)
    [[back, back_plain]] = saved.pending(pending.prompts, pending.prompt_ids).wait()
    assert back == episode and back.loss_mask == [1, 0, 0, 1, 1] and back.episode.tool_calls == 1
    assert back_plain == plain and back_plain.loss_mask is None and back_plain.episode is None


def test_a_checkpoint_written_before_the_episode_record_loads_its_episodes_whole():
    """Checkpoints older than ``Episode`` kept an episode's loss mask, turns and tool counts beside the completion's
    own fields (``logprobs`` the oldest name of the engine's log-probs): they load as the same completions."""
    from amir_lightning.engines.base import Completion, Episode
    from amir_lightning.loop.pending import SavedRollout

    core = {"token_ids": [5, 6, 7], "text": "7=7", "finish_reason": "stop", "versions": None}
    flat = {"tool_calls": 1, "tool_errors": 0, "tool_truncated": 0, "tool_cut": False, "turns": 2}
    flat |= {"tool_malformed": 0, "tool_seconds": 0.25, "messages": None, "calls": None, "outcome": None}
    old_episode = core | flat | {"sampling_logps": [-0.1, 0.0, -0.2], "loss_mask": [1, 0, 1]}
    old_plain = core | {"logprobs": [-0.3] * 3, "loss_mask": None} | flat | {"tool_calls": 0, "turns": 1}
    state = {"drawn_at": 3, "version": 2, "weights": {}, "generate_s": 1.0, "completions": [[old_episode, old_plain]]}
    [[episode, plain]] = SavedRollout.from_state(state).completions
    assert episode == Completion([5, 6, 7], "7=7", [-0.1, 0.0, -0.2], "stop", episode=Episode(
        [1, 0, 1], turns=2, tool_calls=1, tool_seconds=0.25))  # fmt: skip
    assert plain == Completion([5, 6, 7], "7=7", [-0.3] * 3, "stop") and plain.episode is None


@pytest.mark.parametrize(
    "make_loss",
    [lambda kw=kw: GRPOLoss(kl_coef=0.04, **kw) for _, kw in SETTINGS]
    + [lambda: GRPOLoss(aggregation="dapo", importance_sampling="sequence", sampling_correction="sequence_truncate"),
       lambda: AmirGRPOLoss(aggregation="bnpo", kl_coef=0.04)],
    ids=[label for label, _ in SETTINGS] + ["dapo gspo sequence_truncate", "amir bnpo"],
)  # fmt: skip
def test_a_step_of_episodes_trains_as_the_step_of_their_policy_tokens_alone(make_loss):
    """Tool replies are context: a step of 2 groups of 4 episodes (8-token replies between their turns, masked out)
    has the loss, the gradient and the token-normalised statistics of the same step built from the policy tokens
    alone, with the same per-token log-probs, under every aggregation (the replies' 96 tokens against the policy's
    110 made ``bnpo`` and ``dapo`` 0.534x, ``dr_grpo`` without L 0.579x, and every statistic 0.534x)."""
    data = episode_groups()
    loss = make_loss()
    ep_loss, ep_grad, ep_stats = objective_step(loss, data.episodes, data)
    bare_loss, bare_grad, bare_stats = objective_step(loss, data.policy_only, data)
    assert bare_grad.abs().sum() > 0 and float(bare_stats["rollout/engine_trainer_kl"]) > 0
    assert float(bare_stats["train/clip_frac"]) > 0 or loss.importance_sampling == "sequence"  # GSPO clips rarely
    torch.testing.assert_close(ep_loss, bare_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ep_grad, bare_grad, rtol=1e-5, atol=1e-7)
    assert set(ep_stats) == set(bare_stats) >= set(TOKEN_STATS)
    for key in bare_stats:
        torch.testing.assert_close(ep_stats[key], bare_stats[key], rtol=1e-5, atol=1e-7, msg=key)


def test_a_steps_lengths_are_its_policy_tokens():
    """``RolloutStep.lengths`` (what the normalisers divide by) is the loss mask's sum per completion."""
    from amir_lightning.loop.batch import build_steps, plan_steps

    data = episode_groups()
    (step,) = build_steps(plan_steps(data.episodes, 1, 1), pad_id=0)
    masks = torch.cat([batch.completion_mask.sum(-1) for batch in step.micro_batches])
    assert step.lengths.tolist() == masks.tolist() == [c.policy_tokens for g in data.policy_only for c in g.completions]
    assert all(c.policy_tokens < len(c.token_ids) for g in data.episodes for c in g.completions)


def test_the_logged_lengths_and_tokens_count_the_policys_tokens():
    """``length/mean``, ``length/max`` and the generated tokens count the policy's; replies: ``tools/reply_tokens``."""
    from amir_lightning.loop.collect import RolloutSettings, make_rollout
    from amir_lightning.rewards import MathAnswerReward

    data = episode_groups()
    completions = [g.completions for g in data.episodes]
    prompts = [Prompt(question=str(i), answer="1") for i in range(len(completions))]
    settings = RolloutSettings(group_size=4, prompts_per_process=2)
    rollout = make_rollout(prompts, [[1, 2]] * 2, completions, 1.0, [MathAnswerReward()], settings)
    own = torch.tensor([c.policy_tokens for group in completions for c in group], dtype=torch.float)
    every = torch.tensor([len(c.token_ids) for group in completions for c in group], dtype=torch.float)
    assert rollout.metrics["length/mean"] == pytest.approx(float(own.mean()))
    assert rollout.metrics["length/max"] == float(own.max()) and rollout.tokens == int(own.sum())
    assert rollout.metrics["tools/reply_tokens"] == pytest.approx(float((every - own).mean())) and (every > own).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", alphabet="0123456789=+?", seed=2)
    return path, AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_episodes_interleave_policy_turns_and_masked_replies_with_the_policys_log_probs(tiny):
    """A real engine (HF generate) through 3 turns with a reply between turns: each episode is its turns and
    replies in order; the loss mask is 0 exactly on the replies; every policy token's sampling log-prob is the
    policy's at that point of the whole episode (replies included as context), and the batch masks the replies."""
    path, model, tokenizer = tiny
    engine = HFEngine(batch_size=32, progress=False)
    engine.start(path, seed=0)
    prompts = [Prompt(question="3+4=", answer="7"), Prompt(question="12+5=", answer="17")]
    prompt_ids = [tokenizer(p.question)["input_ids"] for p in prompts]
    turns = []

    def generate(ids, n, sampling, turn):
        turns.append((len(ids), n, turn))
        torch.manual_seed(turn)
        return engine.generate(ids, n, sampling)

    sampling = SamplingConfig(temperature=0.8, max_new_tokens=3)
    groups = run_episodes(
        Echo(max_turns=3), EpisodeBatch(prompts, prompt_ids, 4, sampling, Scripted(generate), None, tokenizer)
    )
    assert [len(g) for g in groups] == [4, 4] and turns[0] == (2, 4, 0) and all(n == 1 for _, n, _ in turns[1:])
    reply = tokenizer("=12", add_special_tokens=False)["input_ids"]
    replied = 0
    for prompt, group in zip(prompt_ids, groups):
        for c in group:
            assert len(c.loss_mask) == len(c.token_ids) == len(c.sampling_logps) and c.episode.tool_calls <= 2
            masked = [i for i, m in enumerate(c.loss_mask) if m == 0]
            assert len(masked) == 3 * c.episode.tool_calls  # each reply is "=12", three tokens
            for start in range(0, len(masked), 3):
                assert [c.token_ids[i] for i in masked[start : start + 3]] == reply
            replied += c.episode.tool_calls
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logps = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1] / 0.8, -1)
            expected = logps.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
            own = torch.tensor(c.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(c.sampling_logps)[own], expected[own], atol=1e-4, rtol=0)
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert replied > 0
    rewards = torch.arange(8, dtype=torch.float)
    batch = make_batch(make_groups(prompts, prompt_ids, groups, rewards, rewards, rewards), pad_id=0)
    for row, c in enumerate(c for g in groups for c in g):
        assert batch.completion_mask[row, : len(c.token_ids)].tolist() == [float(m) for m in c.loss_mask]


@pytest.mark.slow
def test_the_tiny_policy_learns_to_call_the_tool(tmp_path, monkeypatch, capsys, caplog):
    """Two-number sums the tiny model cannot do, and a tool that answers when the policy writes ``?``: over 24
    rollouts the share of episodes that call it and the reward rise (the answer is graded on the episode's text).
    ``amir fit`` runs in this process (tests/helpers importable), its vLLM engine with it."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    args = ["fit", "--config", str(root / "configs" / "tiny.yaml"), "--trainer.max_epochs", "24"]
    args += ["--model.policy.init_args.alphabet", "0123456789=+?", "--data.environment", "tools.AnswerTool"]
    args += ["--data.prompts.init_args.num_terms", "2", "--data.prompts.init_args.template", "{expression}="]
    args += ["--data.val_prompts.init_args.num_terms", "2", "--trainer.check_val_every_n_epoch", "100"]
    args += ["--data.sampling.max_new_tokens", "2", "--model.loss.init_args.kl_coef", "0.0"]
    run_here(args, tmp_path, monkeypatch, capsys, caplog)
    scalars = read_scalars(tmp_path / "runs" / "tiny")
    calls, rewards = scalars["tools/call_frac"], scalars["rollout/reward_mean"]
    assert len(calls) == 24 and scalars["tools/reply_tokens"][-1] > 0
    assert sum(calls[-4:]) / 4 > sum(calls[:4]) / 4 + 0.3, calls
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
