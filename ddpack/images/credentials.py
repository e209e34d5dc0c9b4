"""`make enroot-credentials`: let enroot (and so pyxis) pull from ECR.

Writes a `machine HOST login AWS password ...` line into $ENROOT_CONFIG_PATH/.credentials (enroot's
netrc-style file; default ~/.config/enroot/.credentials), mode 600, replacing the line for the same
registry and keeping every other. By default the password is the command
`$(aws ecr get-login-password --region REGION)`, which enroot runs at import time, so no token is
stored; --literal stores the current token instead (valid 12 hours) for nodes without the AWS CLI.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ddpack.errors import HostError, run_verb
from ddpack.images.ecr import aws_session, registry_credential, registry_override_from
from ddpack.private_files import write_atomically


def credentials_path() -> Path:
    if os.environ.get("ENROOT_CONFIG_PATH"):
        return Path(os.environ["ENROOT_CONFIG_PATH"]) / ".credentials"
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "enroot" / ".credentials"


def write_enroot_credentials(
    region: str | None, registry_override: str | None = None, literal: bool = False, path: Path | None = None
) -> Path:
    session = aws_session(region)
    cred = registry_credential(session, registry_override)
    password = cred.password if literal else f"$(aws ecr get-login-password --region {session.region_name})"
    line = f"machine {cred.host} login {cred.username} password {password}"
    path = path or credentials_path()
    try:
        existing = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror}") from None
    kept = [entry for entry in existing if entry.split()[:2] != ["machine", cred.host]]
    write_atomically(path, "\n".join([*kept, line]) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.images.credentials", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--region", default=os.environ.get("AWS_REGION") or None)
    parser.add_argument(
        "--registry",
        default=registry_override_from(os.environ),
        help="registry host instead of the token's (default: DDPACK_REGISTRY; a non-ECR host is named in a warning first)",
    )
    parser.add_argument("--literal", action="store_true", help="store the current token instead of the aws command")
    opts = parser.parse_args(argv)

    def body() -> int:
        path = write_enroot_credentials(opts.region, opts.registry, opts.literal)
        print(f"enroot-credentials: wrote {path} (mode 600)")
        return 0

    return run_verb("enroot-credentials", body)


if __name__ == "__main__":
    raise SystemExit(main())
