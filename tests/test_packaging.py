"""The project's promises about itself: ``calc`` imports without torch or streamlit, the README
starts with the two commands, CI runs the README's test command, and the pins that keep a fresh
install small."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_COMMAND = "bash scripts/run.sh"
TEST_COMMAND = "bash scripts/test.sh"
HEAVY = ("torch", "streamlit", "transformers", "matplotlib", "tqdm", "verify")


def test_calc_imports_without_torch_or_streamlit() -> None:
    # ``sys.modules[name] = None`` makes ``import name`` raise ImportError. Every module of calc
    # is imported (except __main__, which would run the CLI), and the CLI parser is built.
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in HEAVY)
    code = f"""
import sys, pkgutil, importlib
{blocked}
import calc
for info in pkgutil.walk_packages(calc.__path__, "calc."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
import calc.cli.main
calc.cli.main.build_parser()
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"]


def _readme_head() -> str:
    """The README up to its first section heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.split(r"^## ", text, maxsplit=1, flags=re.MULTILINE)[0]


def test_readme_starts_with_the_two_commands() -> None:
    head = _readme_head()
    assert RUN_COMMAND in head
    assert TEST_COMMAND in head


def _commands(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command() -> None:
    assert TEST_COMMAND in _commands(ROOT / ".ci" / "run")


def test_scripts_named_by_the_commands_exist() -> None:
    for command in (RUN_COMMAND, TEST_COMMAND):
        assert (ROOT / command.split()[1]).is_file()


def test_test_command_lints_formats_and_tests() -> None:
    body = "\n".join(_commands(ROOT / "scripts" / "test.sh"))
    for step in ("ruff check .", "ruff format --check .", "pytest", "python -m verify --quick"):
        assert step in body


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()


def test_core_dependencies_are_sympy_and_numpy_only() -> None:
    project = _pyproject()["project"]
    assert project["name"] == "vramplan"
    assert {_name(r) for r in project["dependencies"]} == {"sympy", "numpy"}
    assert set(project["optional-dependencies"]) >= {"app", "verify", "dev"}


def test_torch_is_pinned_exactly_wherever_it_is_required() -> None:
    # An unpinned torch resolves to a multi-GB CUDA build; the pinned one is a local CPU wheel.
    extras = _pyproject()["project"]["optional-dependencies"]
    torch_reqs = [r for reqs in extras.values() for r in reqs if _name(r) == "torch"]
    assert torch_reqs
    assert all(re.fullmatch(r"torch==\d+\.\d+\.\d+", r.replace(" ", "")) for r in torch_reqs)


def test_every_package_directory_is_packaged() -> None:
    found = set(_pyproject()["tool"]["setuptools"]["packages"]["find"]["include"])
    for top in ("calc", "verify"):
        for init in (ROOT / top).rglob("__init__.py"):
            package = ".".join(init.parent.relative_to(ROOT).parts)
            assert any(
                re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), package) for p in found
            )
        for folder in (ROOT / top).rglob("*"):
            if folder.is_dir() and any(folder.glob("*.py")) and folder.name != "__pycache__":
                assert (folder / "__init__.py").is_file(), f"{folder} has no __init__.py"
