"""The tools a run offers, from the names in ``generator.tools``.

An entry is one of:

- ``calculator``: arithmetic by an AST whitelist (``common.tools.calculator``);
- ``python``: Python code run in the sandbox by a fresh interpreter (stdlib only), its printed
  output returned;
- ``package.module:function`` or ``path/to/file.py:function``: a typed function of yours;
- ``package.module:Class`` or ``path/to/file.py:Class``: every public method of the class (an
  instance is made with no arguments for each call).

Schemas come from signatures and docstrings (``common.tools.functions``). Resolving imports the
named module in the calling process (as ``scorer.custom_reward`` does); the sandbox imports it
again in each worker before its jail closes, so the function runs there, never here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from common.tools.calculator import calculator
from common.tools.functions import (
    ToolDefinitionError,
    ToolSpec,
    spec_from_function,
    specs_from_class,
)

PYTHON_TOOL = ToolSpec(
    name="python",
    description=(
        "Run Python code (standard library only, no network, no files outside a scratch "
        "directory) and return what it prints."
    ),
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print results"}},
        "required": ["code"],
    },
    kind="python",
    required=("code",),
)
BUILTIN = ("calculator", "python")


def import_target(target: str, *, setting: str = "generator.tools entry") -> Any:
    """The object ``module:qualname`` or ``path/file.py:qualname`` names (imported here);
    ``setting`` names where it was given, for the errors."""
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        tool = "tools" in setting
        noun = "function" if tool else "name"
        raise ToolDefinitionError(
            f"{setting} {target!r}: write `package.module:{noun}`"
            + (
                f", `path/to/file.py:{noun}` or a built-in name (calculator, python)"
                if tool
                else f" or `path/to/file.py:{noun}`"
            )
        )
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ToolDefinitionError(f"{setting} {target!r}: no file {path}")
        name = f"tether_tools_{abs(hash(str(path)))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ToolDefinitionError(
                f"{setting} {target!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?"
            ) from exc
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ToolDefinitionError(f"{setting} {target!r}: no {qualname} there")
    return obj


def resolve_tools(entries: list[str]) -> list[ToolSpec]:
    """The specs of ``generator.tools``, in order; names must be unique."""
    specs: list[ToolSpec] = []
    for entry in entries:
        if entry == "calculator":
            specs.append(
                spec_from_function(calculator, target="common.tools.calculator:calculator")
            )
        elif entry == "python":
            specs.append(PYTHON_TOOL)
        else:
            obj = import_target(entry)
            if inspect.isclass(obj):
                specs.extend(specs_from_class(obj, target=entry))
            elif callable(obj):
                specs.append(spec_from_function(obj, target=entry))
            else:
                raise ToolDefinitionError(
                    f"generator.tools entry {entry!r} is neither a function nor a class"
                )
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ToolDefinitionError(
                f"two tools are named {s.name!r} in generator.tools; tool names must be unique"
            )
        seen.add(s.name)
    return specs


def callable_of(spec: ToolSpec) -> Any:
    """What runs for ``spec`` (inside the sandbox worker): the function, or a function that
    makes an instance of the class and calls the method."""
    obj = import_target(spec.target)
    if not spec.method:
        return obj

    def call(**kwargs: Any) -> Any:
        return getattr(obj(), spec.method)(**kwargs)

    return call


def tool_schemas(entries: list[str]) -> list[dict[str, Any]] | None:
    """The schemas chat templates render for ``generator.tools`` (None without tools)."""
    return [s.schema() for s in resolve_tools(entries)] if entries else None
