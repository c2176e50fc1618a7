"""The ``tether`` command (``python -m tether.cli``; entry ``tether.cli.main:main``).

``main`` builds the parser from the verb modules, each of which imports its heavy modules only
inside the verb that needs them, so ``tether --help`` and config errors are instant: ``args``
(the configuration flags every verb shares), ``config_verbs`` (config check, explain, show,
import), ``run_verbs`` (train and the three services), ``observe_verbs`` (status, report, bus
inspect), ``tool_verbs`` (demo, export, bench), ``plan_verb`` and ``stage_verb`` (stage model).
No verb module imports another, and nothing outside this package imports it.
"""
