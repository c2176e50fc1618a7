"""The ``tether`` command. Parses arguments first and imports heavy modules only inside the verb
that needs them, so ``tether --help`` and config errors are instant (exit code 2 for usage and
config errors, before any expensive start-up)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from common.config.errors import ConfigError
from common.config.schema import CYCLE_KEYS, DEPRECATED_ALIASES
from common.service.preflight import PreflightError

EXIT_USAGE = 2

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


def _add_config_args(p: argparse.ArgumentParser) -> None:
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


def load_from_args(args: argparse.Namespace):
    """Resolve the config from parsed arguments (raises ConfigError)."""
    from common.config.load import load_config

    flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    return load_config(config_file=args.config, overrides=args.set, flags=flags)


def _cmd_config_check(args: argparse.Namespace) -> int:
    loaded = load_from_args(args)
    cfg = loaded.config
    print(
        f"config OK: {cfg.run.prompts_per_cycle} prompts × {cfg.run.responses_per_prompt} responses × "
        f"{cfg.run.passes_per_cycle} pass(es) = {cfg.run.train_batch_size} × {cfg.run.train_steps_per_cycle} "
        f"optimizer step(s) per cycle; max_staleness {cfg.run.max_staleness}."
    )
    return 0


def _cmd_config_explain(args: argparse.Namespace) -> int:
    from common.config.explain import explain

    loaded = load_from_args(args)
    print(explain(loaded.config, sources=loaded.sources, warnings=loaded.warnings))
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    from common.config.explain import resolved_toml

    print(resolved_toml(load_from_args(args).config))
    return 0


def _cmd_config_import(args: argparse.Namespace) -> int:
    from common.config_import_cli import run_import

    return run_import(args)


def _cmd_service(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from common.config.explain import resolved_toml

        loaded = load_from_args(args)
        if args.dry_run:
            print(resolved_toml(loaded.config))
            return 0
        import importlib

        if name != "train":
            from common.service.supervision import stop_with_supervisor

            stop_with_supervisor()
        module = importlib.import_module(
            f"services.{name}.main" if name != "train" else "common.launcher"
        )
        return int(module.main(loaded.config, args) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="Tether: asynchronous actor-learner RL post-training for LLMs over Redis Streams.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")

    cfg = sub.add_parser("config", help="check, explain, show or import a configuration")
    cfg_sub = cfg.add_subparsers(dest="config_verb", metavar="ACTION", required=True)
    for action, fn, text in [
        ("check", _cmd_config_check, "exit 0 when the config is valid, 2 with the reasons"),
        ("explain", _cmd_config_explain, "walk one cycle in plain English"),
        ("show", _cmd_config_show, "print the fully resolved config as TOML"),
    ]:
        p = cfg_sub.add_parser(action, help=text, description=text)
        _add_config_args(p)
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
    imp.set_defaults(func=_cmd_config_import)

    for name, text in [
        ("train", "run a whole training job on this machine (launcher)"),
        ("generator", "run one generator service (vLLM sampling)"),
        ("scorer", "run one scorer service (math-verify / solver rewards)"),
        ("learner", "run the learner service (one rank; use torchrun for several)"),
    ]:
        p = sub.add_parser(name, help=text, description=text)
        _add_config_args(p)
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        if name == "train":
            p.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or crashed run")
        else:
            p.add_argument(
                "--id", dest="service_id", default=None, help="replica id (default: host-pid)"
            )
        p.set_defaults(func=_cmd_service(name))

    from common.cli_more import add_more_verbs

    add_more_verbs(sub, _add_config_args)
    from common.plan_cli import add_plan_verb

    add_plan_verb(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except PreflightError as exc:  # one paragraph: the setting or the row, and the fix
        text = " ".join(str(exc).splitlines())
        print(f"tether {args.verb}: cannot start: {text}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"tether: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
