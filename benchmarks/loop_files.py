"""Which library files and functions one rollout runs through, and how often control goes back and forth among them.

    python benchmarks/loop_files.py            # the engine in the training process (configs/tiny.yaml)
    python benchmarks/loop_files.py --server   # a vLLM server, 2 rollouts sampled ahead, partial rollouts

Runs ``configs/tiny.yaml`` (real vLLM, the math reward, AMIR-GRPO) for two rollouts in this process and records,
with ``sys.setprofile`` (every thread: the sampling threads too), every Python function of ``amir_lightning/`` and
``callbacks/`` called from the end of the first rollout to the end of the second: the weight sync, generation,
rewards, advantages, the steps and the monitors. ``--server`` runs ``VLLMServerEngine`` with
``data.rollout.max_staleness 2`` and ``partial_rollouts true``: two rollouts sample while the policy trains, and a
push reaches them in flight. Checkpoints are not written and validation is off. Work in the reward's grading
processes and in the server is not traced (other processes); ``rewards/sandbox.py`` and ``engines/server.py`` show
up as the callers that hand it over.

Prints the files (library, then monitors) with how many of their functions ran (comprehensions and lambdas count as
part of the function around them), then the follow cost of the loop:

- file-to-file hops: the distinct (caller file, callee file) pairs of direct calls between library files;
- upward calls: calls whose caller sits in a lower part of the package than the callee by the tier table of
  ``tests/test_imports.py``;
- back-and-forths, each a distinct place in the code (counted once however often it runs):
  re-entries, a call from file B into file A while A is still running below B on the same thread's stack
  (A -> B -> A: control comes back into a file that has not returned; the key is the caller's and the callee's
  function, the file chain is shown), and handed-over closures, a nested function (``<locals>`` in its qualified
  name, lambdas and generator expressions included) made in file A and run from file B (keyed by both functions;
  a place that is both counts as a closure). The caller is the nearest library frame below the callee, through
  Lightning, torch or the standard library; a thread's stack goes on below into the stack that started the thread,
  so a bound method handed to the sampling thread and calling back counts as a re-entry;
- late writes: the distinct (class.attribute, writing file) pairs where a library file other than the class's
  (or its library bases') sets an attribute of an instance after its ``__init__``/``__post_init__`` returned: the
  objects finished after their builder returned. Every class defined at the top of a loaded library module has its
  ``__setattr__`` wrapped while tracing.

The last line is machine-readable: ``back-and-forths <mode>: N (re-entries a, closures b), late writes: m``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY, MONITORS = ROOT / "amir_lightning", ROOT / "callbacks"
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")  # parts of the function around them
BUILDERS = ("__init__", "__post_init__", "__new__")  # an object's attributes written in these are not late
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}  # as tests/test_server_engine.py
AHEAD = 2  # --server: rollouts sampled ahead (data.rollout.max_staleness), with partial rollouts
ORIGIN = "_loop_files_origin"  # on a thread: the library stack that started it
Place = tuple[str, str]  # (file, function)


class LoopCounter:
    """The follow cost of the code under ``roots`` run while it is on (``start`` to ``stop``).

    ``install`` hooks threads (each started thread is profiled and remembers the library stack that started it),
    ``start`` turns counting on (the profile of this thread, the ``__setattr__`` of the library's classes),
    ``stop`` and ``uninstall`` undo them in turn.

    Args:
        roots: The library's folders: only files under them count.
        base: File names are shown relative to it (absolute without).
        tier_of: A file's layer (for the upward calls); ``None``: not counted.
    """

    def __init__(self, roots: Sequence[Path], base: Path | None = None, tier_of: Callable[[str], int] | None = None):
        self.roots = tuple(os.path.realpath(root) + os.sep for root in roots)
        self.base, self.tier_of = base, tier_of
        self.active = False
        self._names: dict[str, str | None] = {}
        self._owners: dict[type, set[str]] = {}
        self._patched: list[tuple[type, object]] = []
        self._thread_start = None
        self._profile_before = None
        self.watched = 0
        self.seen: dict[str, set[str]] = defaultdict(set)  # file -> functions run
        self.hops: set[tuple[str, str]] = set()
        self.upward: dict[tuple[str, str, str, str], int] = defaultdict(int)  # (caller, its function, callee, ...)
        self.reentries: dict[tuple[str, str, str, str], tuple[str, ...]] = {}  # the same key -> the file chain
        self.reentry_calls: dict[tuple[str, str, str, str], int] = defaultdict(int)
        self.closures: dict[tuple[str, str, str, str], int] = defaultdict(int)  # (caller, function, made in, closure)
        self.late_writes: dict[tuple[str, str, str], set[str]] = {}  # (class, attribute, writer file) -> functions

    # -- which code is ours -----------------------------------------------------------------------------------------

    def name(self, filename: str) -> str | None:
        """A library file's shown name, ``None`` for any other file (cached by the code's file name)."""
        try:
            return self._names[filename]
        except KeyError:
            path = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
            name = None
            if path.startswith(self.roots):
                name = os.path.relpath(path, self.base) if self.base is not None else path
            self._names[filename] = name
            return name

    @staticmethod
    def function(frame) -> tuple[object, str]:
        """The frame of the function ``frame`` runs in (a comprehension or lambda: the one around it) and its name."""
        while frame.f_code.co_qualname.endswith(INLINE) and frame.f_back is not None:
            if frame.f_back.f_code.co_filename != frame.f_code.co_filename:
                break  # a lambda or generator handed to another file: it stands for itself
            frame = frame.f_back
        return frame, frame.f_code.co_qualname

    def stack(self, frame) -> list[Place]:
        """The library (file, function) frames from ``frame`` down, then the stack that started this thread."""
        places = []
        while frame is not None:
            name = self.name(frame.f_code.co_filename)
            if name is not None:
                places.append((name, frame.f_code.co_qualname))
            frame = frame.f_back
        return places + list(getattr(threading.current_thread(), ORIGIN, ()))

    # -- hooks ------------------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Profile every thread started from now on (counting while on), each knowing the stack that started it."""
        counter, start = self, threading.Thread.start
        self._thread_start = start

        def started(thread, *args, **kwargs):
            setattr(thread, ORIGIN, tuple(counter.stack(sys._getframe(1))))
            return start(thread, *args, **kwargs)

        threading.Thread.start = started
        threading.setprofile(self.profile)

    def uninstall(self) -> None:
        """Undo ``install`` (threads already running keep a profile that does nothing while off)."""
        if self._thread_start is not None:
            threading.Thread.start = self._thread_start
            self._thread_start = None
        threading.setprofile(None)

    def start(self) -> None:
        """Count from here: this thread's profile on, the library's classes' ``__setattr__`` watched."""
        self.watched = self.watch_classes()
        self._profile_before = sys.getprofile()
        self.active = True
        sys.setprofile(self.profile)

    def stop(self) -> None:
        """Stop counting; the classes' ``__setattr__`` as they were."""
        self.active = False
        sys.setprofile(self._profile_before)
        for cls, own in reversed(self._patched):
            if own is None:
                delattr(cls, "__setattr__")
            else:
                cls.__setattr__ = own
        self._patched.clear()

    # -- calls ------------------------------------------------------------------------------------------------------

    def profile(self, frame, event, arg) -> None:
        """``sys.setprofile``'s function: each call into a library function (a generator's resumption too)."""
        if event != "call" or not self.active:
            return
        callee = self.name(frame.f_code.co_filename)
        if callee is None:
            return
        qualname = frame.f_code.co_qualname
        if not qualname.endswith(INLINE):
            self.seen[callee].add(qualname)
        back = frame.f_back
        if back is not None and qualname.endswith(INLINE) and back.f_code.co_filename == frame.f_code.co_filename:
            return  # a comprehension or lambda run by the function around it
        direct = back is not None and self.name(back.f_code.co_filename) is not None
        if direct:  # a library function calling another: the hops and the upward calls
            (_, caller_name), (_, callee_name) = self.function(back), self.function(frame)
            caller = self.name(back.f_code.co_filename)
            if caller != callee:
                self.hops.add((caller, callee))
            if self.tier_of is not None and self.tier_of(caller) < self.tier_of(callee):
                self.upward[caller, caller_name, callee, callee_name] += 1
        below = back
        while below is not None and self.name(below.f_code.co_filename) is None:
            below = below.f_back
        if below is not None:
            below, caller_name = self.function(below)
            rest = self.stack(below.f_back)
            caller = self.name(below.f_code.co_filename)
        else:  # the bottom of this thread's library stack: the stack that started the thread
            origin = list(getattr(threading.current_thread(), ORIGIN, ()))
            if not origin:
                return
            (caller, caller_name), rest = origin[0], origin[1:]
        if caller == callee:
            return
        key = (caller, caller_name, callee, qualname)
        if "<locals>" in qualname:
            self.closures[key] += 1
        elif any(file == callee for file, _ in rest):
            if key not in self.reentries:
                chain = [caller]
                for file, _ in rest:
                    if chain[-1] != file:
                        chain.append(file)
                    if file == callee:
                        break
                self.reentries[key] = (*reversed(chain), callee)
            self.reentry_calls[key] += 1

    # -- late writes ------------------------------------------------------------------------------------------------

    def watch_classes(self, modules: Iterable | None = None) -> int:
        """Wrap the ``__setattr__`` of each class defined at the top of a library module; how many were wrapped."""
        done = {cls for cls, _ in self._patched}
        for module in list(sys.modules.values()) if modules is None else modules:
            file = getattr(module, "__file__", None)
            if not file or self.name(file) is None:
                continue
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == module.__name__ and value not in done:
                    done.add(value)
                    self._watch(value)
        return len(self._patched)

    def _watch(self, cls: type) -> None:
        counter, own = self, cls.__dict__.get("__setattr__")
        inner = getattr(cls.__setattr__, "_loop_files_inner", cls.__setattr__)  # a base's, unwrapped

        def __setattr__(obj, name, value):
            inner(obj, name, value)
            if counter.active:
                counter.wrote(obj, name, sys._getframe(1))

        __setattr__._loop_files_inner = inner
        try:
            cls.__setattr__ = __setattr__
        except (TypeError, AttributeError):
            return
        self._patched.append((cls, own))

    def owners(self, cls: type) -> set[str]:
        """The library files that define ``cls`` and its bases."""
        if cls not in self._owners:
            files = (getattr(sys.modules.get(c.__module__), "__file__", None) for c in cls.__mro__)
            self._owners[cls] = {self.name(f) for f in files if f} - {None}
        return self._owners[cls]

    def wrote(self, obj, attribute: str, frame) -> None:
        """``obj.attribute`` was set by ``frame``: late when a library file other than its class's did so after
        its builder returned."""
        writer = self.name(frame.f_code.co_filename)
        if writer is None or writer in self.owners(type(obj)):
            return
        builder = frame
        while builder is not None:  # inside the object's own __init__ (or __post_init__), through any file: not late
            code = builder.f_code
            if code.co_name in BUILDERS and code.co_argcount and builder.f_locals.get(code.co_varnames[0]) is obj:
                return
            builder = builder.f_back
        key = (type(obj).__qualname__, attribute, writer)
        self.late_writes.setdefault(key, set()).add(self.function(frame)[1])

    # -- the totals -------------------------------------------------------------------------------------------------

    def back_and_forths(self) -> int:
        """Distinct places where control went back and forth: re-entries and handed-over closures."""
        return len(self.reentries) + len(self.closures)

    def summary(self, mode: str) -> str:
        """The machine-readable last line."""
        return (
            f"back-and-forths {mode}: {self.back_and_forths()} (re-entries {len(self.reentries)}, closures "
            f"{len(self.closures)}), late writes: {len(self.late_writes)}"
        )

    def report(self, mode: str) -> list[str]:
        """The back-and-forths and late writes, each place listed, and the summary line last."""
        lines = [f"\nback-and-forths ({mode}): {self.back_and_forths()} distinct places"]
        lines.append(f"  re-entries (a call back into a file still running below the caller): {len(self.reentries)}")
        for key, chain in sorted(self.reentries.items()):
            caller, caller_name, callee, callee_name = key
            lines.append(f"    {caller}:{caller_name} -> {callee}:{callee_name} ({self.reentry_calls[key]}x)")
            lines.append(f"      chain: {' -> '.join(chain)}")
        lines.append(f"  handed-over closures (made in one file, run from another): {len(self.closures)}")
        for (caller, caller_name, callee, callee_name), calls in sorted(self.closures.items()):
            lines.append(f"    {caller}:{caller_name} runs {callee}:{callee_name} ({calls}x)")
        lines.append(
            f"late writes (set from another file after the builder returned, {self.watched} classes watched): "
            f"{len(self.late_writes)}"
        )
        for (cls, attribute, writer), functions in sorted(self.late_writes.items()):
            lines.append(f"    {cls + '.' + attribute:40} by {writer}: {', '.join(sorted(functions))}")
        lines.append(self.summary(mode))
        return lines


def tier_of(tiers: list[set[str]]) -> Callable[[str], int]:
    """A library file's layer by ``tiers`` (``callbacks/`` above the package: monitors call into it)."""
    tier = {part: level for level, parts in enumerate(tiers) for part in parts}

    def of(name: str) -> int:
        path = ROOT / name
        if path.is_relative_to(MONITORS):
            return len(tiers)
        part = path.relative_to(LIBRARY).parts[0].removesuffix(".py")
        return tier.get(part, len(tiers) - 1)  # amir_lightning/__init__.py, __main__.py: the top

    return of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--server",
        action="store_true",
        help=f"a vLLM server, {AHEAD} rollouts sampled ahead (max_staleness {AHEAD}) with partial rollouts",
    )
    server = parser.parse_args().server
    began = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this tree's package, whatever is installed
    from lightning.pytorch.callbacks import Callback
    from test_imports import TIERS  # the package's layers, lowest first

    from amir_lightning.cli import main as amir

    counter = LoopCounter([LIBRARY, MONITORS], ROOT, tier_of(TIERS))

    class Trace(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 0:
                counter.start()
            else:
                counter.stop()

    Trace.__module__ = "__main__"
    sys.modules["__main__"].Trace = Trace  # for class_path: __main__.Trace
    counter.install()
    try:
        with tempfile.TemporaryDirectory() as folder:
            os.chdir(folder)
            os.environ["AMIR_CACHE"] = str(Path(folder) / "cache")
            args = ["fit", "--config", str(ROOT / "configs/tiny.yaml"), "--trainer.max_epochs", "2"]
            args += ["--checkpoint.save_on_train_epoch_end", "false", "--trainer.check_val_every_n_epoch", "100"]
            args += ["--trainer.callbacks+", "__main__.Trace", "--model.export.dir", str(Path(folder) / "policy")]
            if server:
                engine = {"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": SERVER}
                args += ["--data.engine", json.dumps(engine), "--data.rollout.max_staleness", str(AHEAD)]
                args += ["--data.rollout.partial_rollouts", "true"]
            amir(args)
    finally:
        counter.stop()
        counter.uninstall()
    mode = "server" if server else "colocated"
    for title, root in (("library", LIBRARY), ("monitors", MONITORS)):
        files = sorted(name for name in counter.seen if (ROOT / name).is_relative_to(root))
        print(f"\n{title}: {len(files)} files, {sum(len(counter.seen[name]) for name in files)} functions")
        for name in files:
            print(f"  {name:48} {len(counter.seen[name]):3d}  {', '.join(sorted(counter.seen[name]))[:150]}")
    where = f"server, {AHEAD} rollouts ahead, partial rollouts" if server else "colocated engine"
    print(f"\nfollow cost ({where}):")
    print(f"  file-to-file hops: {len(counter.hops)} distinct")
    upward = counter.upward
    print(f"  upward calls (a lower layer calling up): {len(upward)} distinct, {sum(upward.values())} calls")
    for (caller, caller_name, callee, callee_name), calls in sorted(upward.items()):
        print(f"    {caller + ':' + caller_name:70} -> {callee}:{callee_name} ({calls}x)")
    lines = counter.report(mode)
    print("\n".join(lines[:-1]))
    print(f"\nran in {time.perf_counter() - began:.0f} s")
    print(lines[-1])


if __name__ == "__main__":
    main()
