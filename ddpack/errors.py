"""One way for every host verb to fail: a one-line message naming what is wrong and what to do."""

from __future__ import annotations

import sys
from collections.abc import Callable


class HostError(Exception):
    """An error the user can act on; `code` is the exit status (2 bad input, 1 failure)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def run_verb(verb: str, body: Callable[[], int | None]) -> int:
    """Run a verb's body; turn HostError and Ctrl-C into a one-line message and an exit code."""
    try:
        return body() or 0
    except HostError as exc:
        print(f"ddpack {verb}: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"ddpack {verb}: interrupted", file=sys.stderr)
        return 130
