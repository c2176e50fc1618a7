"""What an import produced: the Tether settings, each with the peer key it came from, and what
could not be mapped, with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PEERS = ("verl", "openrlhf", "slime", "roll")


@dataclass(frozen=True)
class MappedKey:
    """One translated setting: ``peer_key`` (several joined by ``+``) became ``tether_key``."""

    peer_key: str
    peer_value: Any
    tether_key: str
    tether_value: Any
    note: str = ""


@dataclass(frozen=True)
class ImportProblem:
    """A peer setting Tether cannot reproduce; the message says why and how to fix it."""

    message: str


@dataclass
class ImportResult:
    peer: str
    source: str
    tether: dict[str, dict[str, Any]] = field(default_factory=dict)
    mapping: list[MappedKey] = field(default_factory=list)
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)
    unknown_variables: list[str] = field(default_factory=list)
    problems: list[ImportProblem] = field(default_factory=list)
