"""`make lint` checks every product file: no folder of the product has a name (build/, dist/, ...) that ruff skips."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from testbed.env import ROOT

PRODUCT = ("ddpack/", "train/", "entrypoint/", "enroot/", "ddpack_run/")


def test_ruff_sees_every_tracked_python_file_of_the_product() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    product = {path for path in tracked if path.startswith(PRODUCT)}
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True, check=True)
    seen = {line.strip().removeprefix(f"{ROOT}/") for line in shown.stdout.splitlines()}
    assert len(product) > 60 and product <= seen, sorted(product - seen)


def ddpack_imports() -> dict[str, set[str]]:
    """Each of ddpack's modules and the modules of ddpack's it imports, imports inside functions included."""
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
    return imports


def test_no_import_circle_among_ddpacks_modules() -> None:
    """ddpack's modules import one way, imports inside functions included (a circle hidden in a function is still one:
    neither module can be read, tested or moved without the other)."""
    imports = ddpack_imports()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)) for nxt in imports[start])

    circles = sorted(f"{a} <-> {b}" for a in imports for b in imports[a] if reaches(b, a, set()))
    assert len(imports) > 30 and circles == [], circles


def test_the_images_wing_imports_nothing_of_the_jobs_wing() -> None:
    """Jobs build on images (submit builds and converts), never the other way: a module of ddpack/images/ that needs
    a run folder's reading belongs with the jobs."""
    imports = ddpack_imports()
    upward = sorted(f"{name} -> {target}" for name, targets in imports.items() if name.startswith("ddpack.images")
                    for target in targets if target.startswith("ddpack.jobs"))  # fmt: skip
    assert [name for name in imports if name.startswith("ddpack.images.")] and upward == [], upward


def lint_commands() -> list[list[str]]:
    """The commands `make lint` runs, as the Makefile spells them (make -n; its venv taken as built), with this
    interpreter's ruff."""
    venv = Path(sys.executable).parent.parent
    shown = subprocess.run(
        ["make", "-n", "-s", "-o", f"{venv}/.installed", "lint", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    commands = [shlex.split(line) for line in shown.stdout.splitlines() if line.strip()]
    return [[sys.executable, "-m", "ruff", *argv[1:]] if argv[0].endswith("/ruff") else argv for argv in commands]


def test_make_lint_checks_every_product_file_with_ruffs_rules_and_its_format() -> None:
    """CI runs what `make lint` promises, so the two cannot drift: ruff check, and ruff format --check over each product
    folder. (It fails while a product file is not in ruff's format: the lead's one reformat of the tree mends that.)"""
    commands = lint_commands()
    checked = [argv[3:] for argv in commands if argv[3:4] == ["check"]]
    formatted = [argv[5:] for argv in commands if argv[3:5] == ["format", "--check"]]
    assert checked and formatted and all(set(PRODUCT) <= {f"{p.rstrip('/')}/" for p in paths} for paths in formatted), commands
    for argv in commands:
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        files = sorted(set(re.findall(r"^\s*--> (\S+?):\d+", out.stdout, re.MULTILINE)))
        assert out.returncode == 0, (
            f"{' '.join(argv[3:])}: {len(files)} file(s): {' '.join(files) or out.stdout[-2000:]} {out.stderr[-500:]}"
        )
