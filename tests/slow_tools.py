"""A calculator that takes half a second: with it a generator spends most of an episode's time
waiting for tools, so a SIGKILL lands mid-episode (``tests/e2e/test_e2e_episodes.py``)."""

from __future__ import annotations

import time

from common.tools.calculator import evaluate


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "123*4567" or "(2+3)/4".

    Args:
        expression: numbers with + - * / // % ** and parentheses.
    """
    time.sleep(0.5)
    return evaluate(expression)
