"""An adapter-only update: a LoRA adapter's tensors and its config in one ordinary publish.

With ``learner.lora_rank > 0`` the learner publishes only its adapter: the tensors under PEFT's
file names (``base_model.model.<module>.lora_A.weight``) plus one ``uint8`` tensor named
``ADAPTER_CONFIG`` holding its ``adapter_config.json``. They go down the same chain as a full
update, with the same version, checksum (which covers the config's bytes too) and deadline; only
the bytes differ (megabytes instead of the model). A receiver tells the two kinds apart by that
one name (``split_adapter``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from common.weights.layout import WeightSyncError

ADAPTER_CONFIG = "adapter_config.json"  # never a weight name: HF names end in .weight / .bias


def adapter_update(tensors: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The named tensors of one adapter publish: ``tensors`` plus the config as a tensor."""
    import torch

    if ADAPTER_CONFIG in tensors:
        raise ValueError(f"an adapter tensor may not be named {ADAPTER_CONFIG!r}")
    raw = json.dumps(dict(config), sort_keys=True).encode()
    return {**tensors, ADAPTER_CONFIG: torch.frombuffer(bytearray(raw), dtype=torch.uint8)}


def split_adapter(named: Iterable[tuple[str, Any]]) -> tuple[dict[str, Any] | None, list]:
    """``(adapter config, the other tensors)`` of a received update; the config is None for a
    full-weights update. ``WeightSyncError`` when the config tensor is not valid JSON."""
    config, rest = None, []
    for name, t in named:
        if name != ADAPTER_CONFIG:
            rest.append((name, t))
            continue
        try:
            config = json.loads(bytes(t.cpu().numpy().tobytes()).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise WeightSyncError(f"the update's {ADAPTER_CONFIG} is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise WeightSyncError(f"the update's {ADAPTER_CONFIG} is not a JSON object")
    return config, rest
