"""`make lint` checks every product file: no folder of the product has a name (build/, dist/, ...) that ruff skips."""

from __future__ import annotations

import subprocess
import sys

from testbed.env import ROOT

PRODUCT = ("ddpack/", "train/", "entrypoint/", "enroot/", "ddpack_run/")


def test_ruff_sees_every_tracked_python_file_of_the_product() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    product = {path for path in tracked if path.startswith(PRODUCT)}
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True, check=True)
    seen = {line.strip().removeprefix(f"{ROOT}/") for line in shown.stdout.splitlines()}
    assert len(product) > 60 and product <= seen, sorted(product - seen)


def test_no_import_circle_among_ddpacks_modules() -> None:
    """ddpack's modules import one way, imports inside functions included (a circle hidden in a function is still one:
    neither module can be read, tested or moved without the other)."""
    import ast

    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path for path in (ROOT / "ddpack").rglob("*.py")}
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {target for target in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if target in modules}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        imports[name] = found - {name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)) for nxt in imports[start])

    circles = sorted(f"{a} <-> {b}" for a in imports for b in imports[a] if reaches(b, a, set()))
    assert len(modules) > 30 and circles == [], circles
