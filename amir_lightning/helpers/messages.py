"""Bad input in this package's words: one line that names the key, the value and what would be right.

jsonargparse and Lightning report a wrong value in their own terms (Python types, union alternatives, class paths);
``user_message`` rewrites what a user could not act on, and the hints name a moved key's new place or the closest
known option.
"""

from __future__ import annotations

import difflib
import importlib
import re

#: Keys that moved into an argument group (or were renamed), and where they live now.
MOVED_KEYS = {
    **{
        f"data.{key}": f"data.rollout.{key}"
        for key in (
            "group_size",
            "micro_batch_groups",
            "steps_per_rollout",
            "advantage_scale",
            "drop_zero_std_groups",
            "max_bad_rollouts",
        )
    },
    "data.prompts_per_epoch": "data.rollout.prompts_per_process",
    "data.rollout.prompts_per_epoch": "data.rollout.prompts_per_process",
    "data.mu": "data.rollout.passes",
    "data.rollout.mu": "data.rollout.passes",
    "data.sync_tolerance": "data.sync.tolerance",
    "data.overlong_prompts": "data.bad_prompts",
    **{f"data.{key}": f"data.evaluation.{key}" for key in ("val_size", "val_samples", "val_sampling")},
    **{f"data.eval_{key}": f"data.evaluation.{key}" for key in ("samples", "sampling", "ks", "logps")},
    "model.logprob_chunk_size": "model.scoring.chunk_size",
    "model.fused_logprobs": "model.scoring.fused_head",
    "model.packing": "model.scoring.packing",
    "model.attn_implementation": "model.scoring.attn_implementation",
    "model.log_entropy": "model.scoring.entropy",
    "model.export_dir": "model.export.dir",
    "model.export_every_n_epochs": "model.export.every_n_epochs",
    "model.export_format": "model.export.format",
    "model.loss.init_args.beta": "model.loss.init_args.kl_coef",
    **{
        f"model.loss.init_args.{old}": f"model.loss.init_args.pair_term.{new}"
        for old, new in (
            ("pair_beta", "beta"),
            ("margin", "margin"),
            ("pair_mode", "mode"),
            ("max_pairs_per_group", "max_per_group"),
            ("reduction", "reduction"),
            ("reference_free", "reference_free"),
        )
    },  # fmt: skip
    **{
        f"model.loss.init_args.{old}": f"model.loss.init_args.pair_weight.{new}"
        for old, new in (
            ("lambda_", "value"),
            ("lambda_schedule", "schedule"),
            ("lambda_min", "min"),
            ("lambda_max", "max"),
            ("ratio_low", "share_low"),
            ("ratio_high", "share_high"),
            ("lambda_up", "grow"),
            ("lambda_down", "shrink"),
            ("scale_ema", "scale_ema"),
        )
    },  # fmt: skip
}


def moved_key_hint(text: str) -> str:
    """`` (data.X is now data.group.X)`` for an old key named in ``text``, else ``""``."""
    for old, new in MOVED_KEYS.items():
        parent, _, name = old.partition(".init_args.") if ".init_args." in old else old.rpartition(".")
        dotted = re.escape(old)
        # the command line (--key), a config file (the key, or the option of its group), a component's arguments
        if re.search(rf"(--{dotted}\b|\b{dotted}\b|option '{re.escape(name)}'|Parser key \"{re.escape(parent)}\".*"
                     rf"[Oo]ption '{re.escape(name)}' is not accepted)", text, re.DOTALL):  # fmt: skip
            return f" ({old} is now {new})"
    return ""


def user_message(err: BaseException | str) -> str:
    """The useful part of an input error, on one line.

    jsonargparse reports a failing optional component as a Union mismatch listing every alternative (including
    "a path" and None) and the whole given value; only the component's own complaint is kept.
    """
    text = str(err)
    if "Does not validate against any of the Union subtypes" in text:
        head = text.splitlines()[0].strip() if text.startswith("Parser key") else ""
        errors = text.rsplit("Errors:", 1)[-1].split("Given value type:", 1)[0]  # the innermost of nested unions
        reasons = [line.strip().removeprefix("- ") for line in errors.splitlines()]
        noise = ("Expected a <class 'NoneType'>", "Expected a path but", "Expected a <class 'str'>")
        reasons = [r for r in reasons if r and not r.startswith(noise)]
        text = " ".join([head, *reasons]).strip() or text
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return _type_message(text) or _class_message(text) or text


_TYPE_ERROR = re.compile(
    r'Parser key "(?P<key>[^"]+)": (?:Problem with given class_path \'[^\']+\': Parser key "(?P<arg>[^"]+)": )?'
    r"Expected a (?P<type>.+?)\. Got value: (?P<value>.+)$"
)
_KINDS = {"<class 'int'>": "an integer", "<class 'float'>": "a number", "<class 'bool'>": "true or false"}


def _type_message(text: str) -> str | None:
    """A type error of jsonargparse in this package's words: "X must be an integer, got 'eight'".

    jsonargparse says "Parser key X: Expected a <class 'int'>. Got value: eight"; a component's argument is named
    by its full key (``model.loss.init_args.aggregation``).
    """
    found = _TYPE_ERROR.search(text)
    if found is None:
        return None
    key = found["key"] + (f".init_args.{found['arg']}" if found["arg"] else "")
    kind = _KINDS.get(found["type"])
    if kind is None and found["type"].startswith("typing.Literal["):
        kind = "one of " + ", ".join(re.findall(r"'([^']*)'", found["type"]))
    return f"{key} must be {kind or found['type']}, got {found['value']!r}"


_NO_CLASS = re.compile(
    r'Parser key "(?P<key>[^"]+)": Problem with given class_path \'(?P<path>[\w.]+)\': '
    r"module '(?P<module>[\w.]+)' has no attribute '(?P<name>\w+)'"
)


def _class_message(text: str) -> str | None:
    """An unknown ``class_path`` named with the classes its module has."""
    found = _NO_CLASS.search(text)
    if found is None:
        return None
    try:
        module = importlib.import_module(found["module"])
    except ImportError:
        return None
    classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
    close = difflib.get_close_matches(found["name"], classes, n=1)
    hint = f"did you mean {found['module']}.{close[0]}? " if close else ""
    return f"{found['key']}: {found['module']} has no class {found['name']} ({hint}it has: {', '.join(classes)})"


def close_option_hint(message: str, parser) -> str:
    """`` (did you mean --data.rollout.group_size?)`` for an unrecognized option close to a known one."""
    if "nrecognized arguments" not in message or moved_key_hint(message):
        return ""
    options = [o for o in getattr(parser, "_option_string_actions", {}) if o.startswith("--")]
    for given in re.findall(r"--[\w.]+", message):
        close = difflib.get_close_matches(given, options, n=1, cutoff=0.75)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""
