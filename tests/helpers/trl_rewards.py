"""Reward functions with TRL's full signature (``trainer_state``, ``log_metric``, ``log_extra``) for
``tests/test_reward_logging.py``."""


def first_digit(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
    """1 when the completion starts with the answer's digit; logs what it parsed and where the run stood."""
    parsed = [c.strip()[:1] for c in completions]
    log_extra("parsed", parsed)
    hits = [float(p == a) for p, a in zip(parsed, answer)]
    log_metric("hit_rate", sum(hits) / len(hits))
    log_metric("step_seen", trainer_state.global_step)
    log_metric("rollout_seen", trainer_state.rollout)
    return hits


def accuracy_like_trl(completions, solution, log_extra=None, **kwargs):
    """Written as TRL's ``trl.rewards.accuracy_reward`` is: ``solution`` a dataset column, ``log_extra`` optional."""
    parsed = [c.strip() for c in completions]
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("answer_parsed", parsed)
    return [float(p == s) for p, s in zip(parsed, solution)]


def warmup(completions, trainer_state, **kwargs):
    """A curriculum: the reward's scale grows with the run's progress (``global_step / max_steps``)."""
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress * len(c) for c in completions]


def wrong_length_column(completions, log_extra, **kwargs):
    """A bug: one value for the whole rollout."""
    log_extra("verdict", ["ok"])
    return [0.0] * len(completions)


def text_metric(completions, log_metric, **kwargs):
    """A bug: a metric that is not a number."""
    log_metric("mood", "fine")
    return [0.0] * len(completions)
