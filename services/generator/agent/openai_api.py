"""OpenAI's request and response shapes for the generator's agent endpoint: what a
``/v1/chat/completions`` or ``/v1/completions`` body may hold, checked into a typed request, and
the replies an ``openai`` client reads (``tool_calls`` included).

Every body is untrusted: anything malformed becomes an ``ApiError`` (HTTP 400 with OpenAI's
error shape) naming the field. A field that would change how tokens are sampled is either used
or refused, never accepted and ignored: the behaviour log-probs Tether trains with must be those
of the distribution the tokens were drawn from, so ``temperature``, ``top_p`` and ``top_k`` must
be left out or equal the run's (``generator.temperature`` …; ``eval_temperature`` for held-out
episodes), and penalties, ``logit_bias``, ``n > 1``, streaming, constrained ``tool_choice`` and
``response_format`` are refused. Fields that only label a request (``user``, ``metadata``,
``store``, …) are accepted.

Not offered: streaming (``stream: true`` gets a 400), ``top_logprobs``, ``echo``, ``suffix``,
``best_of > 1``, images and audio.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# Fields that label a request without changing what is sampled: accepted.
LABELS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options",
                    "prompt_cache_key", "safety_identifier"})  # fmt: skip
# Fields accepted only at their neutral value: (field, neutral values).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "stream": (False, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "top_logprobs": (0, None),
    "tool_choice": ("auto", None),
    "function_call": (None, "auto"),
    "functions": (None, []),
    "echo": (False, None),
    "suffix": (None, ""),
    "best_of": (1, None),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}
WHY_NOT = {
    "stream": "streaming is not offered by Tether's endpoint; leave stream out (or false)",
    "n": "one request is one turn of one episode; ask again for another sample",
    "tool_choice": "Tether does not constrain decoding; leave tool_choice out or 'auto'",
}
SAMPLING = ("temperature", "top_p", "top_k")
# ``return_token_ids`` (vLLM's extension): the reply also carries ``prompt_token_ids`` and the
# choice's ``token_ids``, the ids Tether records
# ``parallel_tool_calls`` is honoured: false returns at most one call per reply; true is refused
# for a family whose template allows one call per turn (Llama 3.x)
CHAT_FIELDS = frozenset({"messages", "tools", "max_tokens", "max_completion_tokens", "stop",
                         "logprobs", "seed", "return_token_ids", "parallel_tool_calls",
                         *SAMPLING, *LABELS, *NEUTRAL})  # fmt: skip
COMPLETION_FIELDS = frozenset({"prompt", "max_tokens", "stop", "logprobs", "seed",
                               "return_token_ids", *SAMPLING, *LABELS, *NEUTRAL})  # fmt: skip
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                            "annotations", "audio", "function_call", "reasoning_content"})  # fmt: skip
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4


class ApiError(Exception):
    """An answer other than 200: ``status``, OpenAI's ``type`` and ``code``, the field."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "conflict_error", 413: "invalid_request_error"}.get(self.status, "api_error")  # fmt: skip
        return {"error": {"message": self.message, "type": kind, "code": self.code,
                          "param": self.param}}  # fmt: skip


def bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code, param=param)


@dataclass(frozen=True)
class Sampling:
    """The run's sampling for an episode, which a request may restate but not change."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    stop: tuple[str, ...] = ()


@dataclass
class TurnRequest:
    """A checked request: chat (``messages``) or completion (``prompt``)."""

    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    seed: int | None
    model: str
    return_token_ids: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    parallel_tool_calls: bool | None = None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _common(body: dict[str, Any], allowed: frozenset[str], sampling: Sampling, cap: int) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unknown field(s) {unknown} for this endpoint", unknown[0], "unknown_field")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            why = WHY_NOT.get(name, "Tether samples exactly the run's policy, so it is refused")
            raise bad(f"{name} = {json.dumps(body[name])[:80]} is not offered: {why}", name,
                      "unsupported_field")  # fmt: skip
    for name in SAMPLING:
        value, run = body.get(name), getattr(sampling, name)
        if value is None or (name == "top_k" and value in (-1, 0) and run == 0):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != run:
            raise bad(
                f"{name} = {value!r}: this run samples with {name} = {run} (the behaviour "
                "log-probs it trains on must be those of the distribution the tokens came from). "
                f"Leave {name} out, or set it to {run}; change the run's own setting in "
                "[generator] to sample otherwise.",
                name,
                "sampling_mismatch",
            )
    out: dict[str, Any] = {"model": body.get("model") or "tether"}
    if not isinstance(out["model"], str):
        raise bad("model must be a string", "model")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise bad("max_tokens must be a positive integer", "max_tokens")
    if limit is not None and limit > cap:
        raise bad(f"max_tokens = {limit} exceeds this run's cap of {cap} "
                  "(agent.max_tokens_per_request)", "max_tokens", "max_tokens_exceeded")  # fmt: skip
    out["max_tokens"] = limit
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings",
                  "stop")  # fmt: skip
    out["stop"] = tuple(stops) or sampling.stop
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed must be an integer", "seed")
    out["seed"] = seed
    ids = body.get("return_token_ids") or False
    if not isinstance(ids, bool):
        raise bad("return_token_ids must be a boolean", "return_token_ids")
    out["return_token_ids"] = ids
    return out


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if (
                not isinstance(p, dict)
                or p.get("type") != "text"
                or not isinstance(p.get("text"), str)
            ):
                raise bad(f"{where}: only text content parts are offered", where)
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{where} must be a string, null or a list of text parts", where)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{'type': 'function', 'function': {{name, arguments}}}}", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # kept as written; the template renders it as a string
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message(m: Any, i: int) -> dict[str, Any]:
    """One message in the form chat templates render (and the continuity check compares)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", where)
    extra = sorted(set(m) - MESSAGE_FIELDS)
    if extra:
        raise bad(f"{where} has unknown field(s) {extra}", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {ROLES}", f"{where}.role")
    if m.get("audio") or m.get("function_call"):
        raise bad(f"{where}: audio and function_call are not offered", where)
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise bad(f"{where}.tool_calls: only an assistant message has a list of them", where)
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if (
        role == "assistant"
        and isinstance(m.get("reasoning_content"), str)
        and m["reasoning_content"]
    ):
        out["reasoning_content"] = m["reasoning_content"]  # templates that render it (Qwen3)
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
            out[key] = m[key]
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in tools
    )  # fmt: skip
    if not ok:
        raise bad("tools must be a list of {'type': 'function', 'function': {name, ...}}", "tools")
    return tools


def parse_chat(body: Any, *, sampling: Sampling, max_tokens: int, max_messages: int) -> TurnRequest:
    """A ``/v1/chat/completions`` body, checked (``ApiError`` otherwise). Tool messages get the
    ``name`` of the call they answer when they do not say it (OpenAI clients send only
    ``tool_call_id``; chat templates render the name)."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    common = _common(body, CHAT_FIELDS, sampling, max_tokens)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    if len(raw) > max_messages:
        raise bad(f"{len(raw)} messages exceed this run's cap of {max_messages} "
                  "(agent.max_messages)", "messages", "too_many_messages")  # fmt: skip
    messages = [_message(m, i) for i, m in enumerate(raw)]
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", [])
             if "id" in c}  # fmt: skip
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return TurnRequest(messages=messages, tools=_tools(body.get("tools")), logprobs=logprobs,
                       parallel_tool_calls=parallel, **common)  # fmt: skip


def parse_completion(body: Any, *, sampling: Sampling, max_tokens: int) -> TurnRequest:
    """A ``/v1/completions`` body: ``prompt`` is a string or a list of token ids (or a list of
    one of those); ``logprobs`` 0 (the sampled token's) or null."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    common = _common(body, COMPLETION_FIELDS, sampling, max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids_ok = isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt)
    if not (ids_ok or (isinstance(prompt, str) and prompt)):
        raise bad("prompt must be a non-empty string or list of token ids (one prompt)", "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, False, True):
        raise bad("logprobs may be 0 (the sampled token's log-prob) or null; top "
                  "alternatives are not offered", "logprobs")  # fmt: skip
    return TurnRequest(prompt=prompt, logprobs=logprobs is not None and logprobs is not False,
                       **common)  # fmt: skip


# ----------------------------------------------------------------------------- replies


def tool_call_entries(calls: list[Any], prefix: str) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` of parsed calls (``common.chat.tool_calls.ToolCall``)."""
    return [
        {"id": c.id or f"call_{prefix}_{k}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for k, c in enumerate(calls)
    ]  # fmt: skip


def _logprob_entries(tokens: list[str], logprobs: list[float]) -> list[dict[str, Any]]:
    return [
        {"token": t, "logprob": lp if math.isfinite(lp) else -9999.0,
         "bytes": list(t.encode("utf-8")), "top_logprobs": []}
        for t, lp in zip(tokens, logprobs, strict=True)
    ]  # fmt: skip


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def with_ids(reply: dict[str, Any], prompt_ids: list[int], ids: list[int]) -> dict[str, Any]:
    """``reply`` with the prompt's and the choice's token ids (``return_token_ids``)."""
    reply["prompt_token_ids"] = list(prompt_ids)
    reply["choices"][0]["token_ids"] = list(ids)
    return reply


def chat_reply(
    *, model: str, content: str, tool_calls: list[dict[str, Any]], finish: str,
    prompt_tokens: int, tokens: list[str], logprobs: list[float] | None, extra: dict[str, Any],
    reasoning: str = "",
) -> dict[str, Any]:  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:  # vLLM's reasoning parsers' field: the <think> text, apart from the content
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{
            "index": 0, "message": message, "finish_reason": finish,
            "logprobs": None if logprobs is None
            else {"content": _logprob_entries(tokens, logprobs)},
        }],
        "usage": usage(prompt_tokens, len(tokens)),
        "tether": extra,
    }  # fmt: skip


def completion_reply(
    *, model: str, text: str, finish: str, prompt_tokens: int, tokens: list[str],
    logprobs: list[float] | None, extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    lp = None
    if logprobs is not None:
        lp = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
              "text_offset": []}  # fmt: skip
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
        "usage": usage(prompt_tokens, len(tokens)),
        "tether": extra,
    }  # fmt: skip
