"""The bus's Prometheus metrics (labels: stream, group, reason), one set per process."""

from __future__ import annotations

from common.telemetry.metrics import metric

SG = ("stream", "group")


class BusMetrics:
    """Made through ``common.telemetry.metrics.metric``: every ``Bus`` in a process shares them."""

    def __init__(self) -> None:
        self.published = metric(
            "Counter", "tether_bus_published_messages_total", "Messages published", ["stream"]
        )
        self.published_bytes = metric(
            "Counter", "tether_bus_published_bytes_total", "Bytes published", ["stream"]
        )
        self.consumed = metric(
            "Counter", "tether_bus_consumed_messages_total", "Messages consumed", SG
        )
        self.consumed_bytes = metric(
            "Counter", "tether_bus_consumed_bytes_total", "Bytes consumed", SG
        )
        self.lag = metric(
            "Gauge", "tether_bus_lag_messages", "Entries not yet delivered to the group", SG
        )
        self.pending = metric(
            "Gauge", "tether_bus_pending_messages", "Delivered, not yet acked", SG
        )
        self.claimed = metric(
            "Counter", "tether_bus_claimed_messages_total", "Entries taken over by XAUTOCLAIM", SG
        )
        self.strikes = metric(
            "Counter",
            "tether_bus_strikes_total",
            "Entries delivered again while still in hand: their consumer failed holding them",
            SG,
        )
        self.dead = metric(
            "Counter", "tether_bus_dead_letters_total", "Entries dead-lettered", [*SG, "reason"]
        )
        self.duplicates = metric(
            "Counter", "tether_bus_duplicates_skipped_total", "Deduplicated publishes", SG
        )
        self.reconnects = metric(
            "Counter", "tether_bus_reconnects_total", "Reconnects after connection loss"
        )
        self.oom_waiting = metric(
            "Gauge",
            "tether_bus_oom_waiting",
            "1 while this process waits for Redis to have memory for a write (maxmemory reached)",
        )
        self.oom_wait_seconds = metric(
            "Counter",
            "tether_bus_oom_wait_seconds_total",
            "Seconds spent waiting for Redis memory (writes refused at maxmemory)",
        )
        self.redis_used = metric(
            "Gauge",
            "tether_bus_redis_used_memory_bytes",
            "Memory Redis uses (INFO memory; read by the learner every few seconds)",
        )
        self.redis_max = metric(
            "Gauge",
            "tether_bus_redis_maxmemory_bytes",
            "Redis maxmemory (0 = no limit)",
        )
        self.recreated = metric(
            "Counter",
            "tether_bus_recreated_total",
            "Consumer groups found missing and recreated",
            SG,
        )
        self.backpressure_seconds = metric(
            "Counter",
            "tether_bus_backpressure_wait_seconds_total",
            "Seconds producers waited for capacity",
            SG,
        )
