"""A new engine in one file, through the engine seam alone: ancestral sampling, token by token, from the policy's files.

``tests/test_rooms.py`` trains with it (``--data.engine helpers.toy_engine.ToyEngine``): adding an engine touches no
file of the package. It samples at the run's temperature and stops at EOS or ``max_new_tokens``; any other sampling
setting is refused at start (``check_sampling``).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from amir_lightning.engines import Completion, RolloutEngine, SamplingConfig
from amir_lightning.engines.base import seeded


class ToyEngine(RolloutEngine):
    """One prompt at a time, one token at a time, from the softmax at ``temperature``."""

    def start(self, model_dir, seed, device=None, local_rank=0, in_flight=False):  # noqa: D102
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
        self._started = True

    def check_sampling(self, sampling: SamplingConfig) -> None:  # noqa: D102
        if sampling != SamplingConfig(temperature=sampling.temperature, max_new_tokens=sampling.max_new_tokens):
            raise ValueError("ToyEngine samples at data.sampling.temperature up to max_new_tokens, nothing else")

    @torch.no_grad()
    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        with seeded(seed):
            return [[self._sample(list(prompt), sampling) for _ in range(n)] for prompt in prompts]

    def _sample(self, prompt: list[int], sampling: SamplingConfig) -> Completion:
        ids, logps = [], []
        while len(ids) < sampling.max_new_tokens:
            logits = self.model(torch.tensor([prompt + ids])).logits[0, -1].float() / sampling.temperature
            token = int(torch.multinomial(logits.softmax(-1), 1))
            ids.append(token)
            logps.append(float(logits.log_softmax(-1)[token]))
            if token == self.eos:
                return Completion(ids, "", logps, "stop")
        return Completion(ids, "", logps, "length")

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        state = dict(named_tensors)
        missing = set(self.model.state_dict()) - set(state) - {"lm_head.weight"}  # tied to the embeddings
        if missing:
            raise ValueError(f"ToyEngine: the push lacks {sorted(missing)[:3]}")
        self.model.load_state_dict(state, strict=False)

    @torch.no_grad()
    def score(self, prompt, completion):  # noqa: D102
        logits = self.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()
