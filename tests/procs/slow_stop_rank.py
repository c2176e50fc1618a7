"""A torchrun rank for tests/services/test_graceful_torchrun.py: says it started, and on SIGTERM
takes ``argv[2]`` seconds (a slow final checkpoint) before writing ``argv[1]`` and exiting with
``argv[3]`` (default 0), reported the way the ``tether`` CLI reports it
(``common.service.exit_codes.report``)."""

import signal
import sys
import time
from pathlib import Path

from common.service.exit_codes import report

out, stop_s = Path(sys.argv[1]), float(sys.argv[2])
code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
Path(str(out) + ".started").write_text("1")
while not stopping:
    time.sleep(0.05)
time.sleep(stop_s)
out.write_text("checkpoint")
report(code)
sys.exit(code)
