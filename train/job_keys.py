"""The job's own keys in a store anyone can reach: names derived from the job's secret, values signed with it.

torch's TCPStore (the rendezvous store the ranks, the watchdog and in-process recovery all use) has no
authentication: any user of a shared cluster who reaches its port can `set`, `delete_key`, `add` and (`list_keys`)
read every key. So whatever ddpack acts on from the store is written as `HMAC-SHA256(token, key + newline + value)`
in hex, a space, then the value, with the job's secret (DDPACK_JOB_TOKEN, which only the job's processes have), and
a value read back is believed only when its signature, over the whole key, checks out: another user can delete a key
or make one that does not verify, but cannot make one that does, nor move a signed value to another key or another
start of the job (the key names the start). Without a token (`docker run -e`, torchrun by hand: one user's
machine) values are written and read as they are.

One module for the watchdog's keys and recovery's, so that both sign the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

from entrypoint.plan import JOB_TOKEN_VAR

MAX_VALUE_BYTES = 4 << 20  # the largest value either reads: the watchdog's shared summary (~0.4 MB at 1,024 ranks)
# What Slurm and DNS accept as a node name: a host a store value names is believed only in this shape (the watchdog's
# heartbeats, whose hosts can reach Slurm's ExcNodeList; recovery's).
HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class BadValue(ValueError):
    """A value in the store that this job's processes did not write, or not in the shape they write it."""


def store_scope(environ: Mapping[str, str]) -> str:
    """Which start of the job the keys belong to: Slurm's requeue count, the step (a restart in the same
    allocation is a new step, under the same token) and torchrun's restart count. Every rank of a start reads
    the same; a signed value recorded in one start does not verify under another's keys."""
    return ".".join(environ.get(name) or "0" for name in ("SLURM_RESTART_COUNT", "SLURM_STEP_ID", "TORCHELASTIC_RESTART_COUNT"))


def store_prefix(name: str, environ: Mapping[str, str], token: str | None) -> str:
    """`name/<id>/<scope>/`, where `<id>` is derived from the token, never the token itself: TCPStore's
    `list_keys` shows every key to anyone who connects. Without a token, `name/<scope>/`."""
    if token is None:
        return f"{name}/{store_scope(environ)}/"
    job = hmac.new(token.encode(), b"ddpack-watchdog key names", hashlib.sha256).hexdigest()[:16]
    return f"{name}/{job}/{store_scope(environ)}/"


class Signer:
    """Seals values for, and opens values from, the keys of one job (`token`: its secret, or None: unsigned)."""

    def __init__(self, token: str | None) -> None:
        self._secret = token.encode() if token is not None else None

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def _signature(self, key: str, value: str) -> str:
        assert self._secret is not None
        return hmac.new(self._secret, f"{key}\n{value}".encode(), hashlib.sha256).hexdigest()

    def seal(self, key: str, value: str) -> str:
        """What is written under `key` (the full key, prefix included) for `value`."""
        return value if self._secret is None else f"{self._signature(key, value)} {value}"

    def open(self, key: str, raw: bytes | str, max_bytes: int = MAX_VALUE_BYTES) -> str:
        """The value written under `key`, from what the store holds there; BadValue when it is too large, not
        text, or not signed with this job's token for this key."""
        if len(raw) > max_bytes:
            raise BadValue(f"{len(raw):,} bytes; expected at most {max_bytes:,}")
        if isinstance(raw, str):
            text = raw
        else:
            try:
                text = bytes(raw).decode()
            except UnicodeDecodeError:
                raise BadValue("not UTF-8 text") from None
        if self._secret is None:
            return text
        signature, _, value = text.partition(" ")
        if not hmac.compare_digest(signature.encode(), self._signature(key, value).encode()):
            raise BadValue(f"not signed with this job's {JOB_TOKEN_VAR}")
        return value
