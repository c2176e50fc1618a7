"""The ``tether`` command. Parses arguments first and imports heavy modules only inside the verb
that needs them, so ``tether --help`` and config errors are instant (exit code 2 for usage and
config errors, before any expensive start-up)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from common.config.errors import ConfigError
from common.service import exit_codes, process_exit
from common.service.preflight import PreflightError
from tether.cli.config_verbs import add_config_verbs
from tether.cli.observe_verbs import add_observe_verbs
from tether.cli.plan_verb import add_plan_verb
from tether.cli.run_verbs import add_run_verbs
from tether.cli.stage_verb import add_stage_verb
from tether.cli.tool_verbs import add_tool_verbs

EXIT_USAGE = exit_codes.EXIT_REFUSED

EPILOG = """\
verbs by what they do:
  configure   config check | explain | show | import
  run         train (everything on this machine), learner, generator, scorer
  observe     status, report, bus inspect
  tools       demo (the embedded default), export (a Hugging Face model directory),
              plan (cycle time of a cluster shape), bench (from a clone of the repository),
              stage model (a packaged GGUF model, a .gguf file or a Hub id into a directory)

`tether VERB --help` lists a verb's options; every verb that reads a config takes --config,
TETHER_<SECTION>__<KEY> variables, flags and --set (see the README's config reference)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="Tether: asynchronous actor-learner RL post-training for LLMs over Redis Streams.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    add_config_verbs(sub)
    add_run_verbs(sub)
    add_observe_verbs(sub)
    add_tool_verbs(sub)
    add_plan_verb(sub)
    add_stage_verb(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; its exit code is also reported to ``graceful_torchrun`` when this process
    is one of its ranks (``common.service.exit_codes``), since torchrun's own code is 1. A verb
    that ran gloo process groups (the learner) ends here, without interpreter finalization
    (``common.service.process_exit``)."""
    code = 1  # an exception on its way out
    try:
        code = _main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        exit_codes.report(code)
    return process_exit.end(code)


def _main(argv: Sequence[str] | None) -> int:
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
