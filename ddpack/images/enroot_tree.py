"""What enroot 3.4.1's `enroot import dockerd://IMAGE` makes of an image, as rules every converter shares.

enroot exports a created container, extracts it with `tar -px --exclude='dev/*' --exclude='.dockerenv'`
(no `--xattrs`, so no extended attributes survive), runs `common::fixperms` (`chmod -R u+rX`, then `u+w`
on folders up to depth 5), writes its metadata files with `docker::configure`, and squashes with
`mksquashfs -all-root $ENROOT_SQUASH_OPTIONS`. Each rule is here once, so the native converters give
the tree enroot gives: same names, owners, modes, links and byte-identical metadata files.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

# enroot's built-in default, used when neither the environment nor enroot.conf sets ENROOT_SQUASH_OPTIONS.
ENROOT_DEFAULT_SQUASH_OPTIONS = "-comp lzo -noD"
# What SageMaker HyperPod's enroot.conf sets: no compression at all, no duplicate search.
HYPERPOD_SQUASH_OPTIONS = "-comp lzo -noI -noD -noF -noX -no-duplicates"
ENROOT_CONF = Path("/etc/enroot/enroot.conf")
RC_LOCAL = "# This file is sourced by /etc/rc when the container starts.\n# It can be used to manipulate the entrypoint or the command of the container.\n"
METADATA_FILES = ("etc/environment", "etc/fstab", "etc/rc", "etc/rc.local")
FIXPERMS_WRITE_DEPTH = 5  # find rootfs -maxdepth 5 -type d ! -perm -u=w -exec chmod u+w

_ANSI_C = {
    "\a": "\\a",
    "\b": "\\b",
    "\x1b": "\\E",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    "'": "\\'",
}


def bash_quote(word: str) -> str:
    """`${word@Q}` as bash writes it: '…' with ' as '\\'', or $'…' when the word holds a control character."""
    if all(ch.isprintable() for ch in word):
        return "'" + word.replace("'", "'\\''") + "'"
    body = "".join(_ANSI_C.get(ch) or (ch if ch.isprintable() else "".join(f"\\{b:03o}" for b in ch.encode())) for ch in word)
    return f"$'{body}'"


def _exec_line(words: list[str], tail: str) -> str:
    # enroot: `exec ${entrypoint[@]+${entrypoint[@]@Q}} "$@"` - two spaces when the array is empty.
    return f"    exec {' '.join(bash_quote(w) for w in words)} {tail}\n"


def _read_lines(words: list[str] | None) -> list[str]:
    """`jq -r '.[]' | readarray -t`: one word per line, so a word holding a newline becomes two."""
    return "\n".join(words).split("\n") if words else []


def metadata_files(config: dict) -> dict[str, str]:
    """The files `docker::configure` writes, byte for byte, from an image's `docker inspect` Config."""
    env = config.get("Env") or []
    volumes = sorted((config.get("Volumes") or {}).keys())  # jq's keys[] sorts
    labels = config.get("Labels") or {}
    entrypoint = _read_lines(config.get("Entrypoint"))
    cmd = _read_lines(config.get("Cmd"))
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    workdir = workdir_of(config)
    rc = "".join(f"# {key} {value}\n" for key, value in labels.items())
    if rc:
        rc += "\n"
    rc += (
        f'mkdir -p "{workdir}" 2> /dev/null\n'
        f'cd "{workdir}" && unset OLDPWD || exit 1\n\n'
        "if [ -s /etc/rc.local ]; then\n    . /etc/rc.local\nfi\n\n"
        "if [ $# -gt 0 ]; then\n"
        + _exec_line(entrypoint, '"$@"')
        + "else\n"
        + _exec_line(entrypoint, " ".join(bash_quote(w) for w in cmd))
        + "fi\n"
    )
    return {
        "etc/environment": "".join(f"{line}\n" for line in env),
        "etc/fstab": "".join(f"${{ENROOT_ROOTFS}}{v} {v} none x-create=dir,bind,rw,nosuid,nodev\n" for v in volumes),
        "etc/rc": rc,
        "etc/rc.local": RC_LOCAL,
    }


def workdir_of(config: dict) -> str:
    return config.get("WorkingDir") or "/"


def folders_enroot_creates(config: dict) -> list[str]:
    """`mkdir -p rootfs/etc rootfs/WORKDIR`: every folder on those paths, parents first, relative."""
    folders: list[str] = []
    for path in ("etc", workdir_of(config)):
        parts = [p for p in path.split("/") if p]
        folders += ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return list(dict.fromkeys(folders))


def excluded(name: str) -> bool:
    """What enroot's tar leaves out of an export (`--anchored --exclude='dev/*' --exclude='.dockerenv'`)."""
    return name.startswith("dev/") or name == ".dockerenv"


def fixed_mode(mode: int, is_dir: bool, depth: int) -> int:
    """`common::fixperms` on one entry (not a symlink): u+r; u+x on folders and anything executable by
    someone; u+w on folders at most FIXPERMS_WRITE_DEPTH below the root (the root is depth 0)."""
    mode |= 0o400
    if is_dir or mode & 0o111:
        mode |= 0o100
    if is_dir and depth <= FIXPERMS_WRITE_DEPTH:
        mode |= 0o200
    return mode


def _conf_value(path: Path, key: str) -> str | None:
    """enroot's config::load reads `KEY value` or `KEY=value` lines (IFS=' \\t=')."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        stripped = line.lstrip(" \t=")
        fields = stripped.split(None, 1)
        if fields and fields[0].split("=", 1)[0] == key:
            return " ".join(stripped[len(key) :].lstrip(" \t=").split())
    return None


def squash_options(default: str) -> tuple[str, str]:
    """The ENROOT_SQUASH_OPTIONS enroot would use here, and where they come from.

    Like enroot: the environment first, then enroot.conf, then its drop-ins (the first value set wins),
    then `default` (ddpack's choice, passed to enroot too, so every converter squashes alike).
    """
    if os.environ.get("ENROOT_SQUASH_OPTIONS"):
        return " ".join(shlex.split(os.environ["ENROOT_SQUASH_OPTIONS"])), "ENROOT_SQUASH_OPTIONS"
    for path in [ENROOT_CONF, *sorted(Path(f"{ENROOT_CONF}.d").glob("*.conf"))]:
        value = _conf_value(path, "ENROOT_SQUASH_OPTIONS")
        if value:
            return value, str(path)
    return default, "ddpack's default"
