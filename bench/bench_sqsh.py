"""Squashfs conversion: time and size for each available converter and compression setting.

Converts the CPU image (built by `make image`, tag from --image) with mksquashfs under enroot's
default options and with zstd/gzip data compression, and with tar2sqfs (streaming, no extraction).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpack.sqsh import DEFAULT_SQUASH_OPTIONS, convert  # noqa: E402

SETTINGS = [
    ("mksquashfs", DEFAULT_SQUASH_OPTIONS + "  (enroot default)"),
    ("mksquashfs", "-comp zstd -Xcompression-level 3"),
    ("mksquashfs", "-comp gzip"),
    ("tar2sqfs", "-comp zstd"),
    ("tar2sqfs", "-comp lzo"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-sqsh-") as tmp:
        for converter, options in SETTINGS:
            if shutil.which(converter) is None:
                rows.append((converter, options, None, None))
                continue
            os.environ["ENROOT_SQUASH_OPTIONS"] = options.split("  (")[0]
            out = Path(tmp) / "x.sqsh"
            started = time.monotonic()
            convert(opts.image, out, converter)
            rows.append((converter, options, time.monotonic() - started, out.stat().st_size))
            out.unlink()
    print(f"\nsqsh     {'converter':<11} {'ENROOT_SQUASH_OPTIONS':<45} {'time':>8} {'size':>10}")
    for converter, options, seconds, size in rows:
        if seconds is None:
            print(f"sqsh     {converter:<11} {options:<45} {'not installed':>19}")
        else:
            print(f"sqsh     {converter:<11} {options:<45} {seconds:7.1f}s {size / 2**20:8,.0f} MiB")


if __name__ == "__main__":
    main()
