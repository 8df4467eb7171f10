"""The layers of flowkv are a test: import-linter's contracts, and no import cycle between modules.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``). Both
checks read the package as it is installed: ``flowkv.stages`` and
``flowkv.kernels`` live in ``stages/`` and ``kernels/`` of the checkout (see
``[tool.setuptools] package-dir``), so the checks run over a folder of
symbolic links that puts them inside ``flowkv/``, as a wheel does. The
checkout holds the same links (``flowkv/stages``, ``flowkv/kernels``,
``flowkv/pipelines``), so ``lint-imports`` run bare from the checkout sees the
package as installed too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory) -> Path:
    """A folder holding ``flowkv/`` laid out as installed, every file a link into the checkout."""
    package_dirs = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    folder = tmp_path_factory.mktemp("layout")
    package = folder / "flowkv"
    package.mkdir()
    for entry in (ROOT / package_dirs["flowkv"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, source in package_dirs.items():
        parts = name.split(".")
        if parts[0] != "flowkv" or len(parts) != 2:
            continue
        target = package / parts[1]
        if not target.exists():
            target.symlink_to(ROOT / source)
    return folder


def _run_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The working folder comes first on sys.path, so `flowkv` is found there, not in the checkout.
    return subprocess.run(args, cwd=folder, capture_output=True, text=True, check=False)


def test_import_linter_contracts_are_kept(installed_layout):
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), (
        f"{lint_imports} is missing: install import-linter (it is in the 'dev' extra of pyproject.toml)"
    )
    result = _run_in(installed_layout, str(lint_imports), str(PYPROJECT), "--no-cache")
    assert result.returncode == 0, f"lint-imports found broken contracts:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout


def test_lint_imports_passes_run_bare_from_the_checkout():
    """As a developer runs it: ``lint-imports`` in the checkout, no arguments (the README's set-up)."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    for name in ("stages", "kernels", "pipelines"):
        link = ROOT / "flowkv" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), f"{link} must link to ../{name}"
    result = _run_in(ROOT, str(lint_imports))
    assert result.returncode == 0, f"lint-imports from the checkout:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout


# Finds every cycle of the import graph and prints one path through each; run
# in a child process so that grimp finds the installed layout, not the
# checkout this process imported flowkv from.
_FIND_CYCLES = r"""
import json, sys, tomllib
import grimp

config = tomllib.load(open(sys.argv[1], "rb"))["tool"]["importlinter"]
graph = grimp.build_graph(
    "flowkv",
    exclude_type_checking_imports=config.get("exclude_type_checking_imports", False),
    cache_dir=None,
)
for contract in config["contracts"]:
    if contract["type"] == "acyclic_siblings":
        for expression in contract.get("ignore_imports", []):
            importer, imported = (part.strip() for part in expression.split("->"))
            if graph.direct_import_exists(importer=importer, imported=imported):
                graph.remove_import(importer=importer, imported=imported)

index, low, stack, on_stack, cycles = {}, {}, [], set(), []
for start in sorted(graph.modules):
    if start in index:
        continue
    work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
        module, children = work[-1]
        for child in children:
            if child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                break
            if child in on_stack:
                low[module] = min(low[module], index[child])
        else:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    members = set(component)
                    first = min(members)
                    step = min(m for m in graph.find_modules_directly_imported_by(first) if m in members)
                    back = graph.find_shortest_chain(importer=step, imported=first)
                    cycles.append([first, *back])
print(json.dumps(cycles))
"""


def test_no_module_imports_itself_through_others(installed_layout):
    """An import cycle, however long, is found and printed as its path (module -> module -> ...)."""
    result = _run_in(installed_layout, sys.executable, "-c", _FIND_CYCLES, str(PYPROJECT))
    assert result.returncode == 0, result.stderr
    cycles = json.loads(result.stdout)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_importing_flowkv_testing_loads_neither_the_engine_nor_vllm():
    probe = (
        "import sys, flowkv.testing; "
        "print(sorted(m for m in ('flowkv.engine', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
