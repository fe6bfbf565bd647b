"""Model-based rewards: a sequence-classification reward model scored in batches, built tiny and random here."""

import pytest
import torch

from amir_lightning.data.base import Prompt
from amir_lightning.models import PRINTABLE_ALPHABET, TinyModel
from amir_lightning.rewards import RewardModel
from amir_lightning.rewards.inputs import RewardInputs


@pytest.fixture(scope="module")
def reward_source(tmp_path_factory):
    return TinyModel(alphabet=PRINTABLE_ALPHABET, head="reward", seed=3, cache_dir=str(tmp_path_factory.mktemp("rm")))


def inputs(prompts, completions):
    return RewardInputs(completions, prompts, [[1] * len(c) for c in completions], ["stop"] * len(completions))


def alone(reward, text):
    """The model's score of ``text`` in a batch of one, straight from transformers."""
    ids = reward.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return reward.model(input_ids=ids).logits[0, 0].item()


def test_a_batch_scores_what_each_conversation_scores_alone(reward_source):
    """Left padding with position ids that skip it: the scores of a batch of different lengths are each sequence's
    score alone, and the conversation is the prompt (its own messages, or the question as the user's) and the
    completion as the assistant's turn, in the reward model's chat template."""
    reward = RewardModel(reward_source, batch_size=3)
    prompts = [
        Prompt(question="What is 2 + 2?", answer="4"),
        Prompt(
            question="ignored",
            answer="",
            messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}),
        ),  # fmt: skip
        Prompt(question="1?", answer="1"),
        Prompt(question="A longer question about seven apples and three pears?", answer="10"),
    ]
    completions = ["4", "Blue, like the sky on a clear day.", "one", "Ten."]
    got = reward(inputs(prompts, completions))
    assert reward.name == "reward_model" and len(got) == 4
    texts = [
        "What is 2 + 2?4",
        "Be brief.Name a colour.Blue, like the sky on a clear day.",
        "1?one",
        "A longer question about seven apples and three pears?Ten.",
    ]  # the tiny tokenizer's chat template writes the messages' contents one after another
    assert [reward.text(p, c) for p, c in zip(inputs(prompts, completions).kwargs()["prompts"], completions)] == texts
    expected = [alone(reward, t) for t in texts]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    assert len(set(round(g, 4) for g in got)) == 4  # a random model still tells them apart


def test_an_overlong_sequence_is_scored_on_its_end(reward_source, caplog):
    reward = RewardModel(reward_source, max_length=8)
    long_text = "What is 2 + 2?" + "4" * 20
    (got,) = reward(inputs([Prompt(question="What is 2 + 2?", answer="4")], ["4" * 20]))
    assert got == pytest.approx(alone(reward, "4" * 8), abs=1e-5)
    assert got != pytest.approx(alone(reward, long_text), abs=1e-5)
    assert any("1 of 1 sequences are over max_length 8 tokens" in r.getMessage() for r in caplog.records)


def test_a_classifier_with_several_labels_is_refused(tmp_path):
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from amir_lightning.models import build_char_tokenizer

    tok = build_char_tokenizer("ab")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=3)  # fmt: skip
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reward = RewardModel(str(tmp_path))
    with pytest.raises(ValueError, match="reward_model.model .* has 3 outputs \\(num_labels\\): a reward model has"):
        reward(inputs([Prompt(question="a", answer="")], ["b"]))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"batch_size": 0}, "data.rewards: reward_model.batch_size must be >= 1, got 0"),
        ({"dtype": "fp8"}, "reward_model.dtype must be auto, float32, bfloat16 or float16, got 'fp8'"),
    ],
)
def test_bad_reward_model_settings_name_their_key(given, message):
    with pytest.raises(ValueError, match=message):
        RewardModel("unused", **given)
