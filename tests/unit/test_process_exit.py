"""How a process that ran gloo collectives ends (``common/service/process_exit.py``).

A process holding gloo groups can abort at interpreter finalization ("terminate called without
an active exception", SIGABRT) after its work is done: CI failed on it twice, in a two-rank
checkpoint save and in ``bench.memory_worker``. Each entry point that starts such groups asks
for ``skip_finalization`` and ends through ``end``; the guard below keeps new ones from forgetting.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from common.service import process_exit
from tests.paths import REPO

# what starts gloo process groups in the process that calls it
_STARTS_GROUPS = (
    "setup_distributed(",
    "init_process_group(",
    "WeightPublisher(",
    "WeightReceiver(",
)


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return node
    return None


def test_every_entry_point_that_starts_gloo_groups_ends_through_process_exit() -> None:
    checked, missing = [], []
    for path in sorted(
        [*(REPO / "bench").rglob("*.py"), *(REPO / "tests" / "procs").rglob("*.py")]
    ):
        source = path.read_text()
        block = _main_block(ast.parse(source))
        if block is None or not any(s in source for s in _STARTS_GROUPS):
            continue
        text = ast.unparse(block)
        checked.append(path.name)
        if "process_exit.skip_finalization(" not in text or "process_exit.end(" not in text:
            missing.append(str(path.relative_to(REPO)))
    assert len(checked) >= 10, checked  # the scan finds the workers it is meant to guard
    assert not missing, f"entry points without process_exit: {missing}"


def test_only_entry_points_ask_to_skip_finalization() -> None:
    """A library function that asked would make ``tether``'s ``main``, run in-process after it
    (as tests do), end the test worker with ``os._exit``."""
    callers = []
    for top in ("common", "services", "tether", "bench", "fixtures"):
        for path in sorted((REPO / top).rglob("*.py")):
            tree = ast.parse(path.read_text())
            block = _main_block(tree)
            allowed = set() if block is None else {id(n) for n in ast.walk(block)}
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "skip_finalization"
                    and id(node) not in allowed
                ):
                    callers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    # the learner service's main, run only as its own process (`tether learner`, torchrun)
    assert [c.split(":")[0] for c in callers] == ["services/learner/main.py"], callers


def test_end_joins_threads_runs_atexit_flushes_and_exits_with_the_code(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(f"""
        import atexit, sys, threading
        sys.path.insert(0, {str(REPO)!r})
        from common.service import process_exit
        process_exit.skip_finalization("a test")
        atexit.register(lambda: print("atexit ran", flush=False))
        go = threading.Event()
        def late():  # still at work when end() is called: released just before it
            go.wait(30)
            print("thread finished", flush=False)
        threading.Thread(target=late).start()
        sys.stdout.write("buffered ")
        go.set()
        process_exit.end(3)
        print("not reached")
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["buffered", "thread", "finished", "atexit", "ran"]


def test_end_without_the_request_returns_the_code() -> None:
    # the pytest worker may have asked for it already (an in-process setup_distributed)
    saved, process_exit._reason = process_exit._reason, None
    try:
        assert process_exit.end(5) == 5
    finally:
        process_exit._reason = saved
