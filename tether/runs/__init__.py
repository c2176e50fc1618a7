"""A run as a whole, seen from outside the services: the launcher and its supervisor (`tether
train`; the one door into ``services/``), the torchrun shim (``supervised``), a run's status,
live progress and report, and ``plan`` (cycle time of a cluster shape on paper)."""
