"""`make push`: push a built image to Amazon ECR with boto3 (control plane) and the docker SDK (data).

The registry credential goes straight to the daemon with the push request: nothing is written to
~/.docker/config.json or anywhere else. Errors the daemon reports inside the push stream are
failures. Transient ones (throttling, 5xx, resets, an unreachable registry) are retried with
backoff a bounded number of times; permanent ones (denied, immutable tag) fail at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import requests
from docker.errors import APIError, ImageNotFound

from ddpack.errors import HostError, run_verb
from ddpack.images.ecr import (
    RegistryCredential,
    RepositorySettings,
    account_id,
    aws_session,
    ensure_repository,
    registry_credential,
    registry_override_from,
    validate_repository,
    validate_tag,
)
from ddpack.images.engine import docker_client

PERMANENT = (
    "denied",
    "unauthorized",
    "authentication required",
    "forbidden",
    "tag invalid",
    "immutable",
    "manifest invalid",
    "name unknown",
    "repository policy",
)
TRANSIENT = (
    "toomanyrequests",
    "too many requests",
    "throttl",
    "500 ",
    "502 ",
    "503 ",
    "504 ",
    "internal server error",
    "bad gateway",
    "service unavailable",
    "gateway timeout",
    "connection reset",
    "connection refused",
    "broken pipe",
    "eof",
    "timeout",
    "timed out",
    "temporarily unavailable",
    "no such host",
)
MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
    ]
)


class PushFailed(HostError):
    """The registry refused or failed the push; `transient` says whether a retry may help."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


def classify(message: str) -> bool:
    """True when an error message describes a failure worth retrying."""
    text = message.lower()
    if any(word in text for word in PERMANENT):
        return False
    return any(word in text for word in TRANSIENT)


@dataclass(frozen=True)
class PushResult:
    reference: str
    digest: str
    changed: bool


def _scheme(host: str) -> str:
    """Docker talks plain HTTP only to loopback registries; everything else is HTTPS."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return "http" if name in ("localhost", "[::1]") or name.startswith("127.") else "https"


def remote_digest(cred: RegistryCredential, repository: str, tag: str) -> str | None:
    """The digest `tag` holds in the registry now, or None when it holds nothing."""
    url = f"{_scheme(cred.host)}://{cred.host}/v2/{repository}/manifests/{tag}"
    try:
        response = requests.head(url, headers={"Accept": MANIFEST_TYPES}, auth=(cred.username, cred.password), timeout=30)
    except requests.RequestException as exc:
        raise PushFailed(f"registry {cred.host} is unreachable: {exc.__class__.__name__}", transient=True) from None
    if response.status_code == 404:
        return None
    if response.status_code in (401, 403):
        raise PushFailed(f"registry {cred.host} refused the credential ({response.status_code} {response.reason})", transient=False)
    if response.status_code >= 500:
        raise PushFailed(f"registry {cred.host} answered {response.status_code} {response.reason}", transient=True)
    return response.headers.get("Docker-Content-Digest")


class Progress:
    """One line per layer state change, and at most one 'Pushing' line per layer every few seconds."""

    def __init__(self, interval_s: float = 3.0) -> None:
        self.state: dict[str, str] = {}
        self.last: dict[str, float] = {}
        self.interval_s = interval_s

    def show(self, event: dict) -> None:
        layer, status = event.get("id"), event.get("status", "")
        if not layer or not status or status.startswith("The push refers to"):
            return
        now = time.monotonic()
        if status == "Pushing":
            if now - self.last.get(layer, 0.0) < self.interval_s:
                return
            detail = event.get("progressDetail") or {}
            if detail.get("total"):
                status = f"Pushing {detail.get('current', 0) / 2**20:,.1f}/{detail['total'] / 2**20:,.1f} MiB"
        elif self.state.get(layer) == status:
            return
        self.state[layer], self.last[layer] = event.get("status", ""), now
        print(f"push:   {layer}: {status}", flush=True)


def push_once(client, repository_ref: str, tag: str, cred: RegistryCredential) -> str:
    """One push through the daemon; returns the digest or raises PushFailed."""
    auth = {"username": cred.username, "password": cred.password, "serveraddress": cred.host}
    progress, digest = Progress(), None
    try:
        for event in client.api.push(repository_ref, tag=tag, auth_config=auth, stream=True, decode=True):
            if "error" in event or "errorDetail" in event:
                message = event.get("error") or event["errorDetail"].get("message", "unknown error")
                raise PushFailed(f"registry {cred.host} rejected the push: {message.strip()}", transient=classify(message))
            progress.show(event)
            digest = (event.get("aux") or {}).get("Digest", digest)
    except APIError as exc:
        message = str(exc.explanation or exc)
        raise PushFailed(f"docker push failed: {message}", transient=classify(message)) from None
    if not digest:
        raise PushFailed("the push stream ended without a digest", transient=True)
    return digest


def push_image(
    image: str,
    repository: str,
    tag: str,
    *,
    region: str | None = None,
    settings: RepositorySettings | None = None,
    registry_override: str | None = None,
    attempts: int = 4,
    backoff_s: float = 2.0,
) -> PushResult:
    settings = settings or RepositorySettings()
    validate_repository(repository)
    validate_tag(tag)
    client = docker_client()
    try:
        local = client.images.get(image)
    except ImageNotFound:
        raise HostError(f"image {image} is not built here; build it first (make image)", code=2) from None
    session = aws_session(region)
    account = account_id(session)
    created, repo = ensure_repository(session, repository, settings)
    print(
        f"push: repository {repo['repositoryName']} in {account}/{session.region_name} "
        f"{'created' if created else 'exists'} (tags {repo.get('imageTagMutability')}, scan on push "
        f"{(repo.get('imageScanningConfiguration') or {}).get('scanOnPush')})",
        flush=True,
    )
    cred = registry_credential(session, registry_override)
    target = f"{cred.host}/{repository}"
    reference = f"{target}:{tag}"
    for attempt in range(1, attempts + 1):
        try:
            before = remote_digest(cred, repository, tag)
            known = {d.split("@", 1)[1] for d in local.attrs.get("RepoDigests", []) if d.split("@", 1)[0] == target}
            if before and before in known:
                print(f"push: {reference} already holds {before}; nothing to push", flush=True)
                return PushResult(reference, before, changed=False)
            if before and repo.get("imageTagMutability") == "IMMUTABLE":
                raise PushFailed(
                    f"tag {tag} already exists in immutable repository {repository} with other content ({before}); use a new TAG",
                    transient=False,
                )
            local.tag(target, tag)
            print(f"push: {image} -> {reference} (attempt {attempt}/{attempts})", flush=True)
            digest = push_once(client, target, tag, cred)
            local.reload()
            return PushResult(reference, digest, changed=digest != before)
        except PushFailed as exc:
            if not exc.transient or attempt == attempts:
                suffix = f" (after {attempt} attempts)" if exc.transient else ""
                raise HostError(f"{exc}{suffix}") from None
            wait = backoff_s * 2 ** (attempt - 1)
            print(f"push: {exc}; retrying in {wait:.0f}s", file=sys.stderr, flush=True)
            time.sleep(wait)
    raise AssertionError("unreachable")


def next_steps(result: PushResult, host: str, repository: str, tag: str, region: str) -> str:
    """The exact references to use next: docker, enroot 3.x and 4.x, pyxis."""
    return "\n".join(
        [
            f"push: done: {result.reference} @ {result.digest}" + ("" if result.changed else " (unchanged)"),
            f"  docker pull {result.reference}",
            f"  enroot import 'docker://{host}#{repository}:{tag}'      # enroot 3.x",
            f"  enroot import 'docker://{host}/{repository}:{tag}'      # enroot 4.x",
            f"  srun --container-image={host}#{repository}:{tag} entrypoint",
            f"  enroot credentials: make enroot-credentials AWS_REGION={region}  (writes $ENROOT_CONFIG_PATH/.credentials, mode 600)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.images.push", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", required=True, help="local image to push, e.g. ddpack:1a2b3c4")
    parser.add_argument("--repository", required=True, help="ECR repository name (created when missing)")
    parser.add_argument("--tag", required=True, help="tag in the repository")
    parser.add_argument(
        "--region", default=os.environ.get("AWS_REGION") or None, help="AWS region (default: AWS_REGION, then your profile)"
    )
    parser.add_argument(
        "--registry",
        default=registry_override_from(os.environ),
        help="push to this registry host instead of the token's (default: DDPACK_REGISTRY; a non-ECR host is named in a warning first)",
    )
    parser.add_argument("--no-scan-on-push", action="store_true", help="new repositories: no scan on push")
    parser.add_argument("--tag-mutability", choices=("MUTABLE", "IMMUTABLE"), default="MUTABLE", help="new repositories: tag mutability")
    parser.add_argument("--encryption", choices=("AES256", "KMS"), default="AES256", help="new repositories: encryption")
    parser.add_argument("--kms-key", default=None, help="new repositories: KMS key (with --encryption KMS)")
    parser.add_argument("--attempts", type=int, default=4, help="tries for transient failures")
    opts = parser.parse_args(argv)
    settings = RepositorySettings(
        scan_on_push=not opts.no_scan_on_push, tag_mutability=opts.tag_mutability, encryption=opts.encryption, kms_key=opts.kms_key
    )

    def body() -> int:
        result = push_image(
            opts.image,
            opts.repository,
            opts.tag,
            region=opts.region,
            settings=settings,
            registry_override=opts.registry,
            attempts=opts.attempts,
        )
        host = result.reference.split("/", 1)[0]
        print(next_steps(result, host, opts.repository, opts.tag, aws_session(opts.region).region_name))
        return 0

    return run_verb("push", body)


if __name__ == "__main__":
    raise SystemExit(main())
