"""One way for every host verb to fail: a one-line message naming what is wrong and what to do."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class HostError(Exception):
    """An error the user can act on; `code` is the exit status (2 bad input, 1 failure: ddpack's own, never a job's,
    whose states exit 3 to 6, slurm_cli.EXIT_FOR_STATE)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# The host side's packages beyond the standard library (pyproject.toml's [host] extra): a verb that needs one that is
# missing says which, and how to install it, instead of a traceback.
HOST_PACKAGES = {
    "docker": "docker", "boto3": "boto3", "botocore": "boto3", "requests": "requests", "packaging": "packaging", "matplotlib": "matplotlib",
}  # fmt: skip


def run_verb(verb: str, body: Callable[[], int | None]) -> int:
    """Run a verb's body; turn HostError, a missing host package and Ctrl-C into a one-line message and an exit code,
    and a reader that closed the pipe (`| head`) into a quiet end."""
    try:
        return body() or 0
    except HostError as exc:
        print(f"ddpack {verb}: error: {exc}", file=sys.stderr)
        return exc.code
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in HOST_PACKAGES:
            raise
        print(
            f"ddpack {verb}: error: this needs the Python package {HOST_PACKAGES[top]!r}, which is not installed here; "
            "pip install 'ddpack[host]' (from the checkout: pip install -e '.[host]', or make venv)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"ddpack {verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ddpack ls | head`): stop quietly, as a program that SIGPIPE ends does (141), with
        # stdout pointed at /dev/null so that the interpreter's last flush has nowhere to fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
