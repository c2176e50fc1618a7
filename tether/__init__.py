"""Tether, the application: what a user runs, on top of the services and the shared library.

``cli`` is the ``tether`` command (its verbs parse arguments, then import what they run);
``runs`` is a run seen from outside the services (the launcher and its supervisor, the torchrun
shims, status, progress, the HTML report, the cycle-time ``plan``); ``demo`` is ``tether demo``
(the arithmetic task, the tiny model, the warm-up and the demo's config).

Layers, checked by ``lint-imports`` (pyproject's [tool.importlinter]): ``tether.cli`` above the
benchmarks (``bench/``, which drive the launcher and the demo), above ``tether.demo`` and
``tether.runs``, above ``services/``, above ``common/``. Nothing below imports upward.
"""
