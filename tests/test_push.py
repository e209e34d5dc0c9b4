"""`make push` against local stand-ins: moto's ECR server for the control plane and Debian's
docker-registry (htpasswd auth with the token's password) for the image data."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import bcrypt
import boto3
import pytest
import requests
from docker_support import engine_or_skip

import docker
from ddpack.errors import HostError
from ddpack.images.credentials import write_enroot_credentials
from ddpack.images.ecr import ECR_HOST_RE, RepositorySettings
from ddpack.images.push import classify, push_image
from testbed.env import ROOT, clean_env
from train.distributed import free_port

pytestmark = pytest.mark.docker
TOKEN_PASSWORD = "123456789012-auth-token"  # what moto's get-authorization-token hands out


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            requests.get(url, timeout=2)
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


@pytest.fixture(scope="module")
def moto(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def start_registry(root: Path, password: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("docker-registry")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's docker-registry")
        pytest.skip("Debian's docker-registry is not installed (apt-get install docker-registry)")
    port = free_port()
    (root / "htpasswd").write_text(f"AWS:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()}\n")
    (root / "config.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\nauth:\n  htpasswd:\n    realm: ddpack-test\n    path: {root / 'htpasswd'}\n"
    )
    log = open(root / "registry.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([binary, "serve", str(root / "config.yml")], stdout=log, stderr=log)
    host = f"127.0.0.1:{port}"
    wait_http(f"http://{host}/v2/")
    return proc, host


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[str]:
    proc, host = start_registry(tmp_path_factory.mktemp("registry"), TOKEN_PASSWORD)
    yield host
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def aws(moto: str, monkeypatch, tmp_path: Path) -> Path:
    """AWS pointed at moto the standard way; HOME and DOCKER_CONFIG empty, to catch credential files."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_ECR": moto,
        "AWS_ENDPOINT_URL_STS": moto,
        "HOME": str(tmp_path / "home"),
        "DOCKER_CONFIG": str(tmp_path / "home" / ".docker"),
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def tiny_image(client: docker.DockerClient, content: str) -> str:
    """A one-file image, imported: pushes in a second."""
    tag = f"ddpack-push-test:{uuid.uuid4().hex[:8]}"
    work = Path(f"/tmp/{tag.replace(':', '-')}")
    work.mkdir()
    (work / "hello").write_text(content)
    tar = subprocess.run(["tar", "-C", str(work), "-c", "."], capture_output=True, check=True).stdout
    shutil.rmtree(work)
    repository, version = tag.split(":")
    client.api.import_image_from_data(tar, repository=repository, tag=version)
    return tag


def repo_name() -> str:
    return f"ddpack/test-{uuid.uuid4().hex[:8]}"


def test_push_creates_repository_with_settings_pulls_back_and_repeats_as_a_no_op(aws: Path, registry: str, moto: str) -> None:
    client = engine_or_skip()
    image, repository = tiny_image(client, "one"), repo_name()
    settings = RepositorySettings(scan_on_push=False, tag_mutability="IMMUTABLE", encryption="AES256")
    first = push_image(image, repository, "v1", settings=settings, registry_override=registry)
    assert first.changed and first.digest.startswith("sha256:") and first.reference == f"{registry}/{repository}:v1"
    repo = boto3.client("ecr", region_name="us-east-1").describe_repositories(repositoryNames=[repository])["repositories"][0]
    assert repo["imageTagMutability"] == "IMMUTABLE" and repo["imageScanningConfiguration"] == {"scanOnPush": False}
    assert repo["encryptionConfiguration"]["encryptionType"] == "AES256"

    second = push_image(image, repository, "v1", settings=settings, registry_override=registry)
    assert second.digest == first.digest and not second.changed

    client.images.remove(first.reference)
    pulled = client.images.pull(f"{registry}/{repository}", tag="v1", auth_config={"username": "AWS", "password": TOKEN_PASSWORD})
    assert f"{registry}/{repository}@{first.digest}" in pulled.attrs["RepoDigests"]
    assert list(aws.rglob("*")) == [], "no credential file may be written"


def test_existing_repository_is_left_as_it_is(aws: Path, registry: str) -> None:
    client = engine_or_skip()
    repository = repo_name()
    boto3.client("ecr", region_name="us-east-1").create_repository(repositoryName=repository, imageTagMutability="MUTABLE")
    push_image(
        tiny_image(client, "x"), repository, "v1", settings=RepositorySettings(tag_mutability="IMMUTABLE"), registry_override=registry
    )
    repo = boto3.client("ecr", region_name="us-east-1").describe_repositories(repositoryNames=[repository])["repositories"][0]
    assert repo["imageTagMutability"] == "MUTABLE"


def test_immutable_tag_with_other_content_fails_at_once(aws: Path, registry: str) -> None:
    client = engine_or_skip()
    repository, immutable = repo_name(), RepositorySettings(tag_mutability="IMMUTABLE")
    push_image(tiny_image(client, "a"), repository, "v1", settings=immutable, registry_override=registry)
    started = time.monotonic()
    with pytest.raises(HostError, match="already exists in immutable repository") as info:
        push_image(tiny_image(client, "b"), repository, "v1", settings=immutable, registry_override=registry, backoff_s=120)
    assert time.monotonic() - started < 120 and "attempts" not in str(info.value)  # one retry alone would wait 120 s


def test_wrong_credential_is_a_clear_permanent_failure(aws: Path, tmp_path: Path) -> None:
    client = engine_or_skip()
    (tmp_path / "strict").mkdir()
    proc, host = start_registry(tmp_path / "strict", "another-password")
    try:
        with pytest.raises(HostError, match=rf"registry {host} refused the credential \(401"):
            push_image(tiny_image(client, "c"), repo_name(), "v1", registry_override=host, backoff_s=5)
    finally:
        proc.terminate()


def test_stopped_registry_is_retried_then_fails_with_the_reason(aws: Path, capsys) -> None:
    client = engine_or_skip()
    host = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(HostError, match=rf"registry {host} is unreachable: ConnectionError \(after 3 attempts\)"):
        push_image(tiny_image(client, "d"), repo_name(), "v1", registry_override=host, attempts=3, backoff_s=0.05)
    assert capsys.readouterr().err.count("retrying in") == 2


def request_body(handler: http.server.BaseHTTPRequestHandler) -> bytes:
    """A request's body, sent with a length or chunked (dockerd sends a layer's bytes chunked)."""
    if handler.headers.get("Content-Length"):
        return handler.rfile.read(int(handler.headers["Content-Length"]))
    data = b""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        while size := int(handler.rfile.readline().split(b";")[0], 16):
            data += handler.rfile.read(size)
            handler.rfile.readline()
        handler.rfile.readline()
    return data


class FailingRegistry(http.server.BaseHTTPRequestHandler):
    """Takes every blob, then fails the manifest with 503. dockerd retries a failed blob upload itself, four times
    over 50 s; a failed manifest it reports at once, in the push's stream, in the same words."""

    protocol_version = "HTTP/1.1"
    blobs: ClassVar[dict[str, int]] = {}  # digest: size, of the blobs uploaded
    uploaded: ClassVar[list[int]] = [0]  # the bytes of the upload under way (PATCH), which the PUT then names

    def log_message(self, *args) -> None:
        pass

    def _reply(self, code: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in {"Content-Length": "0", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.end_headers()

    def do_GET(self) -> None:
        self._reply(200 if self.path.rstrip("/") == "/v2" else 404)

    def do_HEAD(self) -> None:
        digest = self.path.rsplit("/", 1)[1]
        if "/blobs/" in self.path and digest in self.blobs:
            self._reply(200, {"Docker-Content-Digest": digest, "Content-Length": str(self.blobs[digest])})
        else:
            self._reply(404)

    def do_POST(self) -> None:  # an upload begins
        self.uploaded[0] = 0
        self._reply(202, {"Location": f"{self.path}1", "Range": "0-0", "Docker-Upload-UUID": "1"})

    def do_PATCH(self) -> None:
        self.uploaded[0] += len(request_body(self))
        self._reply(202, {"Location": self.path, "Range": f"0-{max(self.uploaded[0] - 1, 0)}", "Docker-Upload-UUID": "1"})

    def do_PUT(self) -> None:
        self.uploaded[0] += len(request_body(self))
        digest = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).get("digest", [""])[0]
        if "/blobs/uploads/" in self.path and digest:
            self.blobs[digest] = self.uploaded[0]
            self._reply(201, {"Docker-Content-Digest": digest, "Location": f"{self.path.split('/blobs/')[0]}/blobs/{digest}"})
        else:
            self._reply(503)  # the manifest


def test_errors_inside_the_push_stream_fail_the_push(aws: Path) -> None:
    """The registry takes the layers and fails the manifest with 503: dockerd reports it in the push's stream (its
    exit says nothing), where ddpack must find it, name it and take it for a transient error. One attempt of
    ddpack's is enough (the retry loop around it is the stopped registry's test above); a failed layer upload would
    show the same, after dockerd's own four retries (about 50 s)."""
    client = engine_or_skip()
    FailingRegistry.blobs.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingRegistry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(HostError, match=rf"registry {host} rejected the push: .*503.*\(after 1 attempts\)"):
            push_image(tiny_image(client, "e"), repo_name(), "v1", registry_override=host, attempts=1, backoff_s=0.05)
    finally:
        server.shutdown()
    assert len(FailingRegistry.blobs) == 2  # the layer and the image's config: the stream failed at the manifest


def test_real_cpu_image_push_and_pull_back(cpu_image: str, aws: Path, registry: str) -> None:
    """cpu_image (conftest's, once a session) is built before `aws` swaps HOME (pip's config, and so the wheelhouse,
    live there): it comes first."""
    client = engine_or_skip()
    result = push_image(cpu_image, repo_name(), "pytest", registry_override=registry)
    client.images.remove(result.reference)
    repository = result.reference.split("/", 1)[1].rsplit(":", 1)[0]
    pulled = client.images.pull(f"{registry}/{repository}", tag="pytest", auth_config={"username": "AWS", "password": TOKEN_PASSWORD})
    assert pulled.id == client.images.get(cpu_image).id


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--image", "x:y", "--repository", "Bad_Name", "--tag", "v1"], {}, "repository name 'Bad_Name' is not valid for ECR"),
        (["--image", "x:y", "--repository", "ok", "--tag=-bad"], {}, "tag '-bad' is not a valid image tag"),
        (
            ["--image", "ddpack-never-built:1", "--repository", "ok", "--tag", "v1"],
            {"AWS_REGION": "us-east-1"},
            "is not built here; build it first (make image)",
        ),
        (["--image", "ddpack-tiny-missing:1", "--repository", "ok", "--tag", "v1"], {"AWS_REGION": ""}, None),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], env: dict[str, str], needle: str | None, moto: str) -> None:
    client = engine_or_skip()
    if needle is None:  # no region: needs an image that exists, so that the region check is what fails
        args[1] = tiny_image(client, "f")
        needle = "no AWS region is set; set AWS_REGION"
    environ = clean_env(AWS_ACCESS_KEY_ID="t", AWS_SECRET_ACCESS_KEY="t", AWS_ENDPOINT_URL_ECR=moto, AWS_ENDPOINT_URL_STS=moto, **env)
    environ.pop("AWS_DEFAULT_REGION", None)
    environ.pop("AWS_PROFILE", None)
    environ["AWS_CONFIG_FILE"] = "/nonexistent"
    out = subprocess.run([sys.executable, "-m", "ddpack.images.push", *args], env=environ, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and needle in out.stderr


@pytest.mark.parametrize(
    ("message", "transient"),
    [
        ("denied: requested access to the resource is denied", False),
        ("unauthorized: authentication required", False),
        (
            "tag invalid: The image tag 'v1' already exists in the 'x' repository and cannot be overwritten because the repository is immutable.",
            False,
        ),
        ("toomanyrequests: Rate exceeded", True),
        ("received unexpected HTTP status: 503 Service Unavailable", True),
        ("read tcp 10.0.0.1:443: connection reset by peer", True),
        ("something else entirely", False),
    ],
)
def test_classify_transient_and_permanent(message: str, transient: bool) -> None:
    assert classify(message) is transient


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("123456789012.dkr.ecr.us-east-1.amazonaws.com", True),
        ("123456789012.dkr.ecr-fips.us-gov-west-1.amazonaws.com", True),
        ("123456789012.dkr.ecr.cn-north-1.amazonaws.com.cn", True),
        ("123456789012.dkr-ecr.eu-west-1.on.aws", True),
        ("123456789012.dkr.ecr.us-east-1.amazonaws.com.evil.example", False),
        ("evil.example", False),
        ("12345.dkr.ecr.us-east-1.amazonaws.com", False),
    ],
)
def test_only_ecr_hosts_receive_the_credential(host: str, ok: bool) -> None:
    assert bool(ECR_HOST_RE.match(host)) is ok


def test_enroot_credentials_file_is_private_merged_and_idempotent(aws: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ENROOT_CONFIG_PATH", str(tmp_path / "enroot"))
    path = tmp_path / "enroot" / ".credentials"
    path.parent.mkdir()
    path.write_text("machine nvcr.io login $oauthtoken password abc\n")
    for _ in range(2):
        assert write_enroot_credentials("eu-west-1") == path
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text() == (
        "machine nvcr.io login $oauthtoken password abc\n"
        "machine 123456789012.dkr.ecr.eu-west-1.amazonaws.com login AWS password $(aws ecr get-login-password --region eu-west-1)\n"
    )
    write_enroot_credentials("eu-west-1", literal=True)
    assert path.read_text().splitlines()[-1].endswith(f"login AWS password {TOKEN_PASSWORD}")
    assert [p.name for p in path.parent.iterdir()] == [".credentials"]
