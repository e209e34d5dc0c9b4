"""Squashfs conversion: `make sqsh` next to real `enroot import dockerd://`, the floors, and compression.

1. Side by side, same image, same ENROOT_SQUASH_OPTIONS (HyperPod's by default), rounds alternating the
   order (A B, B A, ...): `enroot import` (when installed) and each native converter; medians and ratios.
2. The floors: reading the whole `docker export` stream (what any export-based converter must at least
   do) and writing then fsyncing a file of the output's size (what any converter must at least do).
3. Compression: for none (HyperPod's), enroot's default, lz4 and zstd, the file size, the conversion time
   and the unpack time (`unsquashfs` into a fresh folder, as `enroot create` does under pyxis, page cache
   dropped first), which is what ddpack's default was chosen from.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpack.engine import docker_client  # noqa: E402
from ddpack.enroot_tree import ENROOT_DEFAULT_SQUASH_OPTIONS, HYPERPOD_SQUASH_OPTIONS  # noqa: E402
from ddpack.sqsh import DEFAULT_SQUASH_OPTIONS, convert, export_stream  # noqa: E402

COMPRESSIONS = [HYPERPOD_SQUASH_OPTIONS, ENROOT_DEFAULT_SQUASH_OPTIONS, "-comp lz4", "-comp zstd -Xcompression-level 3"]


def timed(body) -> float:
    started = time.monotonic()
    body()
    return time.monotonic() - started


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):  # not root: the unpack times then include a warm cache
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def converters(image: str, out: Path) -> dict[str, object]:
    def enroot() -> None:
        out.unlink(missing_ok=True)
        subprocess.run(["enroot", "import", "-o", str(out), f"dockerd://{image}"], check=True, capture_output=True)

    runs = {"enroot import": enroot} if shutil.which("enroot") else {}
    for name in ("layers", "mksquashfs"):
        runs[f"make sqsh ({name})"] = lambda name=name: convert(image, out, name, force=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--options", default=HYPERPOD_SQUASH_OPTIONS, help="ENROOT_SQUASH_OPTIONS of the side-by-side part")
    opts = parser.parse_args()
    os.environ["ENROOT_SQUASH_OPTIONS"] = opts.options
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-sqsh-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        out = Path(tmp) / "x.sqsh"
        runs = converters(opts.image, out)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(opts.rounds):
            for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
                times[name].append(timed(runs[name]))
        size = out.stat().st_size
        client = docker_client()
        export = statistics.median(timed(lambda: sum(len(c) for c in export_stream(client, opts.image))) for _ in range(opts.rounds))

        def write_floor() -> None:
            block = os.urandom(1 << 20)
            with open(Path(tmp) / "floor", "wb") as f:
                for _ in range(size >> 20):
                    f.write(block)
                os.fsync(f.fileno())

        write = statistics.median(timed(write_floor) for _ in range(opts.rounds))
        table = []
        for options in COMPRESSIONS:
            os.environ["ENROOT_SQUASH_OPTIONS"] = options
            seconds = timed(lambda: convert(opts.image, out, "layers", force=True))
            unpacks, target = [], Path(tmp) / "unpacked"
            for _ in range(opts.rounds):
                shutil.rmtree(target, ignore_errors=True)
                drop_caches()
                unpack = ["unsquashfs", "-q", "-d", str(target), str(out)]
                unpacks.append(timed(lambda argv=unpack: subprocess.run(argv, check=True, capture_output=True)))
            table.append((options, out.stat().st_size, seconds, statistics.median(unpacks)))
    print(
        f"\nsqsh     {opts.image}, ENROOT_SQUASH_OPTIONS={opts.options!r}, {opts.rounds} rounds alternating, medians; output {size / 2**20:,.0f} MiB"
    )
    base = statistics.median(times["enroot import"]) if "enroot import" in times else None
    for name, values in times.items():
        ratio = (
            f"  {base / statistics.median(values):5.2f}x the speed of enroot import (target >= 2x)"
            if base and name != "enroot import"
            else ""
        )
        print(f"sqsh     {name:<24} {statistics.median(values):7.2f}s  (runs: {', '.join(f'{v:.2f}' for v in values)}){ratio}")
    if base is None:
        print("sqsh     enroot import: not installed (../shared/tools/install-enroot-pyxis.sh), no side-by-side ratio")
    print(f"sqsh     floor: read the docker export stream {export:.2f}s; write+fsync {size / 2**20:,.0f} MiB {write:.2f}s")
    print(f"\nsqsh     {'ENROOT_SQUASH_OPTIONS':<48} {'size':>9} {'convert':>9} {'unpack':>8}")
    for options, nbytes, seconds, unpack in table:
        mark = "  <- ddpack's default" if options == DEFAULT_SQUASH_OPTIONS else ""
        print(f"sqsh     {options:<48} {nbytes / 2**20:5,.0f} MiB {seconds:8.2f}s {unpack:7.2f}s{mark}")


if __name__ == "__main__":
    main()
