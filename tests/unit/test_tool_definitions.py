"""Tools as typed functions: schemas from signatures and docstrings, argument checks, the
calculator's AST whitelist, and tool names resolved from ``generator.tools``."""

from __future__ import annotations

from typing import Literal

import pytest

from common.tools.calculator import CalculatorError, calculator, evaluate
from common.tools.functions import (
    ToolArgumentError,
    ToolDefinitionError,
    check_arguments,
    spec_from_function,
    specs_from_class,
)
from common.tools.registry import resolve_tools


def lookup(city: str, units: Literal["c", "f"] = "c", days: list[int] | None = None) -> str:
    """Look up the weather.

    More text that is not the description's first paragraph.

    Args:
        city: the city's name,
            as the user wrote it.
        units: degrees Celsius or Fahrenheit.
        days: which days ahead.

    Returns:
        a forecast.
    """
    return city


class Notebook:
    def write(self, text: str) -> str:
        """Write a line.

        Args:
            text: the line.
        """
        return text

    def count(self) -> int:
        """How many lines there are."""
        return 0

    def _private(self) -> None:
        pass


def test_schema_from_signature_and_docstring():
    spec = spec_from_function(lookup, target="tests:lookup")
    assert spec.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name, as the user wrote it."},
                    "units": {"type": "string", "enum": ["c", "f"],
                              "description": "degrees Celsius or Fahrenheit."},
                    "days": {"type": "array", "items": {"type": "integer"},
                             "description": "which days ahead."},
                },
                "required": ["city"],
            },
        },
    }  # fmt: skip


def test_a_class_gives_one_tool_per_public_method():
    specs = specs_from_class(Notebook, target="tests:Notebook")
    assert sorted(s.name for s in specs) == ["count", "write"]
    write = next(s for s in specs if s.name == "write")
    assert write.method == "write" and write.parameters["required"] == ["text"]
    assert "self" not in write.parameters["properties"]


def _no_doc(x: int) -> int:
    return x


def _no_hint(x) -> int:  # type: ignore[no-untyped-def]
    """Doc."""
    return x


def _star(*xs: int) -> int:
    """Doc."""
    return 0


@pytest.mark.parametrize(
    ("fn", "words"),
    [(_no_doc, "no docstring"), (_no_hint, "no type hint"), (_star, r"\*args")],
)
def test_tools_the_model_could_not_call_are_refused_by_name(fn, words):
    with pytest.raises(ToolDefinitionError, match=words) as e:
        spec_from_function(fn, target="t:f")
    assert fn.__name__ in str(e.value)


def test_arguments_are_checked_against_the_schema():
    spec = spec_from_function(lookup, target="t:lookup")
    assert check_arguments(spec, {"city": "Oslo"}) == {"city": "Oslo"}
    assert check_arguments(spec, {"city": "Oslo", "days": None}) == {"city": "Oslo", "days": None}
    for bad, words in [
        ({"units": "c"}, "missing required"),
        ({"city": "Oslo", "town": 1}, "unknown argument"),
        ({"city": 3}, "'city' must be string"),
        ({"city": "Oslo", "units": "k"}, "must be"),
        ({"city": "Oslo", "days": [1, "2"]}, "'days' must be array"),
        (["Oslo"], "must be a JSON object"),
    ]:
        with pytest.raises(ToolArgumentError, match=words):
            check_arguments(spec, bad)


@pytest.mark.parametrize(
    ("expression", "value"),
    [("123*4567", "561741"), ("(2+3)/4", "1.25"), ("-7//2", "-4"), ("2**10", "1024"),
     ("10/4*2", "5"), ("7 % 3", "1"), ("1/3", "0.333333333333")],
)  # fmt: skip
def test_calculator_computes_exactly(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("__import__('os').system('id')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).__class__", "Attribute is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("9**9**9", "too large"),
        ("2**5000", "too large"),
        ("10**400 * 10**400 * 10**400 * 10**400", "too large"),
        ("1/0", "division by zero"),
        ("1e308*10", "not a finite number"),
        ("(-8)**0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, words):
    with pytest.raises(CalculatorError, match=words):
        evaluate(expression)


def test_generator_tools_entries_resolve(tmp_path):
    tool_file = tmp_path / "my_tools.py"
    tool_file.write_text(
        "def shout(text: str) -> str:\n"
        '    """Shout it.\n\n    Args:\n        text: what to shout.\n    """\n'
        "    return text.upper()\n"
    )
    specs = resolve_tools(["calculator", "python", f"{tool_file}:shout",
                           "tests.unit.test_tool_definitions:Notebook"])  # fmt: skip
    assert [s.name for s in specs] == ["calculator", "python", "shout", "count", "write"]
    assert specs[1].kind == "python" and specs[2].target.endswith("my_tools.py:shout")


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        (["nope"], "write `package.module:function`"),
        (["no_such_module_x:f"], "cannot import"),
        (["tests.unit.test_tool_definitions:missing"], "no missing there"),
        (["calculator", "calculator"], "two tools are named 'calculator'"),
    ],
)
def test_bad_tool_entries_name_the_setting(entries, words):
    with pytest.raises(ToolDefinitionError, match=words) as e:
        resolve_tools(entries)
    assert "generator.tools" in str(e.value)
