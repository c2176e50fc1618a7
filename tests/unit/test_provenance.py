"""``tether.runs.provenance.git_state`` on a real git repository made here: a changed code file
makes the tree dirty; a result a benchmark wrote (bench/results/, bench/README.md) does not, so
the benchmark after it is not stamped dirty for it."""

from __future__ import annotations

import subprocess

from tether.runs.provenance import git_state


def _git(repo, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=30)


def test_a_changed_result_is_not_a_changed_tree_a_changed_file_is(tmp_path):
    repo = tmp_path / "clone"
    (repo / "bench" / "results" / "demos").mkdir(parents=True)
    files = {"code.py": "x = 1\n", "bench/results/demos/tools.json": "{}\n",
             "bench/README.md": "# r\n", "README.md": "# t\n"}  # fmt: skip
    for name, text in files.items():
        (repo / name).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    state = git_state(repo)
    assert len(state["commit"]) == 40 and state["dirty"] is False

    (repo / "bench/results/demos/tools.json").write_text('{"runs": []}\n')
    (repo / "bench/README.md").write_text("# regenerated\n")
    (repo / "untracked.txt").write_text("scratch\n")
    assert git_state(repo) == state
    (repo / "README.md").write_text("# edited\n")
    assert git_state(repo) == {**state, "dirty": True}
    assert git_state(tmp_path / "elsewhere") == {"commit": None, "dirty": None}
