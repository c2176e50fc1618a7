"""What Tether's processes agree on, and nothing else: bus messages (``wire``), stream, group
and key names (``streams``), the staleness rule (``staleness``) and the run directory's layout
(``run_dir``). Imports nothing of Tether's (an import contract checks it)."""
