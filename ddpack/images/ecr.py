"""The ECR control plane through boto3: region, account, repository, registry credential.

Credentials come from boto3's standard chain (environment, profile, SSO, instance role). Endpoints
can be overridden the standard way (AWS_ENDPOINT_URL_ECR, AWS_ENDPOINT_URL_STS), which is how the
tests point this at moto's server. The registry host the token goes to is the token's own ECR endpoint
unless ddpack's own setting DDPACK_REGISTRY names another (a stand-in); never the common name REGISTRY,
which a shell or CI may set for something else and which would silently send the token there.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from ddpack.errors import HostError

# Private ECR registry hosts, IPv4 and dual-stack, commercial and China partitions.
ECR_HOST_RE = re.compile(r"^(\d{12})\.dkr[.-]ecr(-fips)?\.([a-z0-9-]+)\.(amazonaws\.com(\.cn)?|on\.aws)$")
REPOSITORY_RE = re.compile(r"^(?=.{2,256}$)(?:[a-z0-9]+(?:[._-][a-z0-9]+)*/)*[a-z0-9]+(?:[._-][a-z0-9]+)*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
REGISTRY_SETTING = "DDPACK_REGISTRY"  # ddpack's own name for the registry override: the environment's and make's
RETRIES = Config(retries={"max_attempts": 6, "mode": "standard"})  # throttling and 5xx, with backoff


@dataclass(frozen=True, kw_only=True)
class RepositorySettings:
    scan_on_push: bool = True
    tag_mutability: str = "MUTABLE"
    encryption: str = "AES256"
    kms_key: str | None = None


@dataclass(frozen=True)
class RegistryCredential:
    host: str
    username: str
    password: str = ""
    expires_at: datetime | None = None

    def __repr__(self) -> str:  # never print the password by accident
        return f"RegistryCredential(host={self.host!r}, username={self.username!r}, expires_at={self.expires_at!r})"


def validate_repository(name: str) -> str:
    if not REPOSITORY_RE.match(name):
        raise HostError(
            f"repository name {name!r} is not valid for ECR; use lowercase letters, digits and ._-/ separators (2-256 characters)", code=2
        )
    return name


def validate_tag(tag: str) -> str:
    if not TAG_RE.match(tag):
        raise HostError(f"tag {tag!r} is not a valid image tag; use letters, digits, _ . - (max 128, not starting with . or -)", code=2)
    return tag


def aws_session(region: str | None) -> boto3.Session:
    """A session for `region`, else AWS_REGION, else boto3's own chain (AWS_DEFAULT_REGION, profile)."""
    session = boto3.Session(region_name=region or os.environ.get("AWS_REGION") or None)
    if not session.region_name:
        raise HostError("no AWS region is set; set AWS_REGION (make push AWS_REGION=us-east-1) or a region in your AWS profile", code=2)
    return session


def _explain(what: str, exc: Exception) -> HostError:
    """An AWS failure as one line: which call, AWS's error code and message."""
    if isinstance(exc, NoCredentialsError):
        return HostError(f"{what}: no AWS credentials found; configure a profile, SSO (aws sso login) or environment variables")
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return HostError(f"{what}: {error.get('Code', 'error')}: {error.get('Message', str(exc))}")
    return HostError(f"{what}: {exc}")


def _aws_call(what: str, call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except (BotoCoreError, ClientError) as exc:
        raise _explain(what, exc) from None


def account_id(session: boto3.Session) -> str:
    return _aws_call("sts get-caller-identity", session.client("sts", config=RETRIES).get_caller_identity)["Account"]


def ensure_repository(session: boto3.Session, name: str, settings: RepositorySettings) -> tuple[bool, dict]:
    """(created, repository): create with `settings` when missing; an existing one is left as it is.
    Safe when two pushes race: the loser sees RepositoryAlreadyExists and reads the winner's."""
    ecr = session.client("ecr", config=RETRIES)
    try:
        return False, ecr.describe_repositories(repositoryNames=[name])["repositories"][0]
    except ecr.exceptions.RepositoryNotFoundException:
        pass
    except (ClientError, BotoCoreError) as exc:
        raise _explain("ecr describe-repositories", exc) from None
    encryption = {"encryptionType": settings.encryption}
    if settings.encryption == "KMS" and settings.kms_key:
        encryption["kmsKey"] = settings.kms_key
    try:
        repo = ecr.create_repository(
            repositoryName=name,
            imageTagMutability=settings.tag_mutability,
            imageScanningConfiguration={"scanOnPush": settings.scan_on_push},
            encryptionConfiguration=encryption,
        )["repository"]
        return True, repo
    except ecr.exceptions.RepositoryAlreadyExistsException:
        return False, _aws_call("ecr describe-repositories", ecr.describe_repositories, repositoryNames=[name])["repositories"][0]
    except (ClientError, BotoCoreError) as exc:
        raise _explain("ecr create-repository", exc) from None


def registry_override_from(environ: Mapping[str, str]) -> str | None:
    """The registry host the user asked for instead of the token's: DDPACK_REGISTRY, and nothing else."""
    return environ.get(REGISTRY_SETTING) or None


def registry_credential(session: boto3.Session, registry_override: str | None = None) -> RegistryCredential:
    """The registry's host and a docker credential from get-authorization-token.

    The credential is only ever sent to a host that looks like an ECR registry, unless the user named
    another one explicitly (`registry_override`, from DDPACK_REGISTRY: e.g. a local registry standing in
    for ECR); such a host is named in one warning line on stderr here, before the caller sends or writes
    anything, so that a stray setting cannot hand the token over unseen."""
    data = _aws_call("ecr get-authorization-token", session.client("ecr", config=RETRIES).get_authorization_token)["authorizationData"][0]
    username, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    host = re.sub(r"^https?://", "", data["proxyEndpoint"]).rstrip("/")
    endpoint = ECR_HOST_RE.match(host)
    if registry_override:
        if not ECR_HOST_RE.match(registry_override):
            account = endpoint[1] if endpoint else account_id(session)
            print(
                f"ddpack: warning: sending the ECR token for account {account} to {registry_override}, "
                f"which is not an ECR registry ({REGISTRY_SETTING})",
                file=sys.stderr,
                flush=True,
            )
        host = registry_override
    elif not endpoint:
        raise HostError(f"the token's endpoint {host!r} is not an ECR registry host; refusing to send it a credential")
    return RegistryCredential(host, username, password, data.get("expiresAt"))
