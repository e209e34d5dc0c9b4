"""The metrics scan (ddpack/jobs/metrics_scan.py) against the full parse it stands in for: the same digest on files
with restarts, evals, torn and truncated lines, records before the first start and other programs' progress lines;
and the plain files, the trainer's own, taken by the fast path (not handed to the full parse)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ddpack.jobs.metrics_scan import digest_stale, read_digest, scan_digest
from ddpack.jobs.run_metrics import DIGEST, Digest, kept_records, read_run


def progress(step: int, **more: Any) -> dict[str, Any]:
    fields = {"epoch": 0, "step": step, "global_step": step, "loss": 1.0 / step, "lr": 3e-4, "samples_per_s": 100.0 + step % 7,
              "mfu": 0.25 + step % 5 / 100, "rank_step_s": [0.04, 0.05]}  # fmt: skip
    return {"time": 1e9 + step, "kind": "progress", **fields, **more}


def line(record: dict[str, Any]) -> str:
    return json.dumps(record) + "\n"  # as train.metrics writes it


def restarted_run() -> str:
    """Two segments (the second resumed from step 45, more than KEEP_PROGRESS lines before the eval that ends its
    stretch of plain lines, so steps 46-150 were trained twice), evals, a
    snapshot, a torn line of its own, a blank line, a record whose loss is null, MFU missing on some steps."""
    text = line({"time": 1e9, "kind": "start", "global_step": 0, "total_steps": 300, "hosts": ["n1", "n2"], "config": {"lr": 3e-4}})
    for step in range(1, 151):
        record = progress(step, loss=None) if step == 150 else progress(step)
        if step % 3 == 0:
            del record["mfu"]
        text += line(record)
        if step % 100 == 0:
            text += line({"time": 1e9 + step, "kind": "eval", "global_step": step, "eval_loss": 2.0 / step, "acc": 0.5})
        if step == 100:
            text += line({"time": 1e9 + step, "kind": "snapshot", "global_step": step, "path": "snapshots/step-100"})
        if step == 120:
            text += '{"time": 1000000120.5, "kind": "progress", "epoch": 0, "st\n\n'  # killed mid-write; the writer's newline
    text += line({"time": 1e9 + 151, "kind": "end", "outcome": "stopped", "global_step": 150})
    text += line({"time": 1e9 + 200, "kind": "start", "global_step": 45, "total_steps": 300, "hosts": ["n3", "n4"]})
    for step in range(46, 301):
        text += line(progress(step, samples_per_s=200 + step % 4, **({"loss": None} if step >= 299 else {})))  # ints: json's int
    text += line({"time": 1e9 + 400, "kind": "end", "outcome": "done", "global_step": 300, "checksum": "ab12"})
    return text


def mfu_first(text: str) -> str:
    """Each progress record with its mfu right after its kind, before samples_per_s (another program's order)."""
    lines = []
    for each in text.splitlines(keepends=True):
        try:
            record = json.loads(each)
        except ValueError:
            lines.append(each)
            continue
        lines.append(
            line({"time": record.pop("time"), "kind": record.pop("kind"), "mfu": record.pop("mfu"), **record}) if "mfu" in record else each
        )
    return "".join(lines)


CASES = {
    "restarted": restarted_run(),
    "truncated last line": restarted_run() + line(progress(301))[:40],
    "records before the first start": "".join(line(progress(s)) for s in range(1, 80)) + restarted_run(),
    # An older trainer appended the next start's record to a torn line: one line, no record, a warning.
    "torn line with a record appended": restarted_run().replace(line(progress(91)), line(progress(91))[:60] + line(progress(91))),
    "another program's progress": restarted_run().replace(line(progress(100)), json.dumps(progress(100), separators=(",", ":")) + "\n"),
    "odd values": restarted_run().replace(line(progress(10)), line(progress(10, samples_per_s=None, mfu=float("nan")))),
    "no newline at all": line(progress(1)).rstrip("\n"),
    "not ascii": restarted_run().replace(line(progress(5)), line(progress(5, note="é"))).replace("\\u00e9", "é"),
    "a lone start": line({"time": 1e9, "kind": "start", "global_step": 0, "total_steps": 3}),
    "windows line ends": restarted_run().replace("\n", "\r\n"),
    "padded with NULs": restarted_run() + "\0" * 64,  # a crash's sparse tail
    # One progress line's shape broken (each line of a stretch must be one `{`, one `}`, no escape, no control byte):
    "a brace in a progress line's string": restarted_run().replace(line(progress(7)), line(progress(7, note="a}b"))),
    "an escape in a progress line": restarted_run().replace(line(progress(8)), line(progress(8, note='a"b'))),
    "a control byte in a progress line": restarted_run().replace(line(progress(11)), line(progress(11)).replace('"lr": ', '"lr":\x1e ')),
    "a control byte in an eval line": restarted_run().replace('"acc": 0.5}', '"acc":\x0c0.5}', 1),
    # A line that begins or ends otherwise than a plain progress line (ODD_SEAM), read as the full parse reads it:
    # each of these three, no record (a warning).
    "a record with no kind among progress lines": restarted_run().replace(
        line(progress(34)), line(progress(34)) + '{"time": 1, "step": 34}\n'
    ),
    "a progress record with no time": restarted_run().replace(
        line(progress(31)), line({k: v for k, v in progress(31).items() if k != "time"})
    ),
    "bytes after a progress record": restarted_run().replace(line(progress(32)), line(progress(32)).replace("}\n", "}x\n")),
    # The fields found by a byte inside their key, the key checked behind it (FIELDS): other keys that end the same,
    # and the keys in another order, on every line.
    "keys that end as samples_per_s and mfu do": restarted_run().replace(
        '"lr": 0.0003, ', '"lr": 0.0003, "eval_samples_per_s": 1.0, "xmfu": 9.0, '
    ),
    "mfu before samples_per_s": mfu_first(restarted_run()),
    "not ascii in an eval line": restarted_run().replace('"acc": 0.5}', '"acc": 0.5, "note": "\u00e9"}', 1),
}
PLAIN = {"restarted", "truncated last line", "records before the first start", "another program's progress", "odd values",
         "no newline at all", "a lone start", "a record with no kind among progress lines", "a progress record with no time",
         "bytes after a progress record", "keys that end as samples_per_s and mfu do", "mfu before samples_per_s"}  # fmt: skip


def digest_fields(digest: Digest) -> str:
    """What read_digest keeps of a digest, as JSON (NaN equal to NaN; 200 and 200.0 told apart)."""
    return json.dumps((kept_records(digest.run.segments), digest.progress_count, digest.train_loss, digest.samples_per_s, digest.mfu,
                 digest.run.warnings, digest.run.preflight), sort_keys=True)  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_scan_digests_a_metrics_file_exactly_as_the_full_parse_does(tmp_path: Path, case: str) -> None:
    assert case == "restarted" or CASES[case] != restarted_run()  # each case's change was made
    path = tmp_path / "metrics.jsonl"
    path.write_text(CASES[case], encoding="utf-8")
    (tmp_path / "preflight.json").write_text('{"ok": true}')
    scanned = scan_digest(path, path.read_bytes())
    assert (scanned is not None) == (case in PLAIN), case  # the trainer's files take the fast path; the others the full parse
    full = Digest.of(read_run(path))
    assert scanned is None or digest_fields(scanned) == digest_fields(full)
    assert digest_fields(read_digest(tmp_path)) == digest_fields(full)  # the first read: scanned (or parsed), then kept
    assert (tmp_path / DIGEST).is_file() and digest_fields(read_digest(tmp_path)) == digest_fields(full)  # the kept digest


def test_the_restarted_runs_digest_keeps_the_step_the_resume_went_back_to_and_warns_of_the_torn_line(tmp_path: Path) -> None:
    """What the equality above rests on, said outright for the restarted file: the scan found the progress record at
    the resumed step (45) in the middle of the first segment, counted every record, and named the torn line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(restarted_run())
    scanned = scan_digest(path, path.read_bytes())
    assert scanned is not None
    first, second = scanned.run.segments
    assert [r["global_step"] for r in first.progress] == [1, 45, *range(101, 151)] and len(second.progress) == 51
    assert scanned.progress_count == 150 + 255 and scanned.train_loss == 1 / 298
    assert scanned.run.warnings == [f"skipped line 124 of {path}: not a metrics record (torn: a start was killed while writing it)"]


def test_a_digest_is_kept_on_one_line_without_waiting_for_the_disk_and_one_a_crash_left_empty_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is a cache: written whole (a rename) but not fsynced (an fsync a point was a second of a first
    compare of 100 points on a shared disk), on one line (json's C encoder: an indent is 10 ms of Python a point);
    one that a crash left empty is read as none and made again."""
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    (tmp_path / "metrics.jsonl").write_text(restarted_run())
    first = read_digest(tmp_path)
    assert (tmp_path / DIGEST).read_text().count("\n") == 1 and synced == []
    (tmp_path / DIGEST).write_text("")
    assert digest_fields(read_digest(tmp_path)) == digest_fields(first) and json.loads((tmp_path / DIGEST).read_text())["key"]


@pytest.mark.parametrize("cores", [2, 1])
def test_a_sweeps_stale_digests_are_made_a_process_a_core_equal_to_the_full_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int
) -> None:
    """digest_stale (compare's and export --summary's first read) makes each missing digest in a pool of processes,
    each equal to the full parse; a digest already kept and a run with no metrics are left alone; one core, none."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    stale, kept, empty = [tmp_path / "stale-1", tmp_path / "stale-2"], tmp_path / "kept", tmp_path / "empty"
    for run_dir in [*stale, kept, empty]:
        run_dir.mkdir()
    for run_dir in [*stale, kept]:
        (run_dir / "metrics.jsonl").write_text(restarted_run())
    read_digest(kept)
    made = digest_stale([*stale, kept, empty])
    assert made == (stale if cores > 1 else []) and (kept / DIGEST).is_file() and not (empty / DIGEST).exists()
    for run_dir in stale:
        assert (run_dir / DIGEST).is_file() == (cores > 1)  # made by the pool, before any read_digest of the run
        assert digest_fields(read_digest(run_dir)) == digest_fields(Digest.of(read_run(run_dir)))
