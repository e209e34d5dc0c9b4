"""Image figures: CPU image size against its floor, cold build time, rebuild time after a one-line
trainer change, the same two for a user's project on it (the README's cpu-ddp: `make image APP=DIR`), and
the GPU image size.

The floor is what any image with this runtime must hold: the base image (OS + Python runtime) plus
torch's installed files. Cold = no build cache (the dependency layer reinstalls torch); the rebuild
copies the checkout, changes one line of train/trainer.py and builds again with the cache.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpack.images.app import read_app  # noqa: E402
from ddpack.images.engine import docker_client  # noqa: E402
from ddpack.images.images import CONTEXT_ITEMS, build_app_image, build_image, plan_build  # noqa: E402

MIB = 2**20


def timed_build(variant: str, tag: str, source: Path = ROOT, no_cache: bool = False) -> float:
    started = time.monotonic()
    build_image(plan_build(variant=variant, tag=tag, version="bench", extra_args=("--no-cache",) if no_cache else (), source=source))
    return time.monotonic() - started


def timed_app_build(project: Path, tag: str, bundle: str, no_cache: bool = False) -> float:
    """The project's two layers on the already-built bundle (cold: --no-cache, requirements from the index)."""
    started = time.monotonic()
    build = plan_build(
        variant="cpu", tag=tag, version="bench", app=read_app(project, "python ddp.py 4 2"), bundle_tag=bundle,
        extra_args=("--no-cache",) if no_cache else (),
    )  # fmt: skip
    build_app_image(build)
    return time.monotonic() - started


def project_figures(bundle: str) -> tuple[float, float]:
    """(cold, after a one-line code change) seconds for the README's project on `bundle`."""
    from testbed.readme_examples import write_cpu_ddp

    with tempfile.TemporaryDirectory() as tmp:
        project = write_cpu_ddp(Path(tmp) / "cpu-ddp")
        cold = timed_app_build(project, "cpu-ddp:bench", bundle, no_cache=True)
        (project / "ddp.py").write_text((project / "ddp.py").read_text() + "# a one-line change\n")
        warm = timed_app_build(project, "cpu-ddp:bench", bundle)
    docker_client().images.remove("cpu-ddp:bench", force=True)
    return cold, warm


def floor_bytes(tag: str) -> tuple[int, int]:
    """(base image bytes, torch's installed bytes) for the image `tag`."""
    client = docker_client()
    image = client.images.get(tag)
    base = client.images.get(image.attrs["Config"]["Labels"]["org.opencontainers.image.base.name"]).attrs["Size"]
    script = "du -sb $(/opt/ddpack/venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))') | cut -f1"
    torch_bytes = int(client.containers.run(tag, ["sh", "-c", script], entrypoint=[], remove=True).decode().strip())
    return base, torch_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default="ddpack:bench")
    parser.add_argument("--gpu", action="store_true", help="also build the GPU image (downloads several GB)")
    opts = parser.parse_args()
    client = docker_client()

    cold = timed_build("cpu", opts.tag, no_cache=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for item in CONTEXT_ITEMS:
            src = ROOT / item
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / item)
        trainer = copy / "train" / "trainer.py"
        trainer.write_text(trainer.read_text() + "\n# a one-line change\n")
        warm = timed_build("cpu", opts.tag + "-edit", source=copy)
    app_cold, app_warm = project_figures(opts.tag)
    size = client.images.get(opts.tag).attrs["Size"]
    base, torch_bytes = floor_bytes(opts.tag)
    floor = base + torch_bytes
    print(f"images   CPU image size                     {size / MIB:8,.0f} MiB")
    print(f"images   floor (base {base / MIB:,.0f} + torch {torch_bytes / MIB:,.0f})        {floor / MIB:8,.0f} MiB")
    print(f"images   above the floor                    {(size - floor) / MIB:8,.0f} MiB ({(size / floor - 1) * 100:.0f}%)")
    print(f"images   cold build (no cache)              {cold:8.1f} s")
    print(f"images   rebuild after a one-line change    {warm:8.1f} s")
    print(f"images   project cold build (2 layers)      {app_cold:8.1f} s   README's cpu-ddp on the image, requirements from the index")
    print(f"images   project rebuild after a code edit  {app_warm:8.1f} s   only its code layer")
    gpu_tag = opts.tag + "-gpu"
    if opts.gpu:
        print(f"images   GPU cold build (no cache)          {timed_build('gpu', gpu_tag, no_cache=True):8.1f} s")
    try:
        print(f"images   GPU image size                     {client.images.get(gpu_tag).attrs['Size'] / MIB:8,.0f} MiB")
    except Exception:
        print("images   GPU image size                     not built (bench/bench_images.py --gpu)")
    client.images.remove(opts.tag + "-edit", force=True)


if __name__ == "__main__":
    main()
