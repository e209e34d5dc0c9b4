"""`make sqsh`: an Enroot squashfs of an image, for `srun --container-image=/fsx/.../x.sqsh` (pyxis).

With `enroot` on the PATH, `enroot import -o … dockerd://IMAGE` does it. Without it (most build
hosts and CI) the conversion is native and gives what enroot's `dockerd://` import gives: the filesystem
of a created container (`docker export`, without `dev/*` and `/.dockerenv`), enroot's metadata
(`/etc/environment` from ENV, `/etc/rc` from ENTRYPOINT/CMD/WORKDIR with labels as comments,
`/etc/fstab` from VOLUMEs, `/etc/rc.local`), everything owned by root and readable by all, squashed
with ENROOT_SQUASH_OPTIONS (enroot's default `-comp lzo -noD`).

Two native converters: `mksquashfs` (extract to a temporary folder, then squash; honours every
ENROOT_SQUASH_OPTIONS) and `tar2sqfs` (streams the export straight into squashfs-tools-ng, no
extraction; takes only `-comp X` from ENROOT_SQUASH_OPTIONS). `bench/bench_sqsh.py` compares them.
The result is written to a temporary file, listed and checked (entrypoint, python, metadata), and
only then renamed over the output, so the output path never holds a partial file.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from docker.errors import ImageNotFound

from ddpack.engine import docker_client
from ddpack.errors import HostError, run_verb

DEFAULT_SQUASH_OPTIONS = "-comp lzo -noD"
REQUIRED_PATHS = ("usr/local/bin/entrypoint", "etc/environment", "etc/rc", "etc/rc.local", "etc/fstab")
SHELL_CANDIDATES = ("bin/sh", "usr/bin/sh")  # /bin is a symlink to usr/bin on merged-/usr bases
PYTHON_CANDIDATES = ("opt/ddpack/venv/bin/python", "usr/local/bin/python3", "usr/bin/python3")
RC_LOCAL = "# This file is sourced by /etc/rc when the container starts.\n# It can be used to manipulate the entrypoint or the command of the container.\n"


def _quote_all(words: Iterable[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def enroot_metadata(config: dict) -> dict[str, str]:
    """The files enroot's docker::configure writes, from an image's `docker inspect` Config."""
    env = config.get("Env") or []
    volumes = sorted((config.get("Volumes") or {}).keys())
    labels = config.get("Labels") or {}
    workdir = config.get("WorkingDir") or "/"
    entrypoint = config.get("Entrypoint") or []
    cmd = config.get("Cmd") or []
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    rc = "".join(f"# {key} {value}\n" for key, value in labels.items())
    if rc:
        rc += "\n"
    ep = _quote_all(entrypoint)
    rc += (
        f'mkdir -p "{workdir}" 2> /dev/null\n'
        f'cd "{workdir}" && unset OLDPWD || exit 1\n\n'
        "if [ -s /etc/rc.local ]; then\n    . /etc/rc.local\nfi\n\n"
        "if [ $# -gt 0 ]; then\n"
        f'    exec {ep} "$@"\n'.replace("exec  ", "exec ")
        + "else\n"
        + f"    exec {_quote_all([*entrypoint, *cmd])}\n"
        + "fi\n"
    )
    return {
        "etc/environment": "".join(f"{line}\n" for line in env),
        "etc/fstab": "".join(f"${{ENROOT_ROOTFS}}{v} {v} none x-create=dir,bind,rw,nosuid,nodev\n" for v in volumes),
        "etc/rc": rc,
        "etc/rc.local": RC_LOCAL,
        "_workdir": workdir,
    }


def _relative(name: str) -> str:
    """A tar member name without a leading './' or '/' (not lstrip: '.dockerenv' must keep its dot)."""
    while name.startswith(("./", "/")):
        name = name[2:] if name.startswith("./") else name[1:]
    return name


def _skip(name: str) -> bool:
    """What enroot leaves out of an export: device nodes' folder contents and Docker's marker."""
    name = _relative(name)
    return name.startswith("dev/") or name == ".dockerenv"


def _readable(mode: int, is_dir: bool) -> int:
    """Readable by all; directories and executables also searchable/runnable by all."""
    mode |= 0o444
    if is_dir or mode & 0o100:
        mode |= 0o111
    return mode


def export_stream(client, image: str) -> Iterator[bytes]:
    """`docker export` of a created (never started) container of `image`, removed afterwards."""
    container = client.containers.create(image, entrypoint=["/bin/true"])
    try:
        yield from container.export(chunk_size=1 << 20)
    finally:
        container.remove(force=True)


class _ChunkReader(io.RawIOBase):
    """A file object over an iterator of byte chunks, for tarfile's streaming mode."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._buffer = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(target), len(self._buffer))
        target[:size], self._buffer = self._buffer[:size], self._buffer[size:]
        return size


def rootfs_tar(chunks: Iterator[bytes], metadata: dict[str, str], out) -> None:
    """Rewrite an export as enroot would see it: filtered, root-owned, readable, plus metadata files."""
    generated = {name: text for name, text in metadata.items() if not name.startswith("_")}
    workdir = metadata["_workdir"].strip("/")
    seen: set[str] = set()
    with (
        tarfile.open(fileobj=io.BufferedReader(_ChunkReader(chunks), 1 << 20), mode="r|") as src,
        tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst,
    ):
        for member in src:
            name = _relative(member.name)
            if _skip(member.name) or name in generated:
                continue
            seen.add(name.rstrip("/"))
            member.uid = member.gid = 0
            member.uname = member.gname = "root"
            member.mode = _readable(member.mode, member.isdir())
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
        for path in ("etc", workdir):
            if path and path not in seen:
                info = tarfile.TarInfo(path)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                dst.addfile(info)
        for name, text in generated.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))


def _squash_options() -> list[str]:
    return shlex.split(os.environ.get("ENROOT_SQUASH_OPTIONS", DEFAULT_SQUASH_OPTIONS))


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise HostError(f"{name} is not installed; install {package} (Debian: apt-get install -y {package})", code=2)
    return path


def _feed(argv: list[str], chunks: Iterator[bytes], metadata: dict[str, str]) -> int:
    """Run `argv` with the rewritten root filesystem tar on its standard input; its exit code."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    try:
        rootfs_tar(chunks, metadata, proc.stdin)
    finally:
        proc.stdin.close()
        code = proc.wait()
    return code


def convert_mksquashfs(chunks: Iterator[bytes], metadata: dict[str, str], tmp_out: Path, workspace: Path) -> None:
    mksquashfs = _tool("mksquashfs", "squashfs-tools")
    root = workspace / "rootfs"
    root.mkdir()
    code = _feed(["tar", "-C", str(root), "--numeric-owner", "-px"], chunks, metadata)
    if code != 0:
        raise HostError(f"extracting the image failed (tar exit {code}); is there space in {workspace}?")
    argv = [mksquashfs, str(root), str(tmp_out), "-noappend", "-all-root", *_squash_options()]
    result = subprocess.run(argv)
    if result.returncode != 0:
        raise HostError(f"mksquashfs failed (exit {result.returncode}); its output above says why")


def convert_tar2sqfs(chunks: Iterator[bytes], metadata: dict[str, str], tmp_out: Path, workspace: Path) -> None:
    tar2sqfs = _tool("tar2sqfs", "squashfs-tools-ng")
    options = _squash_options()
    argv = [tar2sqfs, "--force", "--quiet", "--no-keep-time"]
    if "-comp" in options and options.index("-comp") + 1 < len(options):
        argv += ["--compressor", options[options.index("-comp") + 1]]
    code = _feed([*argv, str(tmp_out)], chunks, metadata)
    if code != 0:
        raise HostError(f"tar2sqfs failed (exit {code}); its output above says why")


CONVERTERS = {"mksquashfs": convert_mksquashfs, "tar2sqfs": convert_tar2sqfs}


def validate_squashfs(path: Path) -> list[str]:
    """The file lists as squashfs and holds the entrypoint, a python and enroot's metadata."""
    unsquashfs = _tool("unsquashfs", "squashfs-tools")
    listing = subprocess.run([unsquashfs, "-lc", str(path)], capture_output=True, text=True)
    if listing.returncode != 0:
        raise HostError(f"the new squashfs does not list: {listing.stderr.strip().splitlines()[-1:]}")
    names = {line.split("squashfs-root/", 1)[1] for line in listing.stdout.splitlines() if "squashfs-root/" in line}
    missing = [p for p in REQUIRED_PATHS if p not in names]
    if not any(p in names for p in PYTHON_CANDIDATES):
        missing.append("a python (" + ", ".join(PYTHON_CANDIDATES) + ")")
    if not any(p in names for p in SHELL_CANDIDATES):
        missing.append("/bin/sh")
    if missing:
        raise HostError(f"the squashfs lacks {', '.join(missing)}; is this a ddpack image?")
    return sorted(names)


def convert(image: str, output: Path, converter: str = "auto") -> Path:
    """Write `output` atomically; returns it. Prints progress and a final line with size and time."""
    started = time.monotonic()
    output = output.resolve()
    if not output.parent.is_dir():
        raise HostError(f"output folder {output.parent} does not exist; create it or choose another SQSH path", code=2)
    use_enroot = converter == "enroot" or (converter == "auto" and shutil.which("enroot"))
    if converter == "auto":
        converter = "enroot" if use_enroot else "mksquashfs"
    if converter not in (*CONVERTERS, "enroot"):
        raise HostError(f"converter {converter!r} is not one of enroot, {', '.join(CONVERTERS)}", code=2)
    client = docker_client()
    try:
        config = client.images.get(image).attrs["Config"]
    except ImageNotFound:
        raise HostError(f"image {image} not found; build it first (make image)", code=2) from None
    tmp_out = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    tmp_out.unlink(missing_ok=True)
    print(f"sqsh: {image} -> {output} ({converter}, ENROOT_SQUASH_OPTIONS={' '.join(_squash_options())!r})", flush=True)
    try:
        if converter == "enroot":
            result = subprocess.run([shutil.which("enroot") or "enroot", "import", "-o", str(tmp_out), f"dockerd://{image}"])
            if result.returncode != 0:
                raise HostError(f"enroot import failed (exit {result.returncode}); its output above says why")
        else:
            with tempfile.TemporaryDirectory(prefix="ddpack-sqsh-") as workspace:
                CONVERTERS[converter](export_stream(client, image), enroot_metadata(config), tmp_out, Path(workspace))
        names = validate_squashfs(tmp_out)
        os.replace(tmp_out, output)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise HostError(
                f"no space left writing {output} (or the temporary extraction); free space or set SQSH/TMPDIR elsewhere"
            ) from None
        raise HostError(f"writing {output} failed: {exc.strerror or exc}") from None
    finally:
        tmp_out.unlink(missing_ok=True)
    size = output.stat().st_size
    print(f"sqsh: wrote {output} ({size / 2**20:,.0f} MiB, {len(names):,} entries) in {time.monotonic() - started:.1f}s")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.sqsh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", required=True, help="local image, e.g. ddpack:1a2b3c4")
    parser.add_argument("--output", required=True, type=Path, help="the .sqsh file to write (replaced atomically)")
    parser.add_argument("--converter", default="auto", help="auto (enroot if installed, else mksquashfs), enroot, mksquashfs, tar2sqfs")
    opts = parser.parse_args(argv)
    return run_verb("sqsh", lambda: convert(opts.image, opts.output, opts.converter) and 0)


if __name__ == "__main__":
    raise SystemExit(main())
