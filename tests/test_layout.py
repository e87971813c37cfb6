"""The house rules of the code base (issue 34), checked on the source itself.

* the demo's stage keys are those recorded (tests/data/demo_plan_keys.json; issue 35 changed ab_live, gate and publish on purpose, issue 36 train and bootstrap_drafter): a refactoring
  that changes a key would recompute finished outputs;
* no module of the library over 600 lines, no function over 80 lines outside bench/;
* layers: the library never imports Prefect or the orchestration; only drafter_prefect imports Prefect; the
  import graph of the library's subpackages, drafter_prefect and flows has no cycle;
* `drafter --help` lists every command.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY_ROOTS = ("drafter", "drafter_prefect", "flows", "tests", "deployments")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources(*roots: str) -> list[Path]:
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_demo_plan_keys_are_those_recorded():
    from drafter.core.config import load_config
    from drafter.core.pipeline import plan

    recorded = json.loads((ROOT / "tests/data/demo_plan_keys.json").read_text())
    assert len(recorded) >= 5
    for where, keys in recorded.items():
        path, profile = where.rsplit(":", 1)
        cfg = load_config(ROOT / path, None if profile == "default" else profile)
        now = {p.stage.name: p.key for p in plan(cfg)}
        assert now == keys, f"{where}: stage keys changed: " + ", ".join(
            f"{k} {keys.get(k)} → {now.get(k)}" for k in sorted(set(now) | set(keys)) if now.get(k) != keys.get(k))


def test_no_library_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources("drafter") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_80_lines_outside_bench():
    long = [f for p in _sources(*PY_ROOTS) for f in _long_functions(p)]
    assert long == []


def test_the_rule_checkers_see_what_they_look_for(tmp_path):
    """The two size rules find a long function and count nested functions into the enclosing one."""
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    src = tmp_path / "m.py"
    src.write_text(f"def outer():\n    def inner():\n{body}\n    return inner\n")
    assert [s.split(" ")[1] for s in _long_functions(src, tmp_path)] == ["outer", "inner"]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (absolute imports; the project has no
    relative ones)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _unit(module: str) -> str | None:
    """The layer a module belongs to: a subpackage of the library (drafter.core, drafter.cli, …), drafter_prefect
    or flows; None for anything else (the standard library, third parties, drafter's own __init__)."""
    parts = module.split(".")
    if parts[0] == "drafter" and len(parts) > 1 and (ROOT / "drafter" / parts[1]).is_dir():
        return f"drafter.{parts[1]}"
    return parts[0] if parts[0] in ("drafter_prefect", "flows") else None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for p in _sources("drafter", "drafter_prefect", "flows"):
        src = _unit(_module_name(p))
        if src is None:
            continue
        graph.setdefault(src, set()).update(u for m in _imports(p) if (u := _unit(m)) and u != src)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path + [n, m]
            if m not in state and (found := visit(m, path + [n])):
                return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n, [])):
            return found
    return None


def test_no_import_cycle_between_the_library_subpackages_the_orchestration_and_the_flows():
    graph = _graph()
    assert {"drafter.core", "drafter.stages", "drafter.cli", "drafter_prefect", "flows"} <= set(graph)
    assert _cycle(graph) is None, " → ".join(_cycle(graph))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the checker finds one


def test_only_the_orchestration_imports_prefect():
    prefect_users = sorted(str(p.relative_to(ROOT)) for p in _sources("drafter", "flows")
                           if any(m == "prefect" or m.startswith("prefect.") for m in _imports(p)))
    assert prefect_users == []
    # the library never imports the orchestration — except the command line's release/publish, which run the flow
    up = sorted(str(p.relative_to(ROOT)) for p in _sources("drafter")
                if any(m.startswith("drafter_prefect") for m in _imports(p)))
    assert all(u.startswith("drafter/cli/") for u in up), up
    # flows/ holds entry points only: each imports drafter_prefect and defines no flow of its own
    for p in _sources("flows"):
        assert {m.split(".")[0] for m in _imports(p)} == {"drafter_prefect"}, p
    assert not (ROOT / "tasks").exists()


def test_importing_the_whole_library_and_its_command_line_loads_no_prefect():
    mods = [_module_name(p) for p in _sources("drafter") if p.name != "__main__.py"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "print(sorted(k for k in sys.modules if k == 'prefect' or k.startswith('prefect.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_drafter_help_lists_every_command():
    from typer.main import get_command
    from typer.testing import CliRunner

    from drafter.cli import app

    names = sorted(get_command(app).commands)
    assert {"release", "publish", "stage", "plan", "runs", "clean", "heldout-sample"} <= set(names)
    out = CliRunner().invoke(app, ["--help"], terminal_width=200)
    assert out.exit_code == 0
    listed = {line.strip("│ ").split(" ")[0] for line in out.output.splitlines()}
    assert set(names) <= listed, set(names) - listed


@pytest.mark.parametrize("argv", [["-m", "drafter", "--help"], ["-m", "drafter", "stage", "--help"]])
def test_python_dash_m_drafter_is_the_command_line(argv):
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    assert "Usage:" in out.stdout and ("stage" in out.stdout)
