"""Install a user's project's requirements into the image's venv with torch held fixed (docker/app.Dockerfile).

Run by the image's own Python, in the app's dependency layer:  python install-app.py REQUIREMENTS PATTERN...
and in its code layer:  python install-app.py --record JSON  (the app into ddpack-build.json, its folder onto
sys.path).
The packages a CUDA torch is made of (torch, triton, nvidia-*) are pinned to what the image has by a
constraints file, so pip cannot swap the image's torch for another build (the classic accident: a package
that depends on torch pulls the multi-GB CUDA build into the CPU image). When pip cannot satisfy the
requirements without another torch, the build ends with one line, `ddpack-app: error: ...`, naming the
requirement and the torch it wanted; `ddpack.images.images` shows that line as the build's error. Afterwards the
held packages are compared with what they were, and torch is imported.

Like install-runtime.sh: a CA bundle comes as the BuildKit secret pip_cert, wheels from /wheelhouse (a bind
mount); PIP_EXTRA_ARGS (e.g. --no-index for an air-gapped build) goes to pip. Standard library only.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PREFIX = "ddpack-app:"
# pip's resolver explains a conflict as lines under "The conflict is caused by:", e.g.
#   The user requested torch==2.12.0
#   The user requested (constraint) torch==2.13.0+cpu
#   needs-old-torch 1.0 depends on torch==2.1.0
CAUSE_RE = re.compile(r"^\s*(?:(?P<who>\S+ \S+) depends on|The user requested(?P<constraint> \(constraint\))?) (?P<req>.+?)\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def held_versions(patterns: list[str]) -> dict[str, str]:
    """The installed packages the patterns name (ddpack.images.app.HELD_PACKAGES: torch and the CUDA wheels it
    was built against), as installed now."""
    found = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            found[name] = dist.version
    return found


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(@]", req.strip(), maxsplit=1)[0])


def explain_conflict(output: str, held: dict[str, str]) -> str | None:
    """The one line for a resolution conflict over a held package, from pip's own explanation; None when
    the conflict is about something else (pip's message then stands)."""
    causes = []
    in_causes = False
    for line in output.splitlines():
        if "The conflict is caused by:" in line:
            in_causes = True
            continue
        if in_causes and not line.strip():
            in_causes = False
        match = CAUSE_RE.match(line) if in_causes else None
        if match and not match["constraint"] and requirement_name(match["req"]) in held:
            who = match["who"] or "the requirements file"
            causes.append(f"{who} {'depends on' if match['who'] else 'asks for'} {match['req']}")
    if not causes:
        return None
    torch = held.get("torch", "?")
    return (
        f"the app's requirements want another torch than the image's {torch}: {'; '.join(dict.fromkeys(causes))}; "
        f"pin a version made for torch {torch.split('+')[0]}, or drop the requirement (the image provides torch)"
    )


def fail(message: str, code: int = 2) -> None:
    print(f"{PREFIX} error: {message}", flush=True)
    sys.exit(code)


def record(entry: str) -> None:
    """The app's record into ddpack-build.json (what the preflight compares across ranks) and its folder onto
    the venv's sys.path after the bundle's: ddpack_app.pth sorts after ddpack.pth, so a project's own
    `train/` or `entrypoint/` never shadows the bundle's."""
    import sysconfig

    build_file = Path("/opt/ddpack/lib/ddpack-build.json")
    build = json.loads(build_file.read_text())
    build["app"] = json.loads(entry)
    partial = build_file.with_suffix(".json.partial")
    partial.write_text(json.dumps(build))
    partial.chmod(0o644)
    partial.replace(build_file)
    app = Path(os.environ.get("DDPACK_APP_DIR", "/opt/app"))
    paths = [app, *([app / "src"] if (app / "src").is_dir() else [])]
    Path(sysconfig.get_paths()["purelib"], "ddpack_app.pth").write_text("".join(f"{path}\n" for path in paths))
    print(f"{PREFIX} {build['app']['name']} at {app}, digest {build['app']['digest']}; on sys.path: {', '.join(map(str, paths))}")


def main() -> None:
    if sys.argv[1] == "--record":
        record(sys.argv[2])
        return
    requirements, patterns = Path(sys.argv[1]), sys.argv[2:]
    held = held_versions(patterns)
    lines = [line for line in requirements.read_text().splitlines() if line.strip()]
    if not lines:
        print(f"{PREFIX} no requirements; the image's environment stays as it is", flush=True)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("".join(f"{name}=={version}\n" for name, version in sorted(held.items())))
    env = dict(os.environ)
    cert = Path("/run/secrets/pip_cert")
    if cert.is_file() and cert.stat().st_size:
        env["PIP_CERT"] = str(cert)
    argv = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "-c", constraints.name]
    if any(Path("/wheelhouse").glob("*.whl")):
        argv += ["--find-links", "/wheelhouse"]
    argv += [*os.environ.get("PIP_EXTRA_ARGS", "").split(), "-r", str(requirements)]
    print(f"{PREFIX} installing {len(lines)} requirement lines with {', '.join(f'{k}=={v}' for k, v in sorted(held.items()))} held", flush=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    output = []
    for line in proc.stdout:
        output.append(line)
        sys.stdout.write(line)
    if proc.wait() != 0:
        explained = explain_conflict("".join(output), held)
        if explained:
            fail(explained)
        fail(f"pip could not install the app's requirements (exit {proc.returncode}); pip's own message is above", code=1)
    after = held_versions(patterns)
    changed = [f"{name} {held.get(name, 'absent')} -> {after.get(name, 'removed')}" for name in sorted({*held, *after}) if held.get(name) != after.get(name)]
    if changed:
        fail(f"installing the app's requirements changed the image's {', '.join(changed)}; the image's torch must stay as built")
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:  # torch.__version__ may carry a local label (+cu130) its metadata lacks: compared above
        fail(f"torch does not import as {held.get('torch')} after the app's requirements ({(check.stderr or check.stdout).strip()[-200:]})", code=1)
    print(f"{PREFIX} installed; torch {check.stdout.strip()} as built", flush=True)


if __name__ == "__main__":
    main()
