"""Helpers of the engine tests: an "optimiser step" that moves every weight, and an engine that ignores pushes."""

import torch


def perturb(model, scale, seed):
    """An "optimiser step" that moves every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))


class SkipsPushes:
    """An engine that ignores weight pushes (what a silently failing sync looks like) but scores as usual."""

    def __init__(self, engine):
        self.engine = engine

    def load_weights(self, named_tensors):
        del named_tensors

    def score(self, prompt, completion):
        return self.engine.score(prompt, completion)
