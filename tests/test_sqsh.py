"""`make sqsh`: the tree enroot's own import gives (compared with real enroot where it is installed, and
with the rules on a fixture image with every awkward entry), the content cache, atomic output, the options
really used, and the trainer running from the unpacked root filesystem as a non-root uid with a login
shell, as pyxis runs it."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from docker_support import TEST_TAG, engine_or_skip

from ddpack.errors import HostError
from ddpack.images.base import LOCAL_BASE
from ddpack.images.sqsh import RUNNERS, convert, layers_unavailable, record_path
from testbed.env import ROOT, clean_env

docker = pytest.mark.docker
FIXTURE_TAG = "ddpack-sqsh-fixture:pytest"
# Every kind of entry whose treatment differs between a naive conversion and enroot's.
FIXTURE_DOCKERFILE = """
FROM {base}
RUN mkdir -p /fx/ro/a/b/c/d/e/f /fx/ro/a/b/c/d/e/f/g && chmod 0555 /fx/ro /fx/ro/a/b/c/d/e/f \
 && printf none > /fx/none && chmod 0000 /fx/none \
 && printf gx > /fx/gx && chmod 0070 /fx/gx && ln /fx/gx /fx/gx-hard && ln -s gx /fx/sym \
 && printf space > '/fx/a b' && chmod 0600 '/fx/a b' && mkdir /fx/private && chmod 0700 /fx/private \
 && printf old > /etc/rc && printf 'X=old' > /etc/environment \
 && python3 -c "import os, socket; socket.socket(socket.AF_UNIX).bind('/fx/sock'); os.setxattr('/fx/none', 'user.k', b'v')" \
 && rm -rf /usr/share/doc /var/lib/apt
WORKDIR /fx/work dir
ENV A=1 B="x y"
VOLUME /data
LABEL b=2 a="1 2"
ENTRYPOINT ["/bin/echo", "it's"]
CMD ["a b"]
"""


def need(tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install {package}")
        pytest.skip(f"{tool} is not installed ({package})")


@pytest.fixture(scope="module")
def sqsh(tmp_path_factory, cpu_image: str) -> Path:
    need("mksquashfs", "squashfs-tools")
    return convert(cpu_image, tmp_path_factory.mktemp("sqsh") / "ddpack.sqsh")


@pytest.fixture(scope="module")
def fixture_image(sqsh: Path) -> str:
    """A small image from the base the bundle's image was built on, with every awkward kind of entry."""
    client = engine_or_skip()
    base = client.images.get(TEST_TAG).labels.get("org.opencontainers.image.base.name") or LOCAL_BASE
    client.images.build(fileobj=io.BytesIO(FIXTURE_DOCKERFILE.format(base=base).encode()), tag=FIXTURE_TAG, rm=True)
    return FIXTURE_TAG


def tree(path: Path) -> dict[str, tuple]:
    """Every entry of a squashfs: kind, mode, owner, link target (hard links too), size, xattr names, and
    the bytes of enroot's metadata files."""
    proc = subprocess.Popen(["sqfs2tar", "--root-becomes", ".", str(path)], stdout=subprocess.PIPE)
    entries = {}
    with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        for m in tar:
            data = tar.extractfile(m).read() if m.isreg() and m.name.startswith("./etc/") and m.size < 4096 else b""
            xattrs = tuple(sorted(k for k in m.pax_headers if k.startswith("SCHILY.xattr.")))
            mode = 0 if m.issym() else m.mode
            entries[m.name] = (m.type, f"{mode:04o}", m.uid, m.gid, m.linkname, m.size, xattrs, data)
    assert proc.wait() == 0
    return entries


def enroot_import(image: str, out: Path, options: str) -> Path:
    need("enroot", "enroot (../shared/tools/install-enroot-pyxis.sh)")
    env = {**os.environ, "ENROOT_SQUASH_OPTIONS": options}
    subprocess.run(["enroot", "import", "-o", str(out), f"dockerd://{image}"], env=env, check=True, capture_output=True, timeout=900)
    return out


def cat(sqsh: Path, member: str) -> str:
    return subprocess.run(["unsquashfs", "-cat", str(sqsh), member], capture_output=True, text=True, check=True).stdout


def listing(sqsh: Path) -> list[str]:
    out = subprocess.run(["unsquashfs", "-lln", str(sqsh)], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "squashfs-root" in line]


def mode_of(entries: dict[str, tuple], name: str) -> str:
    return entries[f"./{name}"][1]


@docker
def test_metadata_follows_enroot(sqsh: Path) -> None:
    environment = cat(sqsh, "etc/environment").splitlines()
    assert "PATH=/opt/ddpack/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in environment
    assert "PYTHONPATH=" in environment and "LD_LIBRARY_PATH=" in environment
    rc = cat(sqsh, "etc/rc")
    assert "# io.ddpack.variant cpu" in rc and 'cd "/workspace" && unset OLDPWD || exit 1' in rc
    assert "exec '/usr/local/bin/entrypoint' \"$@\"" in rc
    assert cat(sqsh, "etc/rc.local").startswith("# This file is sourced by /etc/rc")
    assert cat(sqsh, "etc/fstab") == ""


@docker
def test_owned_by_root_with_no_mode_widened_and_no_docker_leftovers(sqsh: Path) -> None:
    lines = listing(sqsh)
    assert all(line.split()[1] == "0/0" for line in lines)
    names = {line.split("squashfs-root", 1)[1].split(" -> ")[0]: line.split()[0] for line in lines}
    assert "/usr/local/bin/entrypoint" in names
    assert "/.dockerenv" not in names and not [n for n in names if n.startswith("/dev/")]
    assert names["/etc/shadow"] == "-rw-r-----" and names["/root"] == "drwx------"  # enroot adds owner bits only
    assert [n for n, perms in names.items() if perms[0] != "l" and perms[1] != "r"] == []


@docker
def test_trainer_runs_from_the_unpacked_root_as_non_root_with_a_login_shell(sqsh: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    subprocess.run(["unsquashfs", "-q", "-d", str(root), str(sqsh)], check=True, stdout=subprocess.DEVNULL)
    # enroot gives a container /proc and /dev; so does this chroot.
    if subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")]).returncode != 0:
        pytest.skip("cannot mount /proc here (needs root)")
    subprocess.run(["mount", "--bind", "/dev", str(root / "dev")], check=True)
    try:
        script = "cd /tmp && command -v entrypoint && python -c 'import torch; print(torch.__version__)' && entrypoint --epochs 1 --snapshot-dir s"
        out = subprocess.run(
            ["/usr/sbin/chroot", "--userspec=4242:4242", str(root), "/bin/sh", "-lc", script],
            env={"PATH": "/host/only/bin:/usr/bin:/bin", "HOME": "/nonexistent", "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(["umount", str(root / "proc"), str(root / "dev")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("/usr/local/bin/entrypoint\n2.13.0+cpu\n")
    assert "checksums agree across 1 ranks" in out.stdout and "snapshot saved: s/snapshot-" in out.stdout


@docker
def test_every_converter_gives_enroots_tree_on_an_awkward_image(fixture_image: str, tmp_path: Path) -> None:
    need("tar2sqfs", "squashfs-tools-ng")
    options, client = "-comp lzo -noD", engine_or_skip()
    config = client.images.get(fixture_image).attrs["Config"]
    made = {}
    for converter in ("layers", "mksquashfs", "tar2sqfs"):  # the runners alone: this is no ddpack image
        (tmp_path / converter).mkdir()
        RUNNERS[converter](client, fixture_image, config, options, tmp_path / f"{converter}.sqsh", tmp_path / converter)
        made[converter] = tree(tmp_path / f"{converter}.sqsh")
    expected = made["layers"]
    # The rules, on the fixture (what enroot does, written out): owner bits added, nothing widened.
    assert mode_of(expected, "fx/none") == "0400" and mode_of(expected, "fx/gx") == "0570"
    assert mode_of(expected, "fx/ro") == "0755" and mode_of(expected, "fx/ro/a/b/c/d/e/f") == "0555"  # u+w to depth 5
    assert mode_of(expected, "fx/a b") == "0600" and mode_of(expected, "fx/private") == "0700"
    assert mode_of(expected, "etc/shadow") == "0640" and mode_of(expected, "root") == "0700"
    assert expected["./fx/gx-hard"][4] == "./fx/gx"  # a hard link stays one
    assert expected["./fx/sym"][4] == "gx"
    assert "./fx/sock" not in expected and "./.dockerenv" not in expected and "./dev" in expected
    assert not [n for n in expected if n.startswith("./dev/")] and not [n for n, e in expected.items() if e[6]]  # no xattrs
    assert not [n for n in expected if n.startswith("./usr/share/doc/")] and "./fx/work dir" in expected
    assert {e[2:4] for e in expected.values()} == {(0, 0)}
    assert expected["./etc/rc"][7].endswith(b"exec '/bin/echo' 'it'\\''s' 'a b'\nfi\n")
    assert expected["./etc/environment"][7].endswith(b"\nA=1\nB=x y\n")
    assert expected["./etc/fstab"][7] == b"${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
    for converter in ("mksquashfs", "tar2sqfs"):
        assert made[converter] == expected, converter
    if shutil.which("enroot") or os.environ.get("CI"):
        enroot = tree(enroot_import(fixture_image, tmp_path / "enroot.sqsh", options))
        assert enroot == expected


@docker
def test_a_second_conversion_of_the_same_image_is_a_no_op(sqsh: Path, tmp_path: Path) -> None:
    target = tmp_path / "x.sqsh"
    shutil.copy2(sqsh, target)
    shutil.copy2(record_path(sqsh), record_path(target))
    run = [sys.executable, "-m", "ddpack.images.sqsh", "--image", TEST_TAG, "--output", str(target)]
    out = subprocess.run(run, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.count("\n") == 1 and "already holds ddpack:pytest" in out.stdout, out.stdout
    before = target.stat().st_mtime_ns
    # --force, other options, an edited file and another image each rebuild.
    for extra, env in (
        (["--force"], {}),
        ([], {"ENROOT_SQUASH_OPTIONS": "-comp lz4"}),
    ):
        out = subprocess.run([*run, *extra], env=clean_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and "sqsh: wrote" in out.stdout, out.stdout + out.stderr
        assert target.stat().st_mtime_ns != before
        before = target.stat().st_mtime_ns
    assert "Compression lz4" in subprocess.run(["unsquashfs", "-s", str(target)], capture_output=True, text=True).stdout
    with target.open("r+b") as f:
        f.seek(200)
        f.write(b"x")
    out = subprocess.run(run, env=clean_env(ENROOT_SQUASH_OPTIONS="-comp lz4"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "sqsh: wrote" in out.stdout, out.stdout
    client = engine_or_skip()
    client.images.build(fileobj=io.BytesIO(f"FROM {TEST_TAG}\nLABEL other=1\n".encode()), tag="ddpack-sqsh-other:pytest", rm=True)
    other = [sys.executable, "-m", "ddpack.images.sqsh", "--image", "ddpack-sqsh-other:pytest", "--output", str(target)]
    out = subprocess.run(other, env=clean_env(ENROOT_SQUASH_OPTIONS="-comp lz4"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "sqsh: wrote" in out.stdout and "# other 1" in cat(target, "etc/rc"), out.stdout
    assert json.loads(record_path(target).read_text())["image"] == "ddpack-sqsh-other:pytest"
    assert json.loads(record_path(target).read_text())["app_cmd"] == ""  # the bundle: the trainer is its command


def test_the_record_names_the_images_own_command_for_the_job_and_a_reuse_does_not_depend_on_it(tmp_path: Path) -> None:
    """make sqsh's record keeps the image's APP_CMD ("" for the bundled trainer), which the job reads to choose its
    standbys (enroot/ddpack_staging.py image_command); whether a conversion is reused still depends on the image id,
    options and file alone."""
    from ddpack.images.sqsh import holds, image_app_command, write_record
    from ddpack.job_side import module

    assert image_app_command({"Env": ["PATH=/usr/bin", "DDPACK_APP_CMD=python train.py --lr 3e-4"]}) == "python train.py --lr 3e-4"
    assert image_app_command({"Env": ["PATH=/usr/bin"]}) == image_app_command({}) == ""
    sqsh = tmp_path / "x.sqsh"
    sqsh.write_bytes(b"hsqs")
    sqsh.chmod(0o644)
    write_record(sqsh, "x:1", "sha256:" + "a" * 64, "-comp lz4", "python train.py")
    assert module("ddpack_staging").image_command(str(sqsh)) == "python train.py"
    assert holds(sqsh, "sha256:" + "a" * 64, "-comp lz4")
    sqsh.write_bytes(b"hsqs, another file now")
    assert module("ddpack_staging").image_command(str(sqsh)) is None  # the record no longer describes the file


@docker
def test_enroots_own_import_of_the_bundle_gives_its_tree_with_the_options_printed(sqsh: Path, tmp_path: Path) -> None:
    """One enroot import of the bundle's image (the slow step here: enroot saves, unpacks and squashes the whole image),
    through `ddpack.images.sqsh --converter enroot` with the options the default converter used: the line printed names
    them, enroot used them (the superblock's compressor), and its tree and size are the default converter's."""
    need("enroot", "enroot (../shared/tools/install-enroot-pyxis.sh)")
    options = json.loads(record_path(sqsh).read_text())["squash_options"]
    output = tmp_path / "enroot.sqsh"
    run = [sys.executable, "-m", "ddpack.images.sqsh", "--image", TEST_TAG, "--output", str(output), "--converter", "enroot"]
    out = subprocess.run(run, env=clean_env(ENROOT_SQUASH_OPTIONS=options), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"(enroot; ENROOT_SQUASH_OPTIONS={options!r} from ENROOT_SQUASH_OPTIONS)" in out.stdout, out.stdout
    compressor = options.split("-comp", 1)[1].split()[0] if "-comp" in options else "gzip"
    assert f"Compression {compressor}" in subprocess.run(["unsquashfs", "-s", str(output)], capture_output=True, text=True).stdout
    assert tree(sqsh) == tree(output)
    assert sqsh.stat().st_size == output.stat().st_size


@docker
def test_output_is_replaced_atomically_and_failures_leave_no_file(sqsh: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.sqsh"
    target.write_bytes(b"previous good file")
    for converter in ("layers", "mksquashfs"):
        with pytest.raises(HostError, match="the squashfs lacks usr/local/bin/entrypoint"):
            convert(LOCAL_BASE, target, converter)  # not a ddpack image
        assert target.read_bytes() == b"previous good file"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.sqsh"]
    convert(TEST_TAG, target)
    assert target.stat().st_size > 100 * 2**20 and sorted(p.name for p in tmp_path.iterdir()) == ["out.sqsh", "out.sqsh.ddpack.json"]
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if "ddpack-sqsh" in line]  # layers unmounted


@docker
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--image", "ddpack:never-built", "--output", "/tmp/x.sqsh"], "image ddpack:never-built not found; build it first (make image)"),
        (["--image", TEST_TAG, "--output", "/nonexistent/dir/x.sqsh"], "output folder /nonexistent/dir does not exist"),
        (["--image", TEST_TAG, "--output", "/tmp/x.sqsh", "--converter", "zip"], "converter 'zip' is not one of auto, layers"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    engine_or_skip()
    out = subprocess.run(
        [sys.executable, "-m", "ddpack.images.sqsh", *args], env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr


@docker
@pytest.mark.parametrize("converter", ["layers", "mksquashfs"])
def test_missing_tool_is_named(converter: str, monkeypatch, tmp_path: Path) -> None:
    engine_or_skip()
    monkeypatch.setenv("PATH", str(tmp_path))  # no mksquashfs, no tar, nothing
    with pytest.raises(HostError, match=r"mksquashfs is not installed; install squashfs-tools"):
        convert(TEST_TAG, tmp_path / "x.sqsh", converter, force=True)
    assert list(tmp_path.iterdir()) == []


def test_layers_say_why_they_cannot_run(monkeypatch, tmp_path: Path) -> None:
    layer = tmp_path / "diff"
    layer.mkdir()
    here = {"GraphDriver": {"Name": "overlay2", "Data": {"UpperDir": str(layer), "LowerDir": str(layer)}}}
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert layers_unavailable(here) is None
    assert "not overlay2" in layers_unavailable({"GraphDriver": {"Name": "vfs", "Data": {}}})
    remote = {"GraphDriver": {"Name": "overlay2", "Data": {"UpperDir": "/nowhere/diff"}}}
    assert layers_unavailable(remote) == "the engine's layers are not on this host (a remote engine?)"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert layers_unavailable(here) == "mounting the image's layers needs root (running as uid 1000)"
