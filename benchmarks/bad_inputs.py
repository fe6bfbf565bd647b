"""Every bad input of tests/test_errors.py, run through ``amir fit``, with the one line it gets.

    python benchmarks/bad_inputs.py [--table first|second|all]

"good" means what the tests require: exit status 2, one ``amir: error:`` line holding the expected words (the key,
or the file and line), and no traceback. The table gives each case's verdict and its message; the last line counts
them. Cases run in this process, like the tests; the ones that get past the checks start the tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the cases that get as far as the engine stay quiet

from test_errors import CASES, MORE_CASES, TINY, files, more_files  # noqa: E402

from amir_lightning.cli import main as amir  # noqa: E402


def run_case(extra: list[str], paths: dict[str, str]) -> tuple[int | str, str]:
    """Exit status (or the exception's name) and everything written to stderr."""
    for name, path in paths.items():
        extra = [a.replace(f"@{name}@", path) for a in extra]
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            amir(["fit", "--config", TINY, "--trainer.max_epochs", "1", *extra])
        code: int | str = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - an uncaught error is a verdict here, not a crash of the table
        import traceback

        err.write("Traceback (most recent call last):\n" + "".join(traceback.format_exception(exc)))
        code = type(exc).__name__
    finally:
        logging.getLogger().removeHandler(handler)
    return code, err.getvalue()


def verdict(code: int | str, err: str, expected: str) -> tuple[bool, str]:
    """Whether the case is handled as the tests require, and the line to show."""
    lines = [line for line in err.splitlines() if line.startswith("amir: error:")]
    good = code == 2 and len(lines) == 1 and expected in err and "Traceback" not in err
    if lines:
        shown = lines[0].removeprefix("amir: error: ")
    elif "Traceback" in err:
        tail = [line for line in err.splitlines() if line.strip()][-1]
        shown = f"traceback ({sum(1 for _ in err.splitlines())} lines): {tail}"
    else:
        shown = f"exit {code}, no message"
    return good, shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=("first", "second", "all"), default="second")
    args = parser.parse_args()
    cases = {"first": CASES, "second": MORE_CASES, "all": CASES + MORE_CASES}[args.table]
    os.environ.pop("AMIR_DEBUG", None)
    rows, good_count = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AMIR_CACHE"] = str(Path(tmp) / "cache")
        os.chdir(tmp)
        paths = {**files(Path(tmp)), **more_files(Path(tmp))}
        for name, extra, expected in cases:
            code, err = run_case(list(extra), paths)
            good, shown = verdict(code, err, expected)
            good_count += good
            rows.append((name, "good" if good else "BAD", shown.replace("|", "\\|")[:160]))
    print("| case | verdict | what the user sees |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{good_count}/{len(cases)} good ({args.table} table)")


if __name__ == "__main__":
    main()
