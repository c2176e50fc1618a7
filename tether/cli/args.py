"""The configuration arguments every verb that reads a config shares, and how they become a
``TetherConfig`` (precedence: defaults < --config < TETHER_* env < flags < --set)."""

from __future__ import annotations

import argparse
from typing import Any

from common.config.schema import CYCLE_KEYS, DEPRECATED_ALIASES

# Flags that set a config key directly: flag name -> dotted key.
CONFIG_FLAGS: dict[str, str] = {k.replace("_", "-"): f"run.{k}" for k in CYCLE_KEYS}
CONFIG_FLAGS.update({old.replace("_", "-"): f"run.{old}" for old in DEPRECATED_ALIASES})
CONFIG_FLAGS.update(
    {
        "name": "run.name",
        "run-dir": "run.run_dir",
        "model": "run.model",
        "seed": "run.seed",
        "redis-url": "run.redis_url",
        "generators": "generator.replicas",
        "scorers": "scorer.replicas",
    }
)
_INT_FLAGS = set(CYCLE_KEYS) | set(DEPRECATED_ALIASES) | {"seed", "generators", "scorers"}


def add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "configuration (precedence: defaults < --config < TETHER_* env < flags < --set)"
    )
    g.add_argument("--config", metavar="FILE", help="TOML config file")
    g.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="set any config key, e.g. --set learner.lr=1e-6 (repeatable)",
    )
    for flag, dotted in CONFIG_FLAGS.items():
        key = dotted.split(".", 1)[1]
        deprecated = key in DEPRECATED_ALIASES
        kind = int if key.replace("-", "_") in _INT_FLAGS or flag in _INT_FLAGS else str
        help_text = argparse.SUPPRESS if deprecated else f"{dotted} (see `tether config explain`)"
        g.add_argument(
            f"--{flag}",
            dest=f"cfg:{dotted}",
            type=kind,
            default=None,
            metavar="N" if kind is int else "VALUE",
            help=help_text,
        )


def config_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set by flags: ``{"run.prompts_per_cycle": 30, ...}``."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}


def load_from_args(args: argparse.Namespace) -> Any:
    """Resolve the config from parsed arguments: a ``Loaded`` (raises ConfigError)."""
    from common.config.load import load_config

    return load_config(config_file=args.config, overrides=args.set, flags=config_flags(args))
