"""Slurm hostlist and tasks-per-node parsing, in pure Python.

`scontrol show hostnames` is often missing inside a container image, so the launcher cannot shell out
to it; these parsers implement the same grammar for the forms Slurm actually emits.
"""

from __future__ import annotations

import itertools
import re

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class HostlistError(ValueError):
    """A hostlist or tasks-per-node string that does not follow Slurm's grammar."""


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: `a[1,2],b` -> [`a[1,2]`, `b`]."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError("nested '[' in hostlist")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError("unbalanced ']' in hostlist")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise HostlistError("unclosed '[' in hostlist")
    parts.append("".join(current))
    return parts


def _expand_range_set(body: str) -> list[str]:
    """Expand the inside of one bracket group, keeping zero padding: `01-03,7` -> 01 02 03 7."""
    values: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"bad range {item!r} in hostlist")
        if not sep:
            values.append(lo)
            continue
        start, stop = int(lo), int(hi)
        if stop < start:
            raise HostlistError(f"descending range {item!r} in hostlist")
        width = len(lo)  # Slurm pads every member to the width of the range's first number
        values.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return values


def _expand_pattern(pattern: str) -> list[str]:
    """Expand one comma-free pattern with any number of bracket groups (cartesian product)."""
    pieces = re.split(r"\[([^\]]*)\]", pattern)
    # re.split with one capture group alternates literal, group, literal, ...
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if "[" in piece or "]" in piece:
                raise HostlistError(f"unbalanced brackets in {pattern!r}")
            choices.append([piece])
        else:
            choices.append(_expand_range_set(piece))
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist (`ip-10-4-[33-35,40],gpu[01-02]`) into host names, in order."""
    text = hostlist.strip()
    if not text:
        raise HostlistError("empty hostlist")
    hosts: list[str] = []
    for pattern in _split_top_level(text):
        if not pattern:
            raise HostlistError("empty item in hostlist")
        if re.search(r"\s", pattern):
            raise HostlistError(f"whitespace in hostlist item {pattern!r}")
        hosts.extend(_expand_pattern(pattern))
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_*_TASKS_PER_NODE (`4(x2),2`) into one task count per node: [4, 4, 2]."""
    text = spec.strip()
    if not text:
        raise HostlistError("empty tasks-per-node string")
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if not match:
            raise HostlistError(f"bad item {item!r} (expected N or N(xM))")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count == 0 or repeat == 0:
            raise HostlistError(f"zero in item {item!r}")
        counts.extend([count] * repeat)
    return counts
