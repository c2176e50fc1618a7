"""A bus consumer in its own process, for SIGKILL tests.

Reads ``in`` in batches, sets ``<run>:started:<name>`` after taking its first batch, "works" for
``--work-s`` seconds per batch, then commits each prompt id downstream to ``out`` exactly once.
"""

from __future__ import annotations

import argparse
import time

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.settings import BusSettings
from common.protocol.wire import PromptMsg


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--claim-idle-ms", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--work-s", type=float, default=0.0)
    p.add_argument("--exit-after-idle-s", type=float, default=3.0)
    a = p.parse_args()
    settings = BusSettings(url=a.url, run=a.run, block_ms=200, socket_timeout_s=5,
                           claim_idle_ms=a.claim_idle_ms)  # fmt: skip
    bus = Bus(settings, service="test-consumer")
    consumer = Consumer(bus, "in", "workers", a.name)
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < a.exit_after_idle_s:
        batch = consumer.read(a.batch)
        if not batch:
            continue
        bus.set(f"started:{a.name}", len(batch))
        time.sleep(a.work_s)
        out = [("out", PromptMsg(prompt_id=d.msg.prompt_id, cycle=0, index=0, text=a.name))
               for d in batch]  # fmt: skip
        consumer.commit(batch, publish=out, dedupe_ids=[d.msg.prompt_id for d in batch])
        idle_since = time.monotonic()


if __name__ == "__main__":
    main()
