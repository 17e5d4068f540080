"""The shape of the package: no import cycle, argv parsed only in mars/cli, and a `mars` that starts fast."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from mars.cli import VERBS, main

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mars"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (a lazy import still ties the two)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from mars.training import base` imports the module mars.training.base
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return names


def test_no_import_cycle_among_mars_modules():
    graph = {name: sorted(n for n in imported(path) if n in MODULES and n != name) for name, path in MODULES.items()}
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in graph[name]:
            if state.get(dep) == "open":
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_only_the_cli_package_parses_argv():
    users = sorted(name for name, path in MODULES.items() if "argparse" in imported(path))
    assert users and all(name.startswith("mars.cli") for name in users), users


def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in MODULES if not n.endswith("__main__")]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_mars_help_loads_no_library_code():
    code = ("import sys\nfrom mars.cli import main\nmain(['--help'])\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'pydantic', 'yaml'}"
            " or (m.startswith('mars.') and m != 'mars.cli'))\nassert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "verbs:" in proc.stdout


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_a_cli_module_with_help(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_python_dash_m_runs_the_same_command():
    proc = subprocess.run([sys.executable, "-m", "mars.cli", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("mars "), proc.stderr
