"""A tool is a typed Python function; its JSON schema comes from its signature and docstring.

The rule (TRL's ``get_json_schema`` and transformers' chat templates read tools the same way):

- the tool's name is the function's name (a method's name for a class's tools);
- its description is the docstring's first paragraph;
- every parameter needs a type hint: ``str`` → ``string``, ``int`` → ``integer``, ``float`` →
  ``number``, ``bool`` → ``boolean``, ``list[X]`` → ``array`` of X, ``dict`` → ``object``,
  ``Literal["a", "b"]`` → an ``enum``, ``X | None`` → X, not required;
- a parameter without a default is required;
- its description is its line in the docstring's ``Args:`` section (Google style:
  ``name: text``, continuation lines indented deeper).

``*args``, ``**kwargs``, positional-only parameters and hints outside that list are refused with
a message naming the tool and the parameter: the model could not be told how to call them.

``check_arguments`` validates a model's arguments against the schema before anything runs, so a
bad call becomes an error message to the model, never an exception in the generator.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

ToolKind = Literal["function", "python"]

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")


class ToolDefinitionError(ValueError):
    """A tool cannot be offered to the model as written; the message names it and the fix."""


class ToolArgumentError(ValueError):
    """A model's arguments do not fit the tool's schema; the message is shown to the model."""


@dataclass(frozen=True)
class ToolSpec:
    """What the model is told about a tool and where the sandbox finds it.

    ``target``: ``module:qualname`` (or ``path/file.py:qualname``) of the function, or of the
    class whose method ``name`` it is (``method`` set); the sandbox imports it before its jail
    closes. ``kind="python"`` is the built-in code runner (no target)."""

    name: str
    description: str
    parameters: dict[str, Any]
    target: str = ""
    method: str = ""
    kind: ToolKind = "function"
    required: tuple[str, ...] = field(default=())

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style tool entry chat templates render (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring."""
    text = inspect.cleandoc(doc or "")
    lines = text.splitlines()
    head: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line):
            break
        head.append(line.strip())
    params: dict[str, str] = {}
    in_args, current, indent = False, "", 0
    for line in lines:
        if _ARGS_HEADER.match(line):
            in_args, current = True, ""
            continue
        if not in_args:
            continue
        if not line.strip():
            current = ""
            continue
        this_indent = len(line) - len(line.lstrip())
        m = re.match(r"^\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m and (not current or this_indent <= indent):
            current, indent = m.group(1), this_indent
            params[current] = m.group(3).strip()
        elif current and this_indent > indent:
            params[current] = f"{params[current]} {line.strip()}".strip()
        elif this_indent == 0:
            in_args = False  # a new section (Returns:, Raises:) starts at the margin
    return " ".join(head), params


def _json_type(hint: Any, where: str) -> tuple[dict[str, Any], bool]:
    """(schema, optional) of one type hint; ``optional`` when it admits None."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) != 1:
            raise ToolDefinitionError(f"{where}: a union of {members} has no JSON schema here")
        inner, _ = _json_type(members[0], where)
        return inner, True
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}, False
    if origin is Literal:
        values = list(typing.get_args(hint))
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or next(iter(kinds)) not in _SCALARS:
            raise ToolDefinitionError(f"{where}: Literal values must share one scalar type")
        return {"type": _SCALARS[next(iter(kinds))], "enum": values}, False
    if hint is list or origin is list:
        args = typing.get_args(hint)
        out: dict[str, Any] = {"type": "array"}
        if args:
            out["items"], _ = _json_type(args[0], where)
        return out, False
    if hint is dict or origin is dict:
        return {"type": "object"}, False
    raise ToolDefinitionError(
        f"{where}: type hint {hint!r} has no JSON schema; use str, int, float, bool, list[...], "
        "dict, Literal[...] or X | None"
    )


def spec_from_function(
    fn: Any, *, target: str, name: str | None = None, method: str = ""
) -> ToolSpec:
    """The tool of a typed function (or bound method); see the module docstring for the rule."""
    tool = name or fn.__name__
    description, docs = _docstring_parts(fn.__doc__)
    if not description:
        raise ToolDefinitionError(
            f"tool {tool!r} ({target}) has no docstring: its first paragraph is what the model "
            "is told the tool does; write one"
        )
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise ToolDefinitionError(f"tool {tool!r}: its type hints do not resolve: {exc}") from exc
    props: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        where = f"tool {tool!r}, parameter {p.name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ToolDefinitionError(
                f"{where}: *args, **kwargs and positional-only parameters cannot be described "
                "to the model; give it named, typed parameters"
            )
        if p.name not in hints:
            raise ToolDefinitionError(f"{where} has no type hint; add one (e.g. `: str`)")
        schema, optional = _json_type(hints[p.name], where)
        if p.name in docs:
            schema["description"] = docs[p.name]
        props[p.name] = schema
        if p.default is inspect.Parameter.empty and not optional:
            required.append(p.name)
    parameters = {"type": "object", "properties": props, "required": required}
    return ToolSpec(
        name=tool,
        description=description,
        parameters=parameters,
        target=target,
        method=method,
        required=tuple(required),
    )


def specs_from_class(cls: type, *, target: str) -> list[ToolSpec]:
    """One tool per public method of ``cls`` (an instance is made with no arguments in the
    sandbox, once per call); the methods' own signatures and docstrings describe them."""
    out = []
    for attr, member in inspect.getmembers(cls, predicate=inspect.isfunction):
        if attr.startswith("_"):
            continue
        out.append(_method_spec(member, attr, target))
    if not out:
        raise ToolDefinitionError(f"tool class {target} has no public methods to offer")
    return out


def _method_spec(fn: Any, attr: str, target: str) -> ToolSpec:
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].name != "self":
        raise ToolDefinitionError(f"{target}.{attr}: a tool method takes self first")

    def unbound(*a: Any, **k: Any) -> Any:  # the signature without self, for the schema
        raise NotImplementedError

    unbound.__signature__ = inspect.Signature(params[1:])  # type: ignore[attr-defined]
    unbound.__annotations__ = {
        k: v for k, v in typing.get_type_hints(fn).items() if k != "self" and k != "return"
    }
    unbound.__doc__, unbound.__name__ = fn.__doc__, attr
    return spec_from_function(unbound, target=target, name=attr, method=attr)


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        items = schema.get("items")
        return isinstance(value, list) and (items is None or all(_fits(v, items) for v in value))
    if kind == "object":
        return isinstance(value, dict)
    return True


def check_arguments(spec: ToolSpec, arguments: Any) -> dict[str, Any]:
    """The arguments if they fit ``spec``'s schema; ``ToolArgumentError`` (shown to the model)
    naming the problem otherwise. ``None`` is accepted for an optional parameter."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(
            f"{spec.name}: arguments must be a JSON object, got {type(arguments).__name__}"
        )
    props = spec.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolArgumentError(
            f"{spec.name}: unknown argument(s) {unknown}; it takes {sorted(props)}"
        )
    missing = [k for k in spec.parameters.get("required", []) if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{spec.name}: missing required argument(s) {missing}")
    for key, value in arguments.items():
        if value is None and key not in spec.parameters.get("required", []):
            continue
        if not _fits(value, props[key]):
            want = props[key].get("enum") or props[key].get("type")
            raise ToolArgumentError(
                f"{spec.name}: argument {key!r} must be {want}, got {value!r:.80}"
            )
    return arguments
