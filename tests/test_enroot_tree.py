"""enroot's rules as ddpack applies them: bash's @Q quoting, docker::configure's files byte for byte
(against enroot's own function where enroot is installed), fixperms' modes, and where the squash
options come from."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ddpack.images import enroot_tree
from ddpack.images.enroot_tree import bash_quote, fixed_mode, folders_enroot_creates, metadata_files, squash_options

ENROOT_LIB = Path("/usr/lib/enroot")
WORDS = [
    "/usr/local/bin/entrypoint",
    "it's",
    "",
    "a b",
    "x\ny",
    'd"q',
    "$HOME",
    "é",
    "\x01",
    "t\tb",
    "q'\n",
    "back\\slash",
    "\x7f",
    "\x1b",
    "`id`",
]

CONFIGS = {
    "no entrypoint, no cmd": {"Env": ["A=1"], "WorkingDir": ""},
    "entrypoint, empty cmd (the bundle's image)": {
        "Env": ["PATH=/opt/ddpack/venv/bin:/usr/bin", "PYTHONPATH="],
        "Entrypoint": ["/usr/local/bin/entrypoint"],
        "Cmd": [],
        "WorkingDir": "/workspace",
        "Labels": {"io.ddpack.variant": "cpu", "org.opencontainers.image.title": "ddpack"},
    },
    "cmd only": {"Cmd": ["python3", "-c", "print('hi')"], "WorkingDir": "/srv/app"},
    "awkward words": {
        "Entrypoint": ["/bin/sh", "-c", "echo \"$0\" 'x'"],
        "Cmd": ["a b", "it's", "tab\there", "new\nline"],
        "WorkingDir": "/work space/x",
        "Labels": {"b": "2", "a": "1 with spaces"},
        "Volumes": {"/data": {}, "/a b": {}, "/cache": {}},
        "Env": ["B=x y", "C="],
    },
}


def test_bash_quote_is_bashs_at_q() -> None:
    script = 'for w in "$@"; do printf "%s\\0" "${w@Q}"; done'
    out = subprocess.run(["bash", "-c", script, "bash", *WORDS], capture_output=True, check=True).stdout.decode()
    assert [bash_quote(w) for w in WORDS] == out.split("\0")[:-1]


def test_fixperms_adds_owner_bits_only_and_write_only_near_the_root() -> None:
    assert fixed_mode(0o640, False, 2) == 0o640  # /etc/shadow stays 0640
    assert fixed_mode(0o700, True, 1) == 0o700  # /root stays 0700
    assert fixed_mode(0o000, False, 3) == 0o400
    assert fixed_mode(0o070, False, 3) == 0o570  # executable by its group: u+x too
    assert fixed_mode(0o555, True, 5) == 0o755 and fixed_mode(0o555, True, 6) == 0o555
    assert fixed_mode(0o4711, False, 2) == 0o4711


def test_folders_enroot_creates_are_listed_parents_first() -> None:
    assert folders_enroot_creates({"WorkingDir": "/work space/x"}) == ["etc", "work space", "work space/x"]
    assert folders_enroot_creates({}) == ["etc"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_metadata_files_are_enroots_byte_for_byte(name: str, tmp_path: Path) -> None:
    if not (ENROOT_LIB / "docker.sh").is_file():
        if os.environ.get("CI"):
            pytest.fail("CI must install enroot (../shared/tools/install-enroot-pyxis.sh)")
        pytest.skip("enroot is not installed here")
    config = CONFIGS[name]
    (tmp_path / "config").write_text(json.dumps({"config": config}))  # as enroot's jq lower-cases `docker inspect`
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    script = f'set -euo pipefail; shopt -s lastpipe; source {ENROOT_LIB}/docker.sh; docker::configure "$1" "$2"'
    env = {
        "PATH": os.environ["PATH"],
        "ENROOT_LIBRARY_PATH": str(ENROOT_LIB),
        "ENROOT_CACHE_PATH": str(tmp_path),
        "ENROOT_CONFIG_PATH": str(tmp_path),
        "ENROOT_TRANSFER_RETRIES": "0",
        "ENROOT_CONNECT_TIMEOUT": "1",
        "ENROOT_TRANSFER_TIMEOUT": "1",
    }
    subprocess.run(["bash", "-c", script, "bash", str(rootfs), str(tmp_path / "config")], env=env, check=True)
    for member, text in metadata_files(config).items():
        assert (rootfs / member).read_text() == text, member
    made = sorted(str(p.relative_to(rootfs)) for p in rootfs.rglob("*") if p.is_dir())
    assert made == sorted(folders_enroot_creates(config))


def test_squash_options_come_from_the_environment_then_enroot_conf_then_the_default(monkeypatch, tmp_path: Path) -> None:
    conf = tmp_path / "enroot.conf"
    monkeypatch.setattr(enroot_tree, "ENROOT_CONF", conf)
    monkeypatch.delenv("ENROOT_SQUASH_OPTIONS", raising=False)
    assert squash_options("-comp lz4") == ("-comp lz4", "ddpack's default")
    (tmp_path / "enroot.conf.d").mkdir()
    (tmp_path / "enroot.conf.d" / "50-site.conf").write_text("ENROOT_SQUASH_OPTIONS=-comp zstd\n")
    assert squash_options("-comp lz4") == ("-comp zstd", str(tmp_path / "enroot.conf.d" / "50-site.conf"))
    conf.write_text("#ENROOT_SQUASH_OPTIONS -comp gzip\nENROOT_RUNTIME_PATH /run\nENROOT_SQUASH_OPTIONS   -comp lzo  -noI -noD\n")
    assert squash_options("-comp lz4") == ("-comp lzo -noI -noD", str(conf))
    monkeypatch.setenv("ENROOT_SQUASH_OPTIONS", "-comp xz")
    assert squash_options("-comp lz4") == ("-comp xz", "ENROOT_SQUASH_OPTIONS")
