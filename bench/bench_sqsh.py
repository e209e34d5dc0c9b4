"""Squashfs conversion: `make sqsh` next to real `enroot import dockerd://`, the floors, and compression.

1. Side by side, same image, same ENROOT_SQUASH_OPTIONS (HyperPod's by default), rounds alternating the
   order (A B, B A, ...): `enroot import` (when installed) and each native converter; medians and ratios.
2. The floors: reading the whole `docker export` stream (what any export-based converter must at least
   do) and writing then fsyncing a file of the output's size (what any converter must at least do).
3. Compression: for none (HyperPod's), enroot's default, lz4 and zstd, the file size, the conversion time
   and the unpack time (`unsquashfs` into a fresh folder, as `enroot create` does under pyxis, page cache
   dropped first), which is what ddpack's default was chosen from.
4. With --against IMAGE: what one image costs over another (the default build against WITH_COMPILER=0,
   say): image size, squashfs size with ddpack's default options and the unpack time, rounds alternating.
   On this VM's root filesystem (ext4 without a journal) an unpack soon after a delete runs slower
   (bench_start.py --journaled-data says why); both images pay it alike in alternating rounds.
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

from ddpack.images.engine import docker_client  # noqa: E402
from ddpack.images.enroot_tree import ENROOT_DEFAULT_SQUASH_OPTIONS, HYPERPOD_SQUASH_OPTIONS  # noqa: E402
from ddpack.images.sqsh import DEFAULT_SQUASH_OPTIONS, convert, export_stream  # noqa: E402

COMPRESSIONS = [HYPERPOD_SQUASH_OPTIONS, ENROOT_DEFAULT_SQUASH_OPTIONS, "-comp lz4", "-comp zstd -Xcompression-level 3"]


def timed(body) -> float:
    started = time.monotonic()
    body()
    return time.monotonic() - started


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):  # not root: the unpack times then include a warm cache
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def unpack_seconds(sqsh: Path, target: Path) -> float:
    """unsquashfs into a fresh folder with the page cache dropped, as `enroot create` unpacks under pyxis."""
    shutil.rmtree(target, ignore_errors=True)
    drop_caches()
    return timed(lambda: subprocess.run(["unsquashfs", "-q", "-d", str(target), str(sqsh)], check=True, capture_output=True))


def compare_images(image: str, against: str, rounds: int, tmp: Path) -> None:
    os.environ["ENROOT_SQUASH_OPTIONS"] = DEFAULT_SQUASH_OPTIONS
    files = {name: tmp / f"{i}.sqsh" for i, name in enumerate((image, against))}
    for name, path in files.items():
        convert(name, path, "layers", force=True)
    unpacks: dict[str, list[float]] = {name: [] for name in files}
    for round_ in range(rounds):
        for name in list(files) if round_ % 2 == 0 else list(files)[::-1]:
            unpacks[name].append(unpack_seconds(files[name], tmp / "unpacked"))
    client = docker_client()
    print(f"\nsqsh     {image} against {against}: ENROOT_SQUASH_OPTIONS={DEFAULT_SQUASH_OPTIONS!r}, {rounds} rounds alternating, medians")
    figures = {}
    for name, path in files.items():
        figures[name] = (client.images.get(name).attrs["Size"], path.stat().st_size, statistics.median(unpacks[name]))
        size, sqsh, unpack = figures[name]
        print(f"sqsh     {name:<32} image {size / 2**20:7,.0f} MiB   squashfs {sqsh / 2**20:7,.0f} MiB   unpack {unpack:6.2f}s")
    (a_size, a_sqsh, a_unpack), (b_size, b_sqsh, b_unpack) = figures[image], figures[against]
    print(
        f"sqsh     difference: image +{(a_size - b_size) / 2**20:,.0f} MiB, squashfs +{(a_sqsh - b_sqsh) / 2**20:,.0f} MiB, "
        f"unpack +{a_unpack - b_unpack:.2f}s ({a_unpack / b_unpack:.2f}x)"
    )


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
    parser.add_argument("--against", help="another image to set --image against (size, squashfs, unpack), e.g. a WITH_COMPILER=0 build")
    parser.add_argument("--only-against", action="store_true", help="run only the --against part")
    opts = parser.parse_args()
    if opts.only_against:
        if not opts.against:
            parser.error("--only-against needs --against IMAGE")
        with tempfile.TemporaryDirectory(prefix="ddpack-bench-sqsh-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
            compare_images(opts.image, opts.against, opts.rounds, Path(tmp))
        return
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
            unpacks = [unpack_seconds(out, Path(tmp) / "unpacked") for _ in range(opts.rounds)]
            table.append((options, out.stat().st_size, seconds, statistics.median(unpacks)))
        if opts.against:
            compare_images(opts.image, opts.against, opts.rounds, Path(tmp))
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
