"""After a call the sandbox worker kills and reaps what the call left
(``common.tools.worker.Worker._kill_leftovers``); what it cannot reap within ``LEFTOVERS_S`` it
reports, and the worker then ends (taking its PID namespace with it). Run in a subprocess of
its own: reaping waits on any child, which in this process would include the suite's."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO

SCRIPT = """
import os, time
import common.tools.worker as w
w.LEFTOVERS_S = 0.3
worker = w.Worker({"limits": {}})
ready_r, ready_w = os.pipe()
call = os.fork()
if call == 0:
    os.setpgid(0, 0)  # a call's process group, as the worker's fork makes it
    if os.fork() == 0:  # and a child of the call's, in its group
        os.write(ready_w, b"x")  # both exist
    time.sleep(30)  # alive until killed (not a wait for anything)
    os._exit(0)
os.read(ready_r, 1)
print("reaped" if worker._kill_leftovers(call) else "left")
escaped = os.fork()
if escaped == 0:  # in the worker's own group: the call's kill does not reach it
    time.sleep(30)  # alive until killed
    os._exit(0)
t0 = time.monotonic()
print("reaped" if worker._kill_leftovers(call) else "left", round(time.monotonic() - t0, 1))
os.kill(escaped, 9)
"""


def test_what_a_call_left_is_reaped_and_what_cannot_be_is_reported_after_leftovers_s():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                         text=True, timeout=30, check=True).stdout.split()  # fmt: skip
    assert out[0] == "reaped"  # the call and its child, killed and reaped
    assert out[1] == "left" and 0.3 <= float(out[2]) < 5.0  # gave up after LEFTOVERS_S
