"""`tether config check|explain|show|import`."""

from __future__ import annotations

import argparse
import sys

from common.config.errors import ConfigError
from tether.cli.args import add_config_args, load_from_args


def _check(args: argparse.Namespace) -> int:
    cfg = load_from_args(args).config
    print(
        f"config OK: {cfg.run.prompts_per_cycle} prompts × {cfg.run.responses_per_prompt} responses × "
        f"{cfg.run.passes_per_cycle} pass(es) = {cfg.run.train_batch_size} × {cfg.run.train_steps_per_cycle} "
        f"optimizer step(s) per cycle; max_staleness {cfg.run.max_staleness}."
    )
    return 0


def _explain(args: argparse.Namespace) -> int:
    from common.config.explain import explain

    loaded = load_from_args(args)
    print(explain(loaded.config, sources=loaded.sources, warnings=loaded.warnings))
    return 0


def _show(args: argparse.Namespace) -> int:
    from common.config.explain import resolved_toml

    print(resolved_toml(load_from_args(args).config))
    return 0


def _import(args: argparse.Namespace) -> int:
    """A peer's launch script or YAML → Tether TOML (stdout) + mapping (stderr)."""
    from tether.config_import.render import render_mapping_table, render_toml
    from tether.config_import.translate import import_peer_config

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


def add_config_verbs(sub: argparse._SubParsersAction) -> None:
    cfg = sub.add_parser("config", help="check, explain, show or import a configuration")
    cfg_sub = cfg.add_subparsers(dest="config_verb", metavar="ACTION", required=True)
    for action, fn, text in [
        ("check", _check, "exit 0 when the config is valid, 2 with the reasons"),
        ("explain", _explain, "walk one cycle in plain English"),
        ("show", _show, "print the fully resolved config as TOML"),
    ]:
        p = cfg_sub.add_parser(action, help=text, description=text)
        add_config_args(p)
        p.set_defaults(func=fn)
    imp = cfg_sub.add_parser(
        "import",
        help="translate a peer's launch script or YAML into a Tether TOML",
        description="Reads a verl/OpenRLHF/slime/ROLL launch script or YAML; prints a Tether TOML on "
        "stdout and the key mapping on stderr; exit 2 when the peer's numbers do not divide evenly.",
    )
    imp.add_argument(
        "--from", dest="peer", required=True, choices=["verl", "openrlhf", "slime", "roll"]
    )
    imp.add_argument("path", help="launch script (.sh) or config (.yaml)")
    imp.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="value for a shell variable used by the script, e.g. --var N_GPUS=8",
    )
    imp.set_defaults(func=_import)
