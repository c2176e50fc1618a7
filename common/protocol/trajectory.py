"""One sampled episode on the wire (schema v2): the token arrays, the loss mask, the version of
every sampled token, the turns and the tool calls. A single-turn response is an episode of one
assistant turn.

The arrays, all as long as ``response_token_ids`` (every id after the prompt, in order):

- ``loss_mask`` (``|u1``): 1 on ids the policy sampled, 0 on ids the environment appended
  (tool results, the chat template's turn markup around them);
- ``behaviour_logprobs`` (``<f4``): the sampling policy's log-prob of each sampled id, 0 elsewhere;
- ``token_versions`` (``<i4``): the policy version that sampled each id, -1 elsewhere (AReaL's
  convention); non-decreasing over the sampled ids, since an in-flight update only moves a
  generator forward. ``policy_version`` is the oldest of them: what staleness is judged by.

``turns`` cover the ids without gaps, ``[role, start, end)``, role ``assistant`` (sampled: the
only ids with mask 1), ``tool`` or ``env``. ``tool_calls`` records every call an assistant turn
made: name, arguments as written (cut to ``MAX_ARGUMENT_CHARS``), ok or its error, seconds.
``template_mismatch`` is the first id where re-rendering the conversation through the chat
template differs from the ids (-1: no difference, or not checked).

Episodes an agent ran through the generator's OpenAI-compatible endpoint (``[agent]``) may also
carry, each written only when it differs from its default (so a built-in episode's bytes are
unchanged):

- ``segment`` (default 0): a request whose prompt did not extend the ids recorded so far started
  a new *segment* of the episode: a trajectory of its own in the group, with the episode's
  ``sample_index`` and the next ``segment``, trained as its own sample with the episode's reward;
- ``prompt_token_ids`` (default: the group's): a segment's own prompt, when it is not the
  group's prompt (a later segment, or an agent that wrote its own first prompt);
- ``agent_reward`` (default none): the reward components the agent's code returned; the scorer
  uses them instead of grading ``response_text``;
- ``error`` (default ""): why the agent's code failed (``finish_reason`` ``agent_error`` or
  ``agent_timeout``), or why a built-in episode could not go on (``episode_error``: the chat
  template refused a turn, a turn could not be encoded); such an episode is recorded and
  counted but never trained.

With routing replay on, an episode also carries ``routed_experts`` (its ids' experts) and, for a
segment with its own prompt, ``prompt_routed_experts`` (``common.protocol.routing``, schema v3).

A v1 message (single-turn, ``version_spans``) is read as an episode of one assistant turn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from common.protocol.routing import ROUTING_VERSION, RoutingShape
from common.protocol.wire_arrays import pack_array, unpack_array
from common.protocol.wire_fields import (
    LOGPROB_EPS,
    _check,
    _Fields,
    _is_int,
    _is_str,
    _list_of,
    _map_of,
    _number,
    _pair,
    _token_ids,
)

ROLES = ("assistant", "tool", "env")
MAX_TOOL_CALLS = 4096
MAX_ARGUMENT_CHARS = 2000
MAX_ERROR_CHARS = 1000
MAX_REWARD_COMPONENTS = 64
# finish reasons never trained: the agent's code failed, or (built-in loop) the episode could not
# go on (its chat template refused a turn, a call could not be encoded): recorded and counted
AGENT_FAILED = frozenset({"agent_error", "agent_timeout", "episode_error"})
# fields written only when they differ from these defaults (see the module docstring)
_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "segment": 0, "prompt_token_ids": None, "agent_reward": None, "error": "",
    "routed_experts": None, "prompt_routed_experts": None,
}  # fmt: skip
_ROUTING_FIELDS = ("routed_experts", "prompt_routed_experts")


@dataclass
class ToolCallRecord:
    """One tool call of an episode: what the model asked and how it went."""

    name: str
    arguments: str  # as the model wrote it (JSON text), cut to MAX_ARGUMENT_CHARS
    ok: bool
    error: str = ""  # the error's short label ("timed_out", "bad_arguments", ...) when not ok
    seconds: float = 0.0
    turn: int = 0  # index of the assistant turn that made it

    @classmethod
    def from_wire(cls, d: Any) -> ToolCallRecord:
        f = _Fields(d, "tool_call", cls, head=False)
        return cls(
            name=f.text("name"), arguments=f.text("arguments"),
            ok=f.get("ok", lambda x: isinstance(x, bool), "a bool"), error=f.text("error"),
            seconds=f.num("seconds"), turn=f.nat("turn"),
        )  # fmt: skip


def _versions_from_spans(spans: list, version: int, n: int) -> np.ndarray:
    ok = bool(spans) and spans[0] == [0, version]
    _check(ok, "bad_value", "version_spans must start with [0, policy_version]")
    for (i0, v0), (i1, v1) in zip(spans, spans[1:], strict=False):
        ok = i0 < i1 <= n and v0 <= v1
        _check(ok, "bad_value", "version_spans need increasing indices, non-decreasing versions")
    out = np.empty(n, dtype="<i4")
    for k, (start, v) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else n
        out[start:end] = v
    return out


def versions_from_spans(spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """Per-token versions of ``n`` sampled ids from ``[(first index, version), ...]``."""
    first = spans[0][1] if spans else 0
    return _versions_from_spans([[int(i), int(v)] for i, v in spans] or [[0, 0]], first, n)


def _array(obj: Any, dtype: str, n: int, name: str) -> np.ndarray:
    arr = unpack_array(obj)
    _check(arr.dtype.str == dtype and arr.ndim == 1, "bad_schema", f"{name} must be 1-D {dtype}")
    _check(len(arr) == n, "bad_value", f"{n} tokens but {len(arr)} entries in {name}")
    return arr


def _check_episode(mask: np.ndarray, lp: np.ndarray, versions: np.ndarray, policy: int) -> None:
    sampled = mask == 1
    _check(bool(np.isin(mask, (0, 1)).all()), "bad_value", "loss_mask must be 0 or 1")
    _check(bool(np.isfinite(lp).all()), "bad_value", "behaviour_logprobs has NaN/inf")
    _check(bool((lp <= LOGPROB_EPS).all()), "bad_value", "behaviour_logprobs has values > 0")
    _check(bool((lp[~sampled] == 0).all()), "bad_value", "log-probs on unsampled ids must be 0")
    _check(bool((versions[~sampled] == -1).all()), "bad_value", "unsampled ids need version -1")
    v = versions[sampled]
    _check(bool((v >= 0).all()), "bad_value", "sampled ids need a version >= 0")
    _check(bool((np.diff(v) >= 0).all()), "bad_value", "token_versions must not decrease")
    ok = policy == (int(v.min()) if len(v) else policy)
    _check(ok, "bad_value", f"policy_version={policy} is not the oldest sampled version")


def _check_turns(turns: list, mask: np.ndarray, n_calls: list[int]) -> list[tuple[str, int, int]]:
    at, out = 0, []
    for t in turns:
        ok = isinstance(t, list) and len(t) == 3 and t[0] in ROLES and _pair(t[1:])
        _check(ok, "bad_schema", "turns must be [role, start, end] with a known role")
        _check(t[1] == at and t[2] > t[1], "bad_value", "turns must cover the ids in order")
        if t[0] != "assistant":
            _check(not mask[t[1] : t[2]].any(), "bad_value", f"{t[0]} turn with loss_mask 1")
        out.append((t[0], t[1], t[2]))
        at = t[2]
    _check(at == len(mask), "bad_value", f"turns cover {at} of {len(mask)} ids")
    assistant = sum(1 for t in out if t[0] == "assistant")
    ok = all(0 <= k < max(assistant, 1) for k in n_calls)
    _check(ok, "bad_value", "a tool call names an assistant turn the episode does not have")
    return out


@dataclass
class Trajectory:
    """One episode (see the module docstring). ``response_text`` is the final assistant turn's
    text: what the scorer grades."""

    sample_id: str
    sample_index: int
    response_token_ids: np.ndarray  # uint32
    behaviour_logprobs: np.ndarray  # float32, 0 where loss_mask is 0
    loss_mask: np.ndarray  # uint8
    token_versions: np.ndarray  # int32, -1 where loss_mask is 0
    policy_version: int  # oldest version among sampled ids
    finish_reason: str  # stop | length | max_turns
    response_text: str = ""
    turns: list[tuple[str, int, int]] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    template_mismatch: int = -1
    timings: dict[str, float] = field(default_factory=dict)
    segment: int = 0
    prompt_token_ids: np.ndarray | None = None  # uint32; None = the group's prompt
    agent_reward: dict[str, float] | None = None
    error: str = ""
    routed_experts: np.ndarray | None = None  # [n, L, K] (common.protocol.routing)
    prompt_routed_experts: np.ndarray | None = None  # [len(prompt_token_ids), L, K]

    @property
    def failed(self) -> bool:
        """The agent's code failed (an exception or its timeout): recorded, never trained."""
        return self.finish_reason in AGENT_FAILED

    @classmethod
    def single_turn(
        cls, *, sample_id: str, sample_index: int, token_ids: Any, logprobs: Any,
        version_spans: list[tuple[int, int]], finish_reason: str, response_text: str = "",
        timings: dict[str, float] | None = None,
    ) -> Trajectory:  # fmt: skip
        """A one-turn episode: every id sampled, versions from ``[(first index, version)]``."""
        ids = np.asarray(token_ids, dtype=np.uint32)
        versions = versions_from_spans(version_spans, len(ids))
        return cls(
            sample_id=sample_id, sample_index=sample_index, response_token_ids=ids,
            behaviour_logprobs=np.asarray(logprobs, dtype=np.float32),
            loss_mask=np.ones(len(ids), dtype=np.uint8), token_versions=versions,
            policy_version=int(versions.min()) if len(ids) else int(version_spans[0][1]),
            finish_reason=finish_reason, response_text=response_text,
            turns=[("assistant", 0, len(ids))] if len(ids) else [],
            timings=dict(timings or {}),
        )  # fmt: skip

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def version_spans(self) -> list[tuple[int, int]]:
        """``(first index, version)`` where the sampled ids' version changes (indices into the
        response ids): what schema v1 carried."""
        out: list[tuple[int, int]] = []
        for i in np.flatnonzero(self.loss_mask):
            v = int(self.token_versions[i])
            if not out or out[-1][1] != v:
                out.append((int(i), v))
        return out

    def to_wire(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["response_token_ids"] = pack_array(np.asarray(self.response_token_ids, dtype="<u4"))
        d["behaviour_logprobs"] = pack_array(np.asarray(self.behaviour_logprobs, dtype="<f4"))
        d["loss_mask"] = pack_array(np.asarray(self.loss_mask, dtype="|u1"))
        d["token_versions"] = pack_array(np.asarray(self.token_versions, dtype="<i4"))
        d["turns"] = [[r, int(s), int(e)] for r, s, e in self.turns]
        d["tool_calls"] = [asdict(c) for c in self.tool_calls]
        for name, default in _OPTIONAL_DEFAULTS.items():
            if d[name] is None or (default is not None and d[name] == default):
                del d[name]
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = pack_array(np.asarray(self.prompt_token_ids, dtype="<u4"))
        for name in _ROUTING_FIELDS:
            if name in d:
                d[name] = pack_array(d[name])
        return d

    @classmethod
    def from_wire(cls, d: Any, *, version: int, routing: RoutingShape | None = None) -> Trajectory:
        """``routing``: the group's routing shape (v3), which the sample's routing must fit."""
        if version == 1:
            return cls._from_v1(d)
        f = _Fields(d, "sample", cls, head=False, version=version)
        for name in _ROUTING_FIELDS:
            _check(name not in d or (version >= ROUTING_VERSION and routing is not None),
                   "bad_schema", f"sample.{name} needs schema v{ROUTING_VERSION} and the "
                   "group's routing_shape")  # fmt: skip
        ids = _token_ids(f.get("response_token_ids"), "response_token_ids")
        n = len(ids)
        mask = _array(f.get("loss_mask"), "|u1", n, "loss_mask")
        lp = _array(f.get("behaviour_logprobs"), "<f4", n, "behaviour_logprobs")
        versions = _array(f.get("token_versions"), "<i4", n, "token_versions")
        policy = f.nat("policy_version")
        _check_episode(mask, lp, versions, policy)
        calls = f.get("tool_calls", _list_of(_anything_map), "a list of maps")
        _check(len(calls) <= MAX_TOOL_CALLS, "oversize", f"{len(calls)} tool calls")
        records = [ToolCallRecord.from_wire(c) for c in calls]
        turns = f.get("turns", _list_of(lambda x: isinstance(x, list)), "a list of turns")
        return cls(
            sample_id=f.text("sample_id"), sample_index=f.nat("sample_index"),
            response_token_ids=ids, behaviour_logprobs=lp, loss_mask=mask,
            token_versions=versions, policy_version=policy,
            finish_reason=f.text("finish_reason"), response_text=f.text("response_text"),
            turns=_check_turns(turns, mask, [c.turn for c in records]), tool_calls=records,
            template_mismatch=f.get("template_mismatch", _is_int, "an int"),
            timings=f.get("timings", _map_of(_number), "a map of str to numbers"),
            **_agent_fields(f), **_routing_fields(f, routing, n),
        )  # fmt: skip

    @classmethod
    def _from_v1(cls, d: Any) -> Trajectory:
        f = _Fields(d, "sample", cls, head=False, version=1,
                    legacy=frozenset({"version_spans"}))  # fmt: skip
        for name in ("loss_mask", "token_versions", "turns", "tool_calls", "template_mismatch",
                     *_OPTIONAL_DEFAULTS):  # fmt: skip
            _check(name not in d, "bad_schema", f"sample.{name} is not a v1 field")
        ids = _token_ids(f.get("response_token_ids"), "response_token_ids")
        lp = _array(f.get("behaviour_logprobs"), "<f4", len(ids), "behaviour_logprobs")
        version = f.nat("policy_version")
        spans = f.get("version_spans", _list_of(_pair), "a list of [index, version] pairs")
        versions = _versions_from_spans(spans, version, len(ids))
        mask = np.ones(len(ids), dtype=np.uint8)
        _check_episode(mask, lp, versions, version if len(ids) else version)
        return cls(
            sample_id=f.text("sample_id"), sample_index=f.nat("sample_index"),
            response_token_ids=ids, behaviour_logprobs=lp, loss_mask=mask,
            token_versions=versions, policy_version=version,
            finish_reason=f.text("finish_reason"), response_text=f.text("response_text"),
            turns=[("assistant", 0, len(ids))] if len(ids) else [],
            timings=f.get("timings", _map_of(_number), "a map of str to numbers"),
        )  # fmt: skip


def _agent_fields(f: _Fields) -> dict[str, Any]:
    """The optional fields of an agent's episode (module docstring), checked."""
    segment = f.get("segment", _is_int, "an int", optional=True) or 0
    _check(segment >= 0, "bad_value", f"segment={segment} is negative")
    raw = f.get("prompt_token_ids", optional=True)
    prompt = None if raw is None else _token_ids(raw, "sample.prompt_token_ids")
    _check(prompt is None or len(prompt) > 0, "bad_value", "a segment's prompt is empty")
    reward = f.get("agent_reward", _map_of(_number), "a map of str to numbers", optional=True)
    ok = reward is None or 0 < len(reward) <= MAX_REWARD_COMPONENTS
    _check(ok, "bad_value", f"agent_reward needs 1..{MAX_REWARD_COMPONENTS} components")
    error = f.text("error", optional=True) or ""
    _check(len(error) <= MAX_ERROR_CHARS, "oversize", f"error of {len(error)} characters")
    return {
        "segment": segment, "prompt_token_ids": prompt, "error": error,
        "agent_reward": None if reward is None else {k: float(v) for k, v in reward.items()},
    }  # fmt: skip


def _routing_fields(f: _Fields, routing: RoutingShape | None, n: int) -> dict[str, Any]:
    """A v3 sample's routing, checked against the group's shape and its own ids."""
    out: dict[str, Any] = {}
    if routing is None:
        return out
    raw = f.get("routed_experts", optional=True)
    if raw is not None:
        out["routed_experts"] = routing.unpack(raw, n, "sample.routed_experts")
    raw = f.get("prompt_routed_experts", optional=True)
    if raw is not None:
        own = f.d.get("prompt_token_ids")
        _check(own is not None, "bad_schema",
               "sample.prompt_routed_experts without the sample's own prompt_token_ids")  # fmt: skip
        p = _token_ids(own, "sample.prompt_token_ids")
        out["prompt_routed_experts"] = routing.unpack(raw, len(p), "sample.prompt_routed_experts")
    return out


def _anything_map(x: Any) -> bool:
    return isinstance(x, dict) and all(_is_str(k) for k in x)
