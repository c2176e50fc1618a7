"""The layering as import contracts (pyproject's [tool.importlinter]), checked with import-linter
exactly as `make lint` runs it: the application's CLI over the benchmarks over the fixtures over
the demo and the runs over the services over common/, no service importing another, protocol
importing nothing of Tether's, no cycles, and common/'s own layers."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.paths import REPO


def _contracts() -> list[dict]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    return doc["tool"]["importlinter"]["contracts"]


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is missing: install the dev extra (make setup)"
    return found


def test_every_import_contract_is_kept():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    r = subprocess.run(
        [_lint_imports(), "--no-cache"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    kept = [c["name"] for c in _contracts()]
    for name in kept:
        assert f"{name} KEPT" in r.stdout, r.stdout
    assert f"Contracts: {len(kept)} kept, 0 broken." in r.stdout


def test_protocol_contract_names_every_other_package():
    """A package added under common/ is forbidden to common.protocol too, not silently allowed."""
    protocol = next(c for c in _contracts() if c.get("source_modules") == ["common.protocol"])
    others = {
        f"common.{p.stem}"
        for p in (REPO / "common").iterdir()
        if p.name != "protocol"
        and ((p / "__init__.py").exists() or p.suffix == ".py")
        and p.name != "__init__.py"
    }
    above = {"services", "tether", "bench", "fixtures"}
    assert others | above == set(protocol["forbidden_modules"])


def _packages(parent: str) -> set[str]:
    return {f"{parent}.{p.name}" for p in (REPO / parent).iterdir() if (p / "__init__.py").exists()}


def test_contracts_name_every_service_and_application_package():
    """A service package added under services/ must stay independent of the others, and an
    application package added under tether/ must take a layer: neither is silently left out."""
    contracts = _contracts()
    independent = next(c for c in contracts if c["type"] == "independence")
    assert _packages("services") == set(independent["modules"])
    top = next(c for c in contracts if c["type"] == "layers" and "containers" not in c)
    named = {m.strip() for layer in top["layers"] for m in layer.split("|")}
    assert _packages("tether") <= named
    assert {"bench", "fixtures", "services", "common"} <= named


MAX_MODULE_LINES = 600  # a smell detector, not a target: split by concern, never to fit a count
CATCH_ALL = re.compile(r"(^|_)(rest|more|misc|utils?|helpers?|stuff)$")


def _tracked_python() -> list[str]:
    return subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()


def test_no_module_is_over_the_size_limit():
    """A module this long does several things: read it and split it by concern (or leave it, if it
    is one). The cap is loose on purpose, so that nothing is cut in two only to fit under it."""
    too_long = {
        path: n
        for path in _tracked_python()
        if (n := len((REPO / path).read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"over {MAX_MODULE_LINES} lines, split by concern: {too_long}"


def test_no_catch_all_names():
    """Modules, classes and functions are named by what they hold: no ``*_rest``, ``*_more``,
    ``misc``, ``utils`` or ``helpers``, which name no responsibility (STYLE.md)."""
    found = []
    for path in _tracked_python():
        if CATCH_ALL.search(Path(path).stem):
            found.append(path)
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"), filename=path)
        for node in ast.walk(tree):
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if is_def and CATCH_ALL.search(node.name.strip("_").lower()):
                found.append(f"{path}:{node.lineno} {node.name}")
    assert not found, f"catch-all names, name them by concern: {found}"


# where the whole config may be read: the package that defines it, the service harness that
# resolves it into each part's settings (common.service.settings) and checks it before start-up,
# and a service's main, which builds that service's settings once
CONFIG_READERS = ("common/config/", "common/service/")
# the parts that take settings of their own (issue 42 item 1): every service below its main,
# and the library outside its config package and the service harness
ON_OWN_SETTINGS = ("common/", "services/")


def _whole_config_readers(path: str) -> list[str]:
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.alias) and "TetherConfig" in (
            getattr(node, "id", None),
            getattr(node, "name", None),
        ):
            found.append(f"{path}:{node.lineno} TetherConfig")
        if isinstance(node, ast.arg) and node.arg == "cfg":
            found.append(f"{path}:{node.lineno} parameter cfg")
    return found


def test_below_the_mains_the_library_and_the_services_never_receive_the_whole_config():
    """Below the services' mains, the library and every service take settings of their own
    (``BusSettings``, ``EngineSettings``, ``ScorerSettings``, ``GeneratorSettings``,
    ``LearnerSettings``...), never ``TetherConfig``: no name of it (an annotation included) and
    no ``cfg`` parameter outside ``CONFIG_READERS`` and the mains. Import contracts cannot see this: an annotation-only
    import is not a dependency for them."""
    found = [
        hit
        for path in _tracked_python()
        if path.startswith(ON_OWN_SETTINGS)
        and not path.startswith(CONFIG_READERS)
        and not path.endswith("/main.py")
        for hit in _whole_config_readers(path)
    ]
    assert not found, f"the whole config below a main (resolve it into settings): {found}"
