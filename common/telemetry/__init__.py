"""What a service tells the outside: Prometheus metrics (one registry helper and the phase
timer), the ``/metrics`` ``/healthz`` ``/readyz`` endpoint, the status heartbeat ``tether status``
reads, and the learner's experiment trackers (TensorBoard, W&B)."""
