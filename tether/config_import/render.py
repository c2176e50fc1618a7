"""An ``ImportResult`` as a Tether TOML (stdout) and as a mapping table (stderr)."""

from __future__ import annotations

import json
from typing import Any

from common.config.schema import CYCLE_KEYS
from tether.config_import.result import ImportResult

_ORDER = {
    "run": ["name", "seed", "model", *CYCLE_KEYS, "max_prompt_tokens", "max_response_tokens"],
    "data": ["train_path", "eval_path", "prompt_key", "answer_key", "overlong_prompt_policy"],
    "generator": [
        "replicas",
        "gpus_per_replica",
        "tensor_parallel_size",
        "temperature",
        "top_p",
        "top_k",
        "gpu_memory_utilization",
        "eval_temperature",
    ],
    "scorer": ["mode", "solver_model"],
    "learner": [
        "nnodes",
        "nproc_per_node",
        "lr",
        "weight_decay",
        "warmup_steps",
        "warmup_ratio",
        "lr_schedule",
        "min_lr_ratio",
        "grad_clip",
        "micro_batch_size",
        "max_tokens_per_micro_batch",
        "gradient_checkpointing",
        "advantage_estimator",
        "norm_adv_by_std",
        "std_estimator",
        "clip_low",
        "clip_high",
        "dual_clip",
        "loss_agg",
        "entropy_coef",
        "kl_coef",
        "kl_type",
        "kl_in_reward",
        "kl_clamp",
        "eval_every_steps",
        "checkpoint_every_steps",
    ],
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # Python's float repr (1e-06, inf, nan) is valid TOML
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def render_toml(result: ImportResult) -> str:
    """The mapped settings as a Tether TOML file, with a header saying where they came from."""
    lines = [
        f"# Tether config imported from {result.peer}: {result.source}",
        "# by `tether config import`; the mapping table lists what was not mapped and why.",
    ]
    lines += [f"# PROBLEM: {p.message}" for p in result.problems]
    if result.unknown_variables:
        lines.append(
            "# unknown variables (their settings were not mapped): "
            + ", ".join(result.unknown_variables)
        )
    for section in _ORDER:
        values = {k: v for k, v in result.tether.get(section, {}).items() if v is not None}
        if not values:
            continue
        keys = [k for k in _ORDER[section] if k in values] + [
            k for k in values if k not in _ORDER[section]
        ]
        lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(values[k])}" for k in keys]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def render_mapping_table(result: ImportResult) -> str:
    """Plain text: each peer key and value → the Tether key and value, with a note; then the rest."""
    lines = [
        f"{result.peer} → Tether ({result.source})",
        "Mapped (peer key = value → Tether key = value):",
    ]
    for r in result.mapping:
        note = f"   ({r.note})" if r.note else ""
        lines.append(f"  {r.peer_key} = {_cell(r.peer_value)}" if r.peer_key else "  (no peer key)")
        lines.append(f"      → {r.tether_key} = {_cell(r.tether_value)}{note}")
    if result.unmapped:
        lines += ["", "Not mapped:"] + [
            f"  {k} = {_cell(v)}: {why}" for k, v, why in result.unmapped
        ]
    if result.unknown_variables:
        lines += [
            "",
            "Unknown variables (give their values to map the settings that use them): "
            + ", ".join(result.unknown_variables),
        ]
    if result.problems:
        lines += ["", "Problems:"] + [f"  - {p.message}" for p in result.problems]
    return "\n".join(lines) + "\n"
