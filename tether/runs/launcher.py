"""The launcher: the one door from ``common/`` into ``services/`` (an import contract checks it).

`tether train` runs a whole job on one machine as supervised subprocesses: the embedded
Redis-protocol server (unless ``run.redis_url``), the learner (``torchrun`` when
``learner.nproc_per_node > 1``), ``generator.replicas`` generators and ``scorer.replicas``
scorers, each with its own log file in ``<run dir>/logs/`` (``supervisor.py``: restarts with
back-off, stops on too many crashes). Ctrl-C / SIGTERM: the learner stops first (it finishes its
step and checkpoints), then generators and scorers; the status snapshot and the report are
written while Redis still runs; Redis last.

`tether learner|generator|scorer` run one service's entry in this process (``run_service``) and
`tether export` the learner's checkpoint export (``export_checkpoint``).
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import Any

from common.config.schema import TetherConfig
from common.protocol.run_dir import RunDir
from tether.runs.supervisor import RunFailed, Supervisor
from services.learner.export import export_hf
from common.config.explain import resolved_toml
from common.service.preflight import preflight
from common.config.errors import ConfigError
from common.config.load import load_config
from tether.runs.progress import Progress
from common.bus.server import EmbeddedRedis
from tether.runs.report.page import write_report

log = logging.getLogger(__name__)


def run_service(name: str, cfg: TetherConfig, args: argparse.Namespace) -> int:
    """Run service ``name``'s entry (``services/<name>/main.py``) here; returns its exit code."""
    if name == "learner":
        from services.learner.main import main
    elif name == "generator":
        from services.generator.main import main
    elif name == "scorer":
        from services.scorer.main import main
    else:
        raise ValueError(f"unknown service {name!r}: learner, generator or scorer")
    return int(main(cfg, args) or 0)


def export_checkpoint(
    checkpoint: str, out: str, *, tokenizer_dir: str | None, shard_mb: float = 2048.0
) -> Path | None:
    """`tether export`: a Hugging Face model directory from a checkpoint (the learner's code)."""
    if shard_mb <= 0:
        raise ValueError(f"--shard-mb must be > 0 (MB per weight file), got {shard_mb}")
    return export_hf(checkpoint, out, tokenizer_dir=tokenizer_dir,
                     shard_bytes=int(shard_mb * 2**20))  # fmt: skip


def prepare_run_dir(cfg: TetherConfig, resume: str | None) -> tuple[TetherConfig, Path]:
    """The config to run (with --resume, the one saved in the run directory), checked by the
    preflight before anything is created or started, and its run directory, with the resolved
    config written once (reused by --resume)."""
    if resume:
        run_dir = RunDir(Path(resume))
        if not run_dir.config.exists():
            raise ConfigError(
                f"--resume {resume}: no config.toml there; is it a Tether run directory (runs/<name>)?"
            )
        cfg = load_config(config_file=run_dir.config).config
        preflight(cfg, "train")
        return cfg, run_dir.root
    preflight(cfg, "train")
    run_dir = RunDir.of(cfg.run)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    run_dir.config.write_text(resolved_toml(cfg))
    return cfg, run_dir.root


def train(cfg: TetherConfig, args: argparse.Namespace) -> int:
    """`tether train [--resume RUN_DIR]`."""
    cfg, run_dir = prepare_run_dir(cfg, getattr(args, "resume", None))
    return launch(cfg, run_dir, progress_factory=Progress)


def launch(cfg: TetherConfig, run_dir: Path, *, progress_factory: Any = None) -> int:
    paths = RunDir(run_dir)
    redis = None
    url = cfg.run.redis_url
    if not url:
        redis = EmbeddedRedis(paths.redis, binary=cfg.run.redis_server_binary or None)
        redis.start()
        url = redis.url
        log.info("embedded Redis-protocol server at %s (data in %s)", url, paths.redis)
    progress = progress_factory(cfg, url) if progress_factory else None
    sup = Supervisor(cfg, run_dir, redis_url=url, config_path=paths.config, progress=progress)
    stop = {"asked": False}

    def on_signal(*_: Any) -> None:
        stop["asked"] = True
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        code = sup.run()
    except KeyboardInterrupt:
        log.info("stopping: learner first (final checkpoint), then generators and scorers")
        code = 130
    except RunFailed as exc:
        log.error("%s", exc)
        code = exc.exit_code
    finally:
        sup.shutdown()
        if progress is not None:
            progress.final()
        _finish(cfg, run_dir, url, progress)
        if redis is not None:
            redis.stop()
        signal.signal(signal.SIGTERM, old)
    return code


def finish_run(run_dir: str | Path, bus: Any) -> Path | None:
    """After the services stopped and before Redis stops: save the status snapshot and write
    ``report.html``. Best effort: a failure is logged, never raised, so a finished run is not
    turned into a failed one by its report. Returns the report's path."""
    from tether.runs.status import collect_status, save_status_snapshot

    try:
        save_status_snapshot(run_dir, collect_status(bus))
    except Exception as exc:  # Redis gone or a service wrote an odd heartbeat: report without it
        log.warning("could not save the status snapshot in %s: %s", run_dir, exc)
    try:
        path = write_report(run_dir)
    except Exception as exc:
        log.warning(
            "could not write the run report in %s: %s (retry: tether report %s)",
            run_dir,
            exc,
            run_dir,
        )
        return None
    log.info("run report: %s", path)
    return path


def _finish(cfg: TetherConfig, run_dir: Path, url: str, progress: Any) -> None:
    """Status snapshot + HTML report in the run directory (best effort: never raises)."""
    try:
        if progress is not None:
            bus = progress.bus
        else:
            from common.bus.client import Bus
            from common.service.settings import bus_settings_for

            bus = Bus(bus_settings_for(cfg, redis_url=url), service="launcher")
        report = finish_run(run_dir, bus)
        if report is not None:
            log.info("report: %s", report)
    except Exception as exc:  # the run itself is over; a report problem must not change its result
        log.warning("could not write the status snapshot/report: %s", exc)
