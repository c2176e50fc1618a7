"""`tether config import`: a peer's launch script or YAML → Tether TOML (stdout) + mapping (stderr)."""

from __future__ import annotations

import argparse
import sys

from common.config.errors import ConfigError


def run_import(args: argparse.Namespace) -> int:
    from common.config.importers.render import render_mapping_table, render_toml
    from common.config.importers.translate import import_peer_config

    variables = {}
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--var {item!r} must look like NAME=VALUE (e.g. --var N_GPUS=8).")
        variables[name] = value
    try:
        result = import_peer_config(args.peer, args.path, variables=variables)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(render_mapping_table(result), file=sys.stderr)
    if result.problems:
        print(
            f"tether: cannot import {args.path}: {len(result.problems)} problem(s) listed above; no TOML written.",
            file=sys.stderr,
        )
        return 2
    print(render_toml(result))
    return 0
