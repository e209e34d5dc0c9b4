"""`python -m entrypoint.agent [torchrun options] COMMAND ...`: torchrun, ending on a stop signal the
way the other launch shapes end.

Slurm (time limit, scancel, `--signal=USR1@N`) and `docker stop` signal the torchrun agent. The agent
forwards the signal to its workers, which agree to stop at the same step, snapshot on rank 0 and
exit 128+N, each with its one `stopped on ...` line; torchrun itself then raises SignalException and
would end with exit 1 and a 20-line traceback. Here that ending is exit 128+N, as when each rank is
its own Slurm task. A worker that fails ends the agent with that worker's exit code and one line
naming it (torchrun's 20-line ChildFailedError report would bury the worker's own last line, such
as the preflight's verdict). How long the workers get before torchrun kills them is `--shutdown-timeout`,
which the launcher sets from DDPACK_SHUTDOWN_TIMEOUT.

This module runs in the torchrun process, which imports torch anyway; the launcher never imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except SignalException as stop:
        sys.stdout.flush()
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        rank, first = failed.get_first_failure()
        code = first.exitcode if first.exitcode >= 0 else 128 - first.exitcode  # -N: killed by signal N
        more = len(failed.failures) - 1
        print(
            f"entrypoint: rank {rank} (local rank {first.local_rank}, pid {first.pid}) exited with code {code}"
            + (f"; {more} more rank{'s' if more > 1 else ''} failed" if more else ""),
            file=sys.stderr,
            flush=True,
        )
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
