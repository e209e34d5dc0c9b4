"""`make sqsh`: an Enroot squashfs of an image, for `srun --container-image=/fsx/.../x.sqsh` (pyxis).

The tree is the one `enroot import dockerd://IMAGE` gives (rules in `ddpack.images.enroot_tree`). Converters:

- `layers` (auto's first choice): mounts the created container's own overlay2 layers read-only and runs
  one `mksquashfs` over them, with enroot's exclusions, permission fixes and metadata files given as
  mksquashfs exclude and pseudo-file lists. No export stream, no extraction: the cost is reading the
  image's files once and writing the squashfs. Needs root and the engine's layers on this host.
- `enroot`: `enroot import` itself (auto's choice where `layers` cannot run and enroot is installed).
- `mksquashfs`: `docker export`, rewritten as enroot would see it, extracted to a temporary folder and
  squashed; needs no root. `tar2sqfs` streams the same rewritten export into squashfs-tools-ng (it takes
  only `-comp X` of the options).

Every converter squashes with the ENROOT_SQUASH_OPTIONS enroot would use here (environment, enroot.conf,
else ddpack's default) and says which. The result goes to a temporary file, is listed and checked
(entrypoint, python, metadata), and only then renamed over the output; a record next to it
(`X.sqsh.ddpack.json`: image id, options, the file's size and mtime) makes the next `make sqsh` of the
same image a no-op.

The output folder may be shared (`/fsx/images`) and `layers` runs as root, so nothing is written through a
name another user could have planted there: the squashfs is made inside a private folder that mkdtemp
creates beside the output (0700, a random name; the same filesystem, so the rename is atomic), the record
through mkstemp, and the output path's own last component is never resolved (a link planted at it is
replaced, not followed). A record or output that is not a regular file of this user is not trusted.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from docker.errors import ImageNotFound

from ddpack.errors import HostError, run_verb
from ddpack.images.engine import docker_client
from ddpack.images.enroot_tree import (
    HYPERPOD_SQUASH_OPTIONS,
    METADATA_FILES,
    excluded,
    fixed_mode,
    folders_enroot_creates,
    metadata_files,
    squash_options,
)
from ddpack.private_files import not_yours_alone, write_atomically

# Chosen from measurements (`make bench-sqsh`, `make bench-start`): uncompressed (HyperPod's enroot.conf
# setting) converts fastest, unpacks as fast as lz4 and starts a 2-node step fastest here; lz4 and zstd
# trade that for 43 % / 31 % of the bytes, worth it where /fsx bandwidth, not CPU, is the limit.
DEFAULT_SQUASH_OPTIONS = HYPERPOD_SQUASH_OPTIONS
REQUIRED_PATHS = ("usr/local/bin/entrypoint", *METADATA_FILES)
SHELL_CANDIDATES = ("bin/sh", "usr/bin/sh")  # /bin is a symlink to usr/bin on merged-/usr bases
PYTHON_CANDIDATES = ("opt/ddpack/venv/bin/python", "usr/local/bin/python3", "usr/bin/python3")
CONVERTERS = ("layers", "enroot", "mksquashfs", "tar2sqfs")
RECORD_SUFFIX = ".ddpack.json"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise HostError(f"{name} is not installed; install {package} (Debian: apt-get install -y {package})", code=2)
    return path


# --- layers: mksquashfs over the container's overlay2 layers, mounted read-only -------------------


def layers_unavailable(image_attrs: dict) -> str | None:
    """Why the `layers` converter cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return f"mounting the image's layers needs root (running as uid {os.geteuid()})"
    driver = image_attrs.get("GraphDriver") or {}
    if driver.get("Name") != "overlay2":
        return f"the engine stores images with {driver.get('Name') or 'an unknown driver'!r}, not overlay2"
    data = driver.get("Data") or {}
    dirs = [data.get("UpperDir") or "", *filter(None, (data.get("LowerDir") or "").split(":"))]
    if not all(d and Path(d).is_dir() for d in dirs):
        return "the engine's layers are not on this host (a remote engine?)"
    return None


def _lowerdir_option(dirs: list[str]) -> tuple[str, str | None]:
    """`lowerdir=…` with overlay2's short `l/` links (as dockerd mounts them) when every layer has one,
    so a deep image stays under the kernel's one-page limit on mount options; and the folder to run in."""
    parents = [Path(d).parent for d in dirs]
    links = [p / "link" for p in parents]
    base = parents[0].parent
    if all(p.parent == base for p in parents) and all(link.is_file() for link in links):
        return ":".join("l/" + link.read_text().strip() for link in links), str(base)
    return ":".join(dirs), None


@contextmanager
def mounted_container(client, image: str, workspace: Path) -> Iterator[Path]:
    """A created (never started) container of `image`, its layers mounted read-only: what `docker export` reads."""
    container = client.containers.create(image, entrypoint=["/bin/true"])
    root = workspace / "rootfs"
    root.mkdir()
    mounted = False
    try:
        data = container.attrs["GraphDriver"]["Data"]
        lowerdir, cwd = _lowerdir_option([data["UpperDir"], *data["LowerDir"].split(":")])
        argv = ["mount", "-t", "overlay", "ddpack-sqsh", "-o", f"ro,lowerdir={lowerdir}", str(root)]
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise HostError(f"mounting the image's layers failed ({reason}); use --converter mksquashfs")
        mounted = True
        yield root
    finally:
        if mounted and subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)
        container.remove(force=True)


def _pseudo_name(name: str) -> str:
    """A path as mksquashfs reads it in pseudo and wildcard-exclude files (backslash escapes)."""
    if "\n" in name:
        raise HostError(f"the image holds a path with a newline ({name!r}); use --converter mksquashfs")
    return "".join("\\" + ch if ch in ' \t\\"*?[]' else ch for ch in name)


def tree_lists(root: Path, config: dict, meta_dir: Path) -> tuple[list[str], list[str]]:
    """mksquashfs exclude and pseudo-file lines that turn the mounted tree into enroot's.

    Excluded: `dev/*`, `/.dockerenv`, sockets (tar cannot carry them) and the image's own metadata
    files. Pseudo: enroot's metadata files, the folders it creates, and `fixperms`' mode changes,
    found by one `find` over the entries that lack an owner bit the rule adds.
    """
    excludes = ["dev/*", ".dockerenv", *METADATA_FILES]
    pseudo = [f"{folder} d 755 0 0" for folder in folders_enroot_creates(config) if not (root / folder).is_dir()]
    for name, text in metadata_files(config).items():
        path = meta_dir / name.replace("/", "_")
        path.write_text(text)
        pseudo.append(f"{name} f 644 0 0 cat {path}")
    lacking = ["(", "!", "-perm", "-u=r", "-o", "-type", "d", "!", "-perm", "-u=wx", "-o", "-perm", "/111", "!", "-perm", "-u=x", ")"]
    argv = ["find", str(root), "-mindepth", "1", "(", "-type", "s", "-o", "!", "-type", "l", *lacking, ")", "-printf", r"%d %m %y %P\0"]
    found = subprocess.run(argv, capture_output=True, check=True).stdout.decode("utf-8", "surrogateescape")
    for entry in filter(None, found.split("\0")):
        depth, mode, kind, name = entry.split(" ", 3)
        if excluded(name) or name in METADATA_FILES:
            continue
        if kind == "s":
            excludes.append(_pseudo_name(name))
            continue
        old = int(mode, 8)
        new = fixed_mode(old, kind == "d", int(depth))
        if new != old:
            pseudo.append(f"{_pseudo_name(name)} m {new:o} 0 0")
    return excludes, pseudo


def _mksquashfs_argv(source: Path, out: Path, options: str) -> list[str]:
    # -no-xattrs last: enroot's tar restores none, whatever the options say.
    return [
        _tool("mksquashfs", "squashfs-tools"),
        str(source),
        str(out),
        "-noappend",
        "-all-root",
        "-no-progress",
        "-quiet",
        *options.split(),
        "-no-xattrs",
    ]


def convert_layers(client, image: str, config: dict, options: str, tmp_out: Path, workspace: Path) -> None:
    _tool("mksquashfs", "squashfs-tools")  # names the missing tool before any work
    with mounted_container(client, image, workspace) as root:
        excludes, pseudo = tree_lists(root, config, workspace)
        (workspace / "exclude").write_text("".join(f"{line}\n" for line in excludes))
        (workspace / "pseudo").write_text("".join(f"{line}\n" for line in pseudo))
        lists = ["-wildcards", "-ef", str(workspace / "exclude"), "-pf", str(workspace / "pseudo")]
        result = subprocess.run([*_mksquashfs_argv(root, tmp_out, options), *lists])
    if result.returncode != 0:
        raise HostError(f"mksquashfs failed (exit {result.returncode}); its output above says why")


# --- mksquashfs / tar2sqfs: the export stream, rewritten as enroot would see it --------------------


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


def _relative(name: str) -> str:
    """A tar member name without a leading './' or '/' (not lstrip: '.dockerenv' must keep its dot)."""
    while name.startswith(("./", "/")):
        name = name[2:] if name.startswith("./") else name[1:]
    return name


def rootfs_tar(chunks: Iterator[bytes], config: dict, out) -> None:
    """An export as enroot's extraction leaves it: filtered, fixperms' modes, no xattrs, its metadata files."""
    generated = metadata_files(config)
    seen: set[str] = set()
    with (
        tarfile.open(fileobj=io.BufferedReader(_ChunkReader(chunks), 1 << 20), mode="r|") as src,
        tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as dst,
    ):
        for member in src:
            name = _relative(member.name).rstrip("/")
            if excluded(name) or name in generated:
                continue
            seen.add(name)
            member.uid = member.gid = 0
            member.uname = member.gname = "root"
            if not member.issym():
                member.mode = fixed_mode(member.mode, member.isdir(), name.count("/") + 1)
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if not k.startswith("SCHILY.xattr.")}
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
        for folder in folders_enroot_creates(config):
            if folder not in seen:
                info = tarfile.TarInfo(folder)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                dst.addfile(info)
        for name, text in generated.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))


def _feed(argv: list[str], chunks: Iterator[bytes], config: dict) -> int:
    """Run `argv` with the rewritten root filesystem tar on its standard input; its exit code."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    try:
        rootfs_tar(chunks, config, proc.stdin)
    finally:
        proc.stdin.close()
        code = proc.wait()
    return code


def convert_mksquashfs(client, image: str, config: dict, options: str, tmp_out: Path, workspace: Path) -> None:
    argv = _mksquashfs_argv(workspace / "rootfs", tmp_out, options)
    (workspace / "rootfs").mkdir()
    code = _feed(["tar", "-C", str(workspace / "rootfs"), "--numeric-owner", "-px"], export_stream(client, image), config)
    if code != 0:
        raise HostError(f"extracting the image failed (tar exit {code}); is there space in {workspace}?")
    result = subprocess.run(argv)
    if result.returncode != 0:
        raise HostError(f"mksquashfs failed (exit {result.returncode}); its output above says why")


def convert_tar2sqfs(client, image: str, config: dict, options: str, tmp_out: Path, workspace: Path) -> None:
    argv = [_tool("tar2sqfs", "squashfs-tools-ng"), "--force", "--quiet", "--no-keep-time", "--no-xattr"]
    words = options.split()
    if "-comp" in words and words.index("-comp") + 1 < len(words):
        argv += ["--compressor", words[words.index("-comp") + 1]]
    code = _feed([*argv, str(tmp_out)], export_stream(client, image), config)
    if code != 0:
        raise HostError(f"tar2sqfs failed (exit {code}); its output above says why")


def convert_enroot(client, image: str, config: dict, options: str, tmp_out: Path, workspace: Path) -> None:
    env = {**os.environ, "ENROOT_SQUASH_OPTIONS": options}
    result = subprocess.run([_tool("enroot", "enroot"), "import", "-o", str(tmp_out), f"dockerd://{image}"], env=env)
    if result.returncode != 0:
        raise HostError(f"enroot import failed (exit {result.returncode}); its output above says why")


RUNNERS = {"layers": convert_layers, "enroot": convert_enroot, "mksquashfs": convert_mksquashfs, "tar2sqfs": convert_tar2sqfs}


# --- the verb -------------------------------------------------------------------------------------


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
    return sorted(names)  # every name but the folders (`-lc`)


def record_path(output: Path) -> Path:
    return output.with_name(output.name + RECORD_SUFFIX)


def _record(output: Path, image_id: str, options: str) -> dict:
    stat = output.stat()
    return {"image_id": image_id, "squash_options": options, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def holds(output: Path, image_id: str, options: str) -> bool:
    """The output is the file a previous conversion of this image with these options wrote (unchanged since)."""
    if not_yours_alone(output) is not None or not_yours_alone(record_path(output)) is not None:
        return False
    try:
        recorded = json.loads(record_path(output).read_text())
        recorded.pop("image", None)
        recorded.pop("app_cmd", None)  # what the image runs, from its id: the same image, the same command
        return recorded == _record(output, image_id, options)
    except (OSError, ValueError):
        return False


def image_app_command(config: dict) -> str:
    """The command the image runs when given none: its DDPACK_APP_CMD (`make image APP=DIR APP_CMD=...`), "" for none
    (the bundled trainer). The record keeps it so that a job can tell, without opening the squashfs, whether its
    tasks run the bundled trainer, whose standbys are on by default on CPU nodes (enroot/ddpack_staging.py
    image_command)."""
    for entry in config.get("Env") or []:
        name, _, value = str(entry).partition("=")
        if name == "DDPACK_APP_CMD":
            return value.strip()
    return ""


def write_record(output: Path, image: str, image_id: str, options: str, app_cmd: str = "") -> None:
    """The record beside `output`, through a temp file mkstemp makes there (readable by the users whose jobs
    read it, like the squashfs)."""
    record = {"image": image, "app_cmd": app_cmd, **_record(output, image_id, options)}
    write_atomically(record_path(output), json.dumps(record, indent=1) + "\n", mode=0o644)


def choose_converter(requested: str, image_attrs: dict) -> tuple[str, str]:
    """The converter to run and, for auto, why (`requested` is already checked by convert)."""
    reason = layers_unavailable(image_attrs)
    if requested == "layers" and reason:
        raise HostError(f"--converter layers cannot run: {reason}; use --converter mksquashfs", code=2)
    if requested != "auto":
        return requested, ""
    if reason is None:
        return "layers", ""
    fallback = "enroot" if shutil.which("enroot") else "mksquashfs"
    return fallback, f"; {reason}, so {fallback}"


def convert(image: str, output: Path, converter: str = "auto", force: bool = False) -> Path:
    """Write `output` atomically (or leave it, when it already holds this image); returns it."""
    started = time.monotonic()
    output = output.parent.resolve() / output.name  # never the last component: a link planted there is replaced, not followed
    if not output.parent.is_dir():
        raise HostError(f"output folder {output.parent} does not exist; create it or choose another SQSH path", code=2)
    if converter not in ("auto", *CONVERTERS):
        raise HostError(f"converter {converter!r} is not one of auto, {', '.join(CONVERTERS)}", code=2)
    client = docker_client()
    try:
        attrs = client.images.get(image).attrs
    except ImageNotFound:
        raise HostError(f"image {image} not found; build it first (make image)", code=2) from None
    options, source = squash_options(DEFAULT_SQUASH_OPTIONS)
    if not force and holds(output, attrs["Id"], options):
        print(f"sqsh: {output} already holds {image} ({attrs['Id'][:19]}, {options!r}); nothing to do (--force rebuilds)")
        return output
    converter, why = choose_converter(converter, attrs)
    print(f"sqsh: {image} -> {output} ({converter}{why}; ENROOT_SQUASH_OPTIONS={options!r} from {source})", flush=True)
    try:
        staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}."))
    except OSError as exc:
        raise HostError(f"cannot write in {output.parent} ({exc.strerror or exc}); choose another SQSH path") from None
    tmp_out = staging / output.name
    try:
        with tempfile.TemporaryDirectory(prefix="ddpack-sqsh-") as workspace:
            RUNNERS[converter](client, image, attrs["Config"], options, tmp_out, Path(workspace))
        names = validate_squashfs(tmp_out)
        # Readable as the converter's umask made it, writable by this user alone: the job refuses an image others can
        # replace (enroot/ddpack_job.py image-ok), and a reuse trusts only a file of this user's alone.
        os.chmod(tmp_out, os.stat(tmp_out).st_mode & 0o7755)
        record_path(output).unlink(missing_ok=True)
        os.replace(tmp_out, output)
        write_record(output, image, attrs["Id"], options, image_app_command(attrs.get("Config") or {}))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise HostError(
                f"no space left writing {output} (or the temporary extraction); free space or set SQSH/TMPDIR elsewhere"
            ) from None
        raise HostError(f"writing {output} failed: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # our own private folder: what a failed converter left in it
    size = output.stat().st_size
    print(f"sqsh: wrote {output} ({size / 2**20:,.0f} MiB, {len(names):,} files and links) in {time.monotonic() - started:.1f}s")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.images.sqsh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", required=True, help="local image, e.g. ddpack:1a2b3c4")
    parser.add_argument("--output", required=True, type=Path, help="the .sqsh file to write (replaced atomically)")
    parser.add_argument("--converter", default="auto", help=f"auto (layers, else enroot, else mksquashfs), {', '.join(CONVERTERS)}")
    parser.add_argument("--force", action="store_true", help="convert even when the output already holds this image")
    opts = parser.parse_args(argv)
    return run_verb("sqsh", lambda: convert(opts.image, opts.output, opts.converter, opts.force) and 0)


if __name__ == "__main__":
    raise SystemExit(main())
