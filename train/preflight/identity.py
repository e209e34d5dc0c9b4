"""What each rank runs: host, place, device, bundle, Python, torch, CUDA, NCCL, the NVIDIA driver, the
network NCCL chose and the EFA devices beside it, inside the image or not.

A job whose ranks disagree on any of these is not the job the user meant: one node with a stale image,
one node where pyxis was not loaded and the task ran on the host's Python, one node with another torch.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from train.distributed import DistContext
from train.gpu import driver_version, efa_devices, nccl_network

LIB = Path(__file__).resolve().parents[2]  # /opt/ddpack/lib in the image, the checkout elsewhere
# Written by the image build (Dockerfile, Dockerfile.gpu): the version and revision it was built from.
# Its presence is what "inside the bundle's image" means: a host checkout or venv has none.
BUILD_FILE = LIB / "ddpack-build.json"
CODE_PACKAGES = ("entrypoint", "train", "ddpack_run")

# Fields every rank must share; the rest (host, rank, visible devices) describe where a rank is.
AGREED = ("bundle", "code", "app", "in_image", "python", "torch", "cuda", "nccl", "device", "driver", "transport", "efa")


@dataclass(frozen=True)
class Identity:
    rank: int
    host: str
    local_rank: int
    local_world_size: int
    visible_devices: int
    device: str
    bundle: str
    code: str
    app: str  # name@digest of the user's project built into the image (make image APP=DIR), "-" for none
    in_image: bool
    python: str
    torch: str
    cuda: str
    nccl: str
    driver: str  # the NVIDIA driver on a GPU rank's node, "-" on CPU ranks
    transport: str  # the network NCCL said it uses (Socket, IB, AWS Libfabric), "?" when its log was not read, "-" for gloo
    efa: int  # EFA devices on the node


def code_digest(lib: Path = LIB) -> str:
    """A digest of the bundle's Python sources as this rank imports them: two ranks with the same
    version label but different code (a rebuilt image, an edited checkout) still differ here."""
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((lib / package).rglob("*.py")):
            digest.update(path.relative_to(lib).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def bundle_label(build_file: Path = BUILD_FILE) -> tuple[str, bool]:
    """(version@revision, inside the image): from the build file, else the installed package."""
    try:
        build = json.loads(build_file.read_text())
        revision = str(build.get("revision", "?"))
        short = revision[:12] + ("-dirty" if revision.endswith("-dirty") else "")
        return f"{build.get('version', '?')}@{short}", True
    except (OSError, ValueError):
        pass
    try:
        return f"{metadata.version('ddpack')}@checkout", False
    except metadata.PackageNotFoundError:
        return "unknown@checkout", False


def app_label(build_file: Path = BUILD_FILE) -> str:
    """name@digest of the project the image was built with (its `app` record), "-" when there is none:
    a node with an older build of the project differs here even when the bundle is the same."""
    try:
        app = json.loads(build_file.read_text()).get("app") or {}
    except (OSError, ValueError):
        return "-"
    return f"{app.get('name', '?')}@{app.get('digest', '?')}" if app else "-"


def collect_identity(ctx: DistContext, nccl_log: Path | None = None) -> Identity:
    """This rank's identity, read from the process itself (no collective); `nccl_log`: where this process's
    NCCL wrote its INIT/NET lines (train.gpu.capture_nccl_log), read once NCCL has set up a communicator."""
    cuda = torch.version.cuda or "-"
    nccl = "-"
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()  # a tuple (2, 21, 5); an int 22105 in older torch
        nccl = ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
    if ctx.device.type == "cuda":
        device, visible = torch.cuda.get_device_name(ctx.device), torch.cuda.device_count()
    else:
        device, visible = "cpu", 0
    bundle, in_image = bundle_label()
    return Identity(
        rank=ctx.rank,
        host=ctx.host,
        local_rank=ctx.local_rank,
        local_world_size=ctx.local_world_size,
        visible_devices=visible,
        device=device,
        bundle=bundle,
        code=code_digest(),
        app=app_label(),
        in_image=in_image,
        python=platform.python_version(),
        torch=str(torch.__version__),  # a plain str: TorchVersion is not a type a weights_only load takes
        cuda=cuda,
        nccl=nccl,
        driver=(driver_version() or "?") if ctx.device.type == "cuda" else "-",
        transport=nccl_network(nccl_log) if ctx.backend == "nccl" else "-",
        efa=len(efa_devices()),
    )


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(spans)


def where(ranks: Sequence[int], hosts: dict[int, str]) -> str:
    """'rank 3 (node2)' or 'ranks 2-3 (node2)', hosts in first-seen order."""
    names = list(dict.fromkeys(hosts[r] for r in sorted(ranks)))
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} ({', '.join(names)})"


def disagreements(records: Sequence[Identity]) -> list[str]:
    """One line per field on which the ranks disagree, naming the odd ranks and their hosts.

    The odd ones are those outside the largest group (on a tie, the group rank 0 is in): with one
    stale node out of sixteen, the line names that node, not the fifteen healthy ones."""
    hosts = {r.rank: r.host for r in records}
    lines = []
    for name in AGREED:
        groups: dict[object, list[int]] = {}
        for record in records:
            groups.setdefault(getattr(record, name), []).append(record.rank)
        if len(groups) < 2:
            continue
        majority = min(groups, key=lambda value: (-len(groups[value]), min(groups[value])))
        odd = [f"{where(ranks, hosts)} {name}={value}" for value, ranks in groups.items() if value != majority]
        lines.append(f"identity: {name} differs: {'; '.join(odd)} (the other {len(groups[majority])} ranks: {name}={majority})")
    return lines
