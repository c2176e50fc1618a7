"""The built-in ``calculator`` tool: arithmetic parsed by an AST whitelist, never ``eval``.

Accepted: integer and decimal literals, ``+ - * / // % **``, unary ``+ -`` and parentheses.
Everything else (names, calls, attributes, subscripts, comprehensions, strings) is refused
before anything is computed. Sizes are bounded so a hostile expression cannot exhaust the
sandbox: the expression's length, every intermediate integer's size (``MAX_BITS``) and every
power's estimated size before it is computed (``9**9**9`` is refused, not attempted).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 500
MAX_BITS = 4096  # about 1,233 decimal digits

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """What the model is told when its expression cannot be computed."""


def _bits(x: Any) -> float:
    if isinstance(x, int):
        return x.bit_length()
    return math.log2(abs(x)) + 1 if x and math.isfinite(x) else 0.0


def _power(base: Any, exp: Any) -> Any:
    if isinstance(exp, int) and abs(exp) > MAX_BITS:
        raise CalculatorError(f"exponent {exp} is too large")
    if abs(base) > 1 and _bits(base) * abs(exp) > MAX_BITS:
        raise CalculatorError("the power's result is too large")
    return base**exp


def _checked(x: Any) -> Any:
    if isinstance(x, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(x, int) and x.bit_length() > MAX_BITS:
        raise CalculatorError("a number in the computation is too large")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    return x


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(
        f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses"
    )


def format_number(x: Any) -> str:
    """Integers exactly; floats with 12 significant digits (an integral float as an integer)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if isinstance(x, float):
        return format(x, ".12g")
    return str(x)


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text; ``CalculatorError`` naming what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return format_number(_value(tree))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "123*4567" or "(2+3)/4".

    Args:
        expression: numbers with + - * / // % ** and parentheses.
    """
    return evaluate(expression)
