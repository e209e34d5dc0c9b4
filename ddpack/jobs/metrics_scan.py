"""A run's digest (run_metrics.Digest) as `compare` and `export --summary` read it: kept beside the metrics
(read_digest), and made the first time without parsing every progress line (scan_digest).

Parsing a 20 MB metrics file line by line with json.loads takes about a second; nearly all of it is progress records,
of which a digest keeps a hundred and, of the rest, only counts them and takes the median of two fields. So the file
is read as bytes and split, in C, into the trainer's progress lines and the others:

- a *plain* progress line is one as train.metrics writes it (json.dumps of a flat record, ASCII): it begins
  `{"time": T, "kind": "progress", ` and ends with `}`, with no other brace, no backslash, no control byte and no
  byte past ASCII (a stretch of them checked and counted in one pass, _stretch). Its fields are taken by the bytes
  (a regular expression for `"samples_per_s": V` finds each line's one key: json.dumps writes each key once, and
  with no backslash no string can hold a quote), and its values parsed by json.loads all at once;
- every other line (start, eval, snapshot and end records, another program's progress, a torn or truncated line,
  a blank one) is read exactly as run_metrics.read_metrics reads it.

The progress records the digest keeps (each segment's first, its last KEEP_PROGRESS, the last at or below the step
the next segment resumed from) are parsed whole, found by counting lines from the ends of their stretch of the file.
A file in any other shape (not ASCII, a control character, a backslash or an inner brace in a progress line, a value
that is not plain JSON) gives None, and read_digest parses it in full: the scan is a faster way to the same digest,
never another answer (tests/test_metrics_scan.py holds it against the full parse). A sweep's stale points are
scanned a process a core (digest_stale): the scan is about 80 ms of one quiet core a 20 MB file, two thirds of it the
two regular expressions for `samples_per_s` and `mfu` and the parse of their values, where reading it takes 4 ms.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.jobs.run_metrics import (
    DIGEST,
    KEEP_PROGRESS,
    Digest,
    Run,
    Segment,
    digest_key,
    kept_records,
    metrics_path,
    metrics_record,
    read_preflight,
    read_run,
    split_segments,
    torn_line,
)

HEAD = rb'\{"time": -?[0-9][0-9.eE+-]*, "kind": "progress", '
PLAIN_HEAD = re.compile(HEAD)
# A newline after a line that does not end with `}`, or before one that does not begin as a plain progress line.
ODD_SEAM = re.compile(rb"\n(?:(?<!\}\n)|(?!" + HEAD + rb"))")


def _field(key: str, inside: int) -> re.Pattern[bytes]:
    """The value after each `"key": `, searched from the key's byte at `inside` and the whole key then checked
    behind it: sre looks for a pattern's first byte one byte at a time, and a quote, which a key begins with, is
    forty a progress line where `l` is five and `f` two (`samples_per_s` and `mfu` each 10 to 15% faster)."""
    return re.compile(key[inside:].encode() + b'(?<="' + key.encode() + rb')": ([^,}\n]*)')


FIELDS = {"samples_per_s": _field("samples_per_s", 4), "mfu": _field("mfu", 1), "global_step": _field("global_step", 1)}
LOSS = b'"loss": '
# Bytes json.dumps never writes, some of which str.splitlines splits at (so the full parse's lines are not the
# newline's): a file holding any is parsed in full.
CONTROL = (b"\0", b"\r", b"\x0b", b"\x0c", b"\x1c", b"\x1d", b"\x1e")
# A stretch of plain lines with every byte but braces, newlines, backslashes and CONTROL taken out is PLAIN_SHAPE once
# a line (_stretch): one pass in C that counts its lines and finds an inner brace, an escape or a control byte.
PLAIN_SHAPE = b"{}\n"
# Bytes past ASCII are kept too, so the same pass finds them (an odd line's are found by its decoding).
NOT_SHAPE = bytes(sorted(set(range(128)) - set(PLAIN_SHAPE + b"\\" + b"".join(CONTROL))))


class NotPlain(Exception):
    """The file is not in the shape the scan reads: parse it in full."""


@dataclass(frozen=True)
class Stretch:
    """Consecutive plain progress lines: data[begin:end], `count` lines, each ending with a newline."""

    begin: int
    end: int
    count: int


def _values(data: bytes, stretch: Stretch, name: str, present: bool = False) -> list[Any]:
    """The field's value on each line of the stretch that has it, in order (json's own parse of each value); with
    `present`, those that are not null (looked for in the bytes first: the list is walked only where one is)."""
    tokens = FIELDS[name].findall(data, stretch.begin, stretch.end)
    if not tokens:
        return []
    joined = b",".join(tokens)
    try:
        values = json.loads(b"[" + joined + b"]")
    except ValueError:  # a value that is not plain JSON (a list, a string with a comma): the full parse decides
        raise NotPlain from None
    return [v for v in values if v is not None] if present and b"null" in joined else values


def _line(data: bytes, begin: int) -> dict[str, Any]:
    record = json.loads(data[begin : data.index(b"\n", begin)])
    if not isinstance(record, dict):
        raise NotPlain
    return record


def _line_starts(data: bytes, stretch: Stretch, wanted: list[int]) -> dict[int, int]:
    """Where lines `wanted` (indices in the stretch) begin: the first and the last KEEP_PROGRESS counted from the
    stretch's ends; any other (the line a resume went back to, on a restarted run's segment) by splitting it."""
    found: dict[int, int] = {}
    back = [i for i in wanted if i >= stretch.count - KEEP_PROGRESS]
    if back:
        newline = stretch.end - 1  # the last line's
        for index in range(stretch.count - 1, min(back) - 1, -1):
            found[index] = data.rfind(b"\n", stretch.begin, newline) + 1 or stretch.begin
            newline = found[index] - 1
    if 0 in wanted:
        found[0] = stretch.begin
    if middle := [i for i in wanted if i not in found]:
        starts = [stretch.begin]
        for line in data[stretch.begin : stretch.end].split(b"\n", max(middle))[: max(middle)]:
            starts.append(starts[-1] + len(line) + 1)
        found.update({i: starts[i] for i in middle})
    return found


@dataclass
class _Part:
    """A segment as the scan assembles it: its records (the others) and its stretches of plain progress, in order."""

    segment: Segment
    pieces: list[dict[str, Any] | Stretch]

    def progress_count(self) -> int:
        return sum(p.count if isinstance(p, Stretch) else 1 for p in self.pieces)


def _parts(data: bytes, path: Path, warnings: list[str]) -> list[_Part]:
    """The file's segments, as run_metrics.split_segments would make them, with its plain progress left in bytes."""
    seams = [m.start() for m in ODD_SEAM.finditer(data)]
    odd: dict[int, int] = {}  # begin -> end of each line read as read_metrics reads it
    for seam in seams:
        before = data.rfind(b"\n", 0, seam) + 1
        after_end = data.find(b"\n", seam + 1)
        odd[before] = seam
        odd[seam + 1] = len(data) if after_end < 0 else after_end
    first_end = data.find(b"\n")
    if first_end < 0 or not PLAIN_HEAD.match(data):
        odd[0] = len(data) if first_end < 0 else first_end
    if not data.endswith(b"\n"):
        last = data.rfind(b"\n") + 1
        odd[last] = len(data)
    parts: list[_Part] = []

    def add(item: dict[str, Any] | Stretch) -> None:
        kind = "progress" if isinstance(item, Stretch) else item["kind"]
        if kind == "start" or not parts:  # split_segments' rule; a progress line into the pieces, in its place
            parts.append(_Part(segment=Segment(start=item if kind == "start" else None), pieces=[]))  # type: ignore[arg-type]
        if kind == "progress":
            parts[-1].pieces.append(item)
        elif kind != "start":
            parts[-1].segment.take(item)  # type: ignore[arg-type]

    cursor = 0
    for begin in sorted(odd):
        if begin < cursor:
            continue
        if begin > cursor:
            _stretch(data, cursor, begin, add)
        end = odd[begin]
        if any(data.find(mark, begin, end) >= 0 for mark in CONTROL):
            raise NotPlain  # a stretch's control bytes are its shape's
        text = data[begin:end].decode("ascii")
        cursor = end + 1
        if not text.strip():
            continue
        try:
            record = metrics_record(text)
        except ValueError:
            warnings.append(torn_line(data.count(b"\n", 0, begin) + 1, path))  # counted only for a torn line
            continue
        add(record)
    if cursor < len(data):
        _stretch(data, cursor, len(data), add)
    return parts


def _stretch(data: bytes, begin: int, end: int, add: Any) -> None:
    """Lines data[begin:end] (each begins as a plain progress line and ends with `}` and a newline, ODD_SEAM) as one
    Stretch; NotPlain where one holds another brace (a torn line with the next record appended to it), an escape or
    a control byte. One pass in C (NOT_SHAPE), where counting the newlines and the braces and finding each kind of
    byte took ten (bytes.count of one byte is a plain loop, slower than translate)."""
    shape = data[begin:end].translate(None, NOT_SHAPE)
    count = len(shape) // len(PLAIN_SHAPE)
    if shape != PLAIN_SHAPE * count:
        raise NotPlain
    add(Stretch(begin, end, count))


def _picked(data: bytes, part: _Part, following: Segment | None) -> list[dict[str, Any]]:
    """The segment's progress records a digest keeps (run_metrics.kept_records' choice), parsed."""
    count = part.progress_count()
    resume = following.start.get("global_step") if following is not None and following.start else None
    wanted = {0, *range(max(0, count - KEEP_PROGRESS), count)}
    if isinstance(resume, int):
        steps: list[Any] = []
        for piece in part.pieces:
            if isinstance(piece, Stretch):
                found = _values(data, piece, "global_step")
                if len(found) != piece.count:  # a line without one (or with null): read each in full
                    raise NotPlain
                steps += found
            else:
                steps.append(piece.get("global_step"))
        below = [i for i, step in enumerate(steps) if isinstance(step, int) and step <= resume]
        wanted |= set(below[-1:])
    records: list[dict[str, Any]] = []
    offset = 0
    for piece in part.pieces:
        size = piece.count if isinstance(piece, Stretch) else 1
        inside = sorted(i - offset for i in wanted if offset <= i < offset + size)
        if isinstance(piece, Stretch) and inside:
            starts = _line_starts(data, piece, inside)
            records += [_line(data, starts[i]) for i in inside]
        elif inside:
            records.append(piece)  # type: ignore[arg-type]
        offset += size
    return records


def _last_loss(data: bytes, parts: list[_Part]) -> Any:
    """The last progress record's loss that is not None (Digest.of's train_loss), read from the file's end."""
    for part in reversed(parts):
        for piece in reversed(part.pieces):
            if not isinstance(piece, Stretch):
                if piece.get("loss") is not None:
                    return piece["loss"]
                continue
            end = piece.end
            while (at := data.rfind(LOSS, piece.begin, end)) >= 0:
                value = _line(data, data.rfind(b"\n", piece.begin, at) + 1 or piece.begin).get("loss")
                if value is not None:
                    return value
                end = at
    return None


def scan_digest(path: Path, data: bytes) -> Digest | None:
    """The digest of the metrics file `path` whose bytes are `data`, equal to Digest.of(read_run(path)) reduced to
    its kept records; None where the file is not in the shape the scan reads (the caller parses it in full)."""
    warnings: list[str] = []
    try:
        parts = _parts(data, path, warnings)
        if not parts:
            return None  # no record: read_metrics' error
        rates: list[Any] = []
        mfus: list[Any] = []
        segments = []
        for index, part in enumerate(parts):
            following = parts[index + 1].segment if index + 1 < len(parts) else None
            part.segment.progress = _picked(data, part, following)
            segments.append(part.segment)
            for piece in part.pieces:
                if isinstance(piece, Stretch):
                    rates += _values(data, piece, "samples_per_s", present=True)
                    mfus += _values(data, piece, "mfu", present=True)
                else:
                    rates += [piece["samples_per_s"]] if piece.get("samples_per_s") is not None else []
                    mfus += [piece["mfu"]] if piece.get("mfu") is not None else []
        progress_count = sum(part.progress_count() for part in parts)
        train_loss = _last_loss(data, parts)
    except (NotPlain, ValueError):
        return None
    preflight = read_preflight(path.parent, warnings)
    run = Run(folder=path.parent, segments=segments, preflight=preflight, warnings=warnings)
    return Digest.summed(run, progress_count=progress_count, train_loss=train_loss, rates=rates, mfus=mfus)


def read_digest(run_dir: Path) -> Digest:
    """The run's Digest: its DIGEST when that was made from the metrics file as it is now (size, time, inode), else
    the metrics read once (scan_digest: the progress lines by their bytes, every other line parsed; a file in
    another shape in full) and the digest kept (best effort: a folder that cannot be written is read again next
    time). HostError (exit 2) where there is no metrics file or it holds no records."""
    from ddpack.jobs.run_json import write_json_atomic

    path = metrics_path(run_dir)
    key, cache = digest_key(path), path.parent / DIGEST
    if (kept := _kept_digest(path, key)) is not None:
        return kept
    try:
        scanned = scan_digest(path, path.read_bytes())
    except OSError:
        scanned = None  # read_run says why
    digest = scanned or Digest.of(read_run(path))
    run = digest.run
    try:
        if digest_key(path) == key:  # not appended to while it was read
            # A cache: a digest lost to a crash (or left empty, damaged) is made again from the metrics, where an fsync
            # a digest is ~20 ms of a disk shared with others (a second of a first compare of 100 points) and an
            # indented one 10 ms of CPU.
            write_json_atomic(cache, {"key": key, "records": kept_records(run.segments), "preflight": run.preflight, "warnings": run.warnings,
                                      "progress_count": digest.progress_count, "train_loss": digest.train_loss,
                                      "samples_per_s": digest.samples_per_s, "mfu": digest.mfu}, cache=True)  # fmt: skip
    except OSError:
        pass
    return digest


def _kept_digest(path: Path, key: list[int]) -> Digest | None:
    """The DIGEST beside the metrics file `path` where it was made from the file as it is now (`key`), else None."""
    from ddpack.jobs.run_json import not_a_run_of_yours

    cache = path.parent / DIGEST
    if not cache.is_file() or not_a_run_of_yours(cache) is not None:
        return None
    try:
        data = json.loads(cache.read_text())
        if data.get("key") != key:
            return None
        run = Run(folder=path.parent, segments=split_segments(data["records"]), preflight=data.get("preflight"),
                  warnings=list(data.get("warnings") or []))  # fmt: skip
        return Digest(run=run, progress_count=int(data["progress_count"]), train_loss=data.get("train_loss"),
                      samples_per_s=data.get("samples_per_s"), mfu=data.get("mfu"))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # a damaged digest: the metrics again


def digest_stale(run_dirs: list[Path]) -> list[Path]:
    """Make the DIGEST of each of `run_dirs` that has a metrics file but no digest of it as it is now, a process a
    core this process may use: a sweep's first `compare` is one scan a point, the scans are independent, and one
    core alone takes a second or more a 100 MB. The read_digest calls that follow then find them kept; a folder that
    cannot be written, or a file appended to meanwhile, is read again by its own read_digest (a head start, never
    another answer). The runs digested here: none where there is one core, or one stale run (read_digest alone)."""
    stale = []
    for run_dir in run_dirs:
        try:
            path = metrics_path(run_dir)
        except HostError:
            continue  # no metrics: read_digest says why
        if _kept_digest(path, digest_key(path)) is None:
            stale.append(run_dir)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # a Mac has no affinity
    workers = min(len(stale), cores)
    if workers < 2:
        return []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_digest_quietly, stale))
    return stale


def _digest_quietly(run_dir: Path) -> None:
    with contextlib.suppress(HostError):  # the run's own read_digest raises it where it is read
        read_digest(run_dir)
