"""What every service process runs besides its loop, and what the launcher and the CLI share with
it: the preflight checks before anything expensive starts, the health endpoint and heartbeat
around the loop (``serve``), and the parent-death signal that stops a service with its launcher
(``supervision``)."""
