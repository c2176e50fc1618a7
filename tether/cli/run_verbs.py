"""`tether train` (the launcher: every service on this machine) and `tether learner|generator|
scorer` (one service in this process). ``--dry-run`` prints the resolved config and exits."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tether.cli.args import add_config_args, load_from_args


def _run(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from common.config.explain import resolved_toml

        cfg = load_from_args(args).config
        if args.dry_run:
            print(resolved_toml(cfg))
            return 0
        if name == "train":
            from tether.runs.launcher import train

            return train(cfg, args)
        from common.service.supervision import stop_with_supervisor
        from tether.runs.launcher import run_service

        stop_with_supervisor()
        return run_service(name, cfg, args)

    return run


def add_run_verbs(sub: argparse._SubParsersAction) -> None:
    for name, text in [
        ("train", "run a whole training job on this machine (launcher)"),
        ("generator", "run one generator service (vLLM sampling)"),
        ("scorer", "run one scorer service (math-verify / solver rewards)"),
        ("learner", "run the learner service (one rank; use torchrun for several)"),
    ]:
        p = sub.add_parser(name, help=text, description=text)
        add_config_args(p)
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        if name == "train":
            p.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped or crashed run")
        else:
            p.add_argument(
                "--id", dest="service_id", default=None, help="replica id (default: host-pid)"
            )
        p.set_defaults(func=_run(name))
