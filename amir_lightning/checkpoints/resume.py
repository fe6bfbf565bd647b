"""Where a run's checkpoints go and which one it resumes from.

``--ckpt_path last`` finds the newest ``last.ckpt`` of the run's name (``resolve_resume``) and logs into the same
version folder, so a restarted job (preemption, a SLURM requeue) continues its run and its curves; ``auto`` does the
same, or starts fresh when there is none. Lightning alone looks for ``last`` only in the new run's own folder.
Checkpoint folders may be local or remote (any fsspec path); ``fit_checkpoints_to_storage`` decides how ``last.ckpt``
is kept there. Both act on the parsed configuration, before anything is built.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)


def resolve_resume(config) -> None:
    """Turn ``ckpt_path`` ``last`` / ``auto`` into this run's newest checkpoint, and log beside it.

    Looks in ``checkpoint.dirpath`` when set (a local or fsspec path), else in every ``version_N/checkpoints`` of
    the first logger's ``save_dir/name`` (TensorBoard, CSV), and, for a run that SLURM preempted and requeued, at
    Lightning's ``hpc_ckpt_N.ckpt`` in ``trainer.default_root_dir``, taken when it is newer. Found: ``ckpt_path``
    becomes that file and the logger's ``version`` that folder's, so the curves continue. Not found: ``auto``
    starts fresh; ``last`` is an error naming where it looked.
    """
    wanted = config.get("ckpt_path")
    if wanted not in ("last", "auto"):
        return
    found, version, where = _newest_last_checkpoint(config)
    hpc = _newest_hpc_checkpoint(config["trainer"].get("default_root_dir") or os.getcwd())
    if hpc is not None and (found is None or _modified(hpc) > _modified(found)):
        found = hpc
    if found is not None and version is None:  # checkpoints kept outside the logger's folders
        version = _newest_version(config)
    if found is None:
        if wanted == "last":
            raise FileNotFoundError(
                f"--ckpt_path last: no last.ckpt in {where}; --ckpt_path auto starts fresh when there is none"
            )
        log.warning("--ckpt_path auto: no last.ckpt in %s, starting a new run", where)
        config["ckpt_path"] = None
        return
    config["ckpt_path"] = found
    if version is not None:
        _first_logger(config)["init_args"]["version"] = version
    log.warning("--ckpt_path %s: resuming from %s", wanted, found)


def _first_logger(config):
    logger = config["trainer"].get("logger")
    logger = logger[0] if isinstance(logger, list) and logger else logger
    init = logger.get("init_args") if hasattr(logger, "get") else None
    return logger if init is not None and init.get("save_dir") is not None else None


def _logger_root(config) -> str | None:
    """``save_dir/name`` of the first logger, which holds its ``version_N`` folders; ``None`` without one."""
    logger = _first_logger(config)
    if logger is None:
        return None
    init = logger["init_args"]
    return posixpath.join(str(init["save_dir"]), init.get("name") or "")


def _versions(root: str) -> list[int]:
    """The numbers of the ``version_N`` folders under ``root``, newest first."""
    fs, path = url_to_fs(root)
    names = (posixpath.basename(p.rstrip("/")) for p in fs.glob(posixpath.join(path, "version_*")))
    return sorted((int(m.group(1)) for name in names if (m := re.fullmatch(r"version_(\d+)", name))), reverse=True)


def _newest_version(config) -> int | None:
    root = _logger_root(config)
    if root is None or _first_logger(config)["init_args"].get("version") is not None:
        return None
    versions = _versions(root)
    return versions[0] if versions else None


def _newest_last_checkpoint(config) -> tuple[str | None, int | None, str]:
    """``(last.ckpt, its logger version, where it was looked for)``; ``None`` for what is not there."""
    dirpath = config.get("checkpoint", {}).get("dirpath") if hasattr(config, "get") else None
    if dirpath:
        return _last_in(str(dirpath)), None, str(dirpath)
    root = _logger_root(config)
    if root is None:
        return None, None, "the run (set checkpoint.dirpath: the first logger has no save_dir/name folders)"
    given = _first_logger(config)["init_args"].get("version")
    if given is not None:
        folder = posixpath.join(root, given if isinstance(given, str) else f"version_{given}", "checkpoints")
        return _last_in(folder), None, folder
    for version in _versions(root):
        last = _last_in(posixpath.join(root, f"version_{version}", "checkpoints"))
        if last is not None:
            return last, version, posixpath.join(root, "version_*", "checkpoints")
    return None, None, posixpath.join(root, "version_*", "checkpoints")


def _last_in(folder: str) -> str | None:
    """``last.ckpt`` in ``folder``, or the newest whole checkpoint there when it links to one that is gone.

    ``last.ckpt`` links to the rollout's checkpoint; a process killed after writing the next one and removing the
    old one, but before relinking, leaves the link dangling. Temporary files and folders (``.name.tmp*``) and
    distributed checkpoints without Lightning's ``meta.pt`` are never whole.
    """
    fs, path = url_to_fs(folder)
    last = posixpath.join(path, "last.ckpt")
    if fs.exists(last):
        return _url(fs, folder, last)
    if not fs.isdir(path):
        return None
    saved = [
        p
        for p in fs.glob(posixpath.join(path, "*.ckpt"))
        if not posixpath.basename(p).startswith(".")
        and fs.exists(p)
        and (not fs.isdir(p) or fs.exists(posixpath.join(p, "meta.pt")))
    ]
    return _url(fs, folder, max(saved, key=lambda p: _modified(_url(fs, folder, p)))) if saved else None


def _newest_hpc_checkpoint(root: str) -> str | None:
    """Lightning's SLURM requeue checkpoint with the highest number (``hpc_ckpt_N.ckpt``) in ``root``, if any."""
    fs, path = url_to_fs(str(root))
    numbered = [
        (int(m.group(1)), p)
        for p in fs.glob(posixpath.join(path, "hpc_ckpt_*.ckpt"))
        if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", posixpath.basename(p)))
    ]
    return _url(fs, str(root), max(numbered)[1]) if numbered else None


def _url(fs, given: str, path: str) -> str:
    """``path`` as found by ``fs``, written as ``given`` was: with its protocol, or relative when it was."""
    if isinstance(fs, LocalFileSystem):
        return path if os.path.isabs(given) else os.path.relpath(path)
    return fs.unstrip_protocol(path)


def _modified(path: str) -> float:
    """Seconds since the epoch of ``path``'s last write (a link's target's); 0 where the filesystem does not say."""
    fs, local = url_to_fs(path)
    if isinstance(fs, LocalFileSystem):
        return os.path.getmtime(local)
    try:
        return fs.modified(local).timestamp()
    except (NotImplementedError, AttributeError, KeyError):
        return 0.0


def fit_checkpoints_to_storage(config) -> None:
    """Where checkpoints go decides how ``last.ckpt`` is kept; called on the config before anything is built.

    On a local disk ``last.ckpt`` links to the rollout's checkpoint (``save_last: link``, one write per rollout);
    a ``file://`` folder becomes its plain path, since Lightning links only those. A remote folder (``s3://``, any
    fsspec protocol, as ``checkpoint.dirpath`` or the first logger's ``save_dir``) has no links: each rollout
    writes ``last.ckpt`` in full, and without a monitor nothing else (``save_top_k: 0``), still one write. A monitor
    on this checkpoint would keep ``last.ckpt`` at the best rollout instead of the newest: said once.
    """
    checkpoint = config.get("checkpoint")
    if checkpoint is not None and checkpoint.get("monitor") is not None:
        log.warning(
            "checkpoint.monitor is set: Lightning then writes last.ckpt only when %s improves, so a restarted run "
            "would go back to that rollout. Keep checkpoint for the newest state and add a second ModelCheckpoint "
            "for the best: --trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint "
            "--trainer.callbacks.monitor %s",
            checkpoint["monitor"],
            checkpoint["monitor"],
        )
    if checkpoint is None or checkpoint.get("save_last") != "link":
        return
    dirpath = checkpoint.get("dirpath")
    where = str(dirpath) if dirpath else _logger_root(config)
    if where is None:
        return
    fs, local = url_to_fs(where)
    if isinstance(fs, LocalFileSystem):
        if dirpath and str(dirpath).startswith("file://"):
            checkpoint["dirpath"] = local
        return
    strategy = config["trainer"].get("strategy")
    name = strategy if isinstance(strategy, str) else str(strategy.get("class_path"))
    init = {} if isinstance(strategy, str) else (strategy.get("init_args") or {})
    if name.endswith("ModelParallelStrategy") and init.get("save_distributed_checkpoint", True):
        raise ValueError(
            f"checkpoint.dirpath {where}: FSDP2's distributed checkpoints (ModelParallelStrategy) are written to "
            "local paths only; give a shared local folder, or set "
            "trainer.strategy.init_args.save_distributed_checkpoint: false to write whole checkpoints there"
        )
    checkpoint["save_last"] = True
    if checkpoint.get("monitor") is None and checkpoint.get("save_top_k") == 1:
        checkpoint["save_top_k"] = 0
    log.info("checkpoints go to %s: no links there, so each rollout writes last.ckpt in full", where)


def keep_given_model_values(given, config) -> None:
    """On resume, the model values given to this run (``given``) win over the checkpoint's saved ones.

    Lightning lays the checkpoint's saved hyperparameters over the command line's; each value that differs is logged.
    """
    changed = [
        f"model.{key} {given[key]!r} (checkpoint: {config['model'][key]!r})"
        for key in given.keys()
        if key in config["model"] and config["model"][key] != given[key]
    ]
    if changed:
        log.warning("resuming with the values given to this run, not the checkpoint's: %s", "; ".join(changed))
        config["model"] = given
