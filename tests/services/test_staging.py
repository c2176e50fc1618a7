"""Staging the model and the data onto a models volume (``common.data.staging``), with real files,
a real HTTP server and the module run as the staging Job runs it: staged once, restaged when the
source changes (a changed modelId is never silently kept), a failed fetch leaves the previous
copy in place, unusable sources refused with the fix, and ``wait`` returning only for the
requested sources. (Hugging Face Hub downloads cannot run here: no network.)"""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.data import staging
from tests.paths import REPO


def _model(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(f'{{"tag": "{tag}"}}')
    (folder / "model.safetensors").write_bytes(tag.encode() * 100)
    return folder


@pytest.fixture
def http_dir(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_model_is_staged_once_and_restaged_when_its_id_changes(tmp_path):
    a, b = _model(tmp_path / "src-a", "a"), _model(tmp_path / "src-b", "b")
    dest = tmp_path / "models" / "policy"
    assert staging.stage_model(str(a), dest)
    assert (dest / "config.json").read_text() == '{"tag": "a"}'
    assert staging.marker(dest)["source"] == str(a)
    assert not staging.stage_model(str(a), dest)  # same source: nothing to do
    assert staging.stage_model(str(b), dest)  # modelId changed: restaged
    assert (dest / "config.json").read_text() == '{"tag": "b"}'
    # no partial/old left; the stagers' lock file stays
    assert sorted(p.name for p in dest.parent.iterdir()) == [".policy.lock", "policy"]
    with pytest.raises(staging.StagingRefused, match="no config.json"):
        staging.stage_model(str(tmp_path / "not-a-model"), dest)
    assert (dest / "config.json").read_text() == '{"tag": "b"}'  # the previous copy stays


def test_a_second_stager_waits_for_the_first_and_stages_nothing(tmp_path, monkeypatch):
    """Two stagers of one destination (two test workers; a Job's retry beside its first pod):
    the second found nothing staged, then waits for the lock the first holds (its check again
    does not come while the first stages), and stages nothing after."""
    src, dest = _model(tmp_path / "src", "a"), tmp_path / "models" / "policy"
    checks = [threading.Event(), threading.Event()]  # the second stager's two is_staged checks
    is_staged = staging.is_staged

    def watched(*args, **kwargs):
        if threading.current_thread().name == "second":
            next(e for e in checks if not e.is_set()).set()
        return is_staged(*args, **kwargs)

    monkeypatch.setattr(staging, "is_staged", watched)
    staged_again: list[bool] = []
    second = threading.Thread(name="second", daemon=True,
                              target=lambda: staged_again.append(staging.stage_model(str(src), dest)))  # fmt: skip
    with staging._one_stager(dest):  # the first stager, holding the lock
        second.start()
        assert checks[0].wait(30)  # the second found nothing staged
        # without the lock its second check (then its own staging) follows at once
        assert not checks[1].wait(1.0), "the second stager did not wait for the lock"
        assert staging._stage_model(str(src), dest, revision="", gguf=None, path=None, say=print)
    second.join(30)
    assert checks[1].is_set() and staged_again == [False]
    assert staging.marker(dest)["source"] == str(src)


def test_data_from_a_url_or_a_path_and_the_sources_refused(tmp_path, http_dir):
    served, base = http_dir
    (served / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    dest = tmp_path / "models" / "data"
    assert staging.stage_data(f"{base}/train.jsonl", dest)
    assert (dest / "train.jsonl").read_text().startswith('{"prompt"')
    assert not staging.stage_data(f"{base}/train.jsonl", dest)
    (served / "v2.jsonl").write_text('{"prompt": "2+2", "answer": "4"}\n')
    assert staging.stage_data(f"{base}/v2.jsonl", dest)
    assert [p.name for p in dest.iterdir() if p.name != staging.MARKER] == ["v2.jsonl"]
    with pytest.raises(OSError):  # a failed download: the staged data stays
        staging.stage_data(f"{base}/missing.jsonl", dest)
    assert (dest / "v2.jsonl").exists()
    local = tmp_path / "local.jsonl"
    local.write_text("{}\n")
    assert staging.stage_data(str(local), dest) and (dest / "local.jsonl").exists()
    assert not staging.stage_data("", dest)  # no data source: nothing staged
    for bad, why in (("s3://bucket/train.jsonl", "presigned https"),
                     ("hf://org/name", "hf://datasets/"),
                     ("/nowhere/train.jsonl", "neither an existing path")):  # fmt: skip
        with pytest.raises(staging.StagingRefused, match=why):
            staging.stage_data(bad, dest)


def test_the_staging_job_command_and_the_init_containers_wait(tmp_path, http_dir):
    served, base = http_dir
    (served / "train.jsonl").write_text("{}\n")
    model = _model(tmp_path / "src", "m")
    root = tmp_path / "models"

    def run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "common.data.staging", *args, "--root",
                               str(root)], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip

    want = ("--model-id", str(model), "--data-source", f"{base}/train.jsonl")
    waited = run("wait", *want, "--timeout-s", "1", "--every-s", "0.2")
    assert waited.returncode == 1 and "waiting for the model" in waited.stdout
    staged = run("stage", *want)
    assert staged.returncode == 0, staged.stderr
    assert "model: staged" in staged.stdout and "data: staged" in staged.stdout
    assert run("wait", *want, "--timeout-s", "5").returncode == 0
    other = run("wait", "--model-id", "org/another", "--timeout-s", "1", "--every-s", "0.2")
    assert other.returncode == 1 and "org/another" in other.stdout  # a changed modelId waits
    refused = run("stage", "--model-id", str(model), "--data-source", "gs://b/x.jsonl")
    assert refused.returncode == 2 and "presigned https" in refused.stderr
