"""Entry of `tether learner` (one rank; run several with torchrun — rank 0 talks to Redis).

Health: rank 0 serves ``/metrics``, ``/healthz`` and ``/readyz`` on ``learner.metrics_port``;
the first rank of every other node (``LOCAL_RANK`` 0: one per pod) serves the same endpoints on
the same port, its ``/healthz`` its own loop's heartbeat (the other ranks hear rank 0 every
``learner.keepalive_s``), so every learner pod's probe checks a rank that is really there.

Exit codes (``common.service.exit_codes``): 0 when the run is finished; 75 when it was asked to
stop (SIGTERM/SIGINT) before its end and checkpointed, so a restart resumes; 2 when it cannot go
on (``LostCycle``; ``DiskFull``: a checkpoint found no room) or the preflight refused its
configuration or data."""

from __future__ import annotations

import logging
import os
import signal
import sys

from common.config.schema import TetherConfig
from common.protocol import streams
from common.protocol.run_dir import RunDir
from common.service import process_exit
from common.service.exit_codes import EXIT_REFUSED, EXIT_STOPPED
from common.service.preflight import preflight
from common.service.settings import bus_settings_for, policy_paths, tracker_settings
from common.telemetry.exposition import identity
from common.telemetry.health import HealthServer
from common.telemetry.heartbeat import StatusReporter
from services.learner.bus_side import BusSide, LostCycle
from services.learner.checkpoint_disk import DiskFull
from services.learner.loop import LearnerService
from services.learner.settings import LearnerSettings, TrainingSettings

log = logging.getLogger(__name__)


def learner_settings(cfg: TetherConfig) -> LearnerSettings:
    """The learner's settings from the run's config (the cycle rules already applied): its
    sections, the bus, the trackers, and the policy's directories (checked on disk)."""
    model_dir, tokenizer_dir = policy_paths(cfg)
    return LearnerSettings(
        run=cfg.run,
        weights=cfg.weights,
        bus=bus_settings_for(cfg),
        trackers=tracker_settings(cfg),
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        training=training_settings(cfg),
        generators=cfg.generator.replicas,
        shuffle=cfg.data.shuffle,
    )


def training_settings(cfg: TetherConfig) -> TrainingSettings:
    """What a cycle's math reads, from the run's config (no path or server is checked: the
    learner's unit tests and the learner benchmarks build it without a bus)."""
    return TrainingSettings(
        learner=cfg.learner,
        train_steps_per_cycle=cfg.run.train_steps_per_cycle,
        passes_per_cycle=cfg.run.passes_per_cycle,
        behaviour_temperature=cfg.behaviour_temperature,
    )


def main(cfg: TetherConfig, args) -> int:
    # gloo's worker threads may still drop a collective's tensors as the process ends
    process_exit.skip_finalization("the learner's gloo process groups")
    # trackers, model, tokenizer, every dataset row, Redis: exit 2 before the model loads
    checked = preflight(cfg, "learner")

    run_dir = RunDir.of(cfg.run).root
    run_dir.mkdir(parents=True, exist_ok=True)
    svc = LearnerService(learner_settings(cfg), run_dir=run_dir, datasets=checked.datasets)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: svc.stop())
    rank = int(os.environ.get("RANK", "0"))
    health = status = None
    try:
        svc.setup_io_first()  # rank 0: Redis and the weight store, with the preflight's data
        svc.bus_side.check_server()  # rank 0: an evicting maxmemory-policy, exit 2 before the model
        # every series labelled run, kind, replica (rank 0 is the learner's consumer name)
        replica = streams.LEARNER_CONSUMER if rank == 0 else f"learner-rank{rank}"
        labels = identity(run=cfg.run.name, kind="learner", replica=replica)
        if rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0":
            health = HealthServer(
                cfg.learner.metrics_port, ready=lambda: svc.ready, live=svc.live, identity=labels
            ).start()
        if isinstance(svc.bus_side, BusSide):  # rank 0
            assert health is not None
            status = StatusReporter(
                svc.bus_side.bus,
                "learner",
                streams.LEARNER_CONSUMER,
                svc.timer,
                svc.status,
                metrics_port=health.port,
            ).start()
        svc.run()
    except (LostCycle, DiskFull) as exc:  # one paragraph, as a refused start (the launcher
        # quotes it); a restart would not help: it stops the run, which resumes once fixed
        print(f"tether learner: cannot go on: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        if status is not None:
            status.stop()
        if health is not None:
            health.stop()
    if not svc.finished:  # asked to stop: checkpointed, a restart resumes
        log.info(
            "learner rank %d stopped at policy version %d before the run's end (cycle %d of %d); "
            "exit code %d: a restart resumes from the checkpoint",
            rank, svc.version, svc.next_cycle, cfg.run.num_cycles, EXIT_STOPPED,
        )  # fmt: skip
        return EXIT_STOPPED
    log.info("learner rank %d finished the run at policy version %d", rank, svc.version)
    return 0
