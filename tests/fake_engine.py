"""Fakes of vLLM's engine for the agent and episode tests, named as fakes: each answers
``generate_group`` as the engine wrapper (``common.engine``) does, with one real ``Sample`` whose
ids are a text the test chose, encoded and closed by the end-of-turn id, so the ids a loop records
can be checked exactly. The real engine runs the same loops in ``tests/e2e/test_e2e_episodes.py`` and
``tests/services/test_agent_endpoint.py``.

``FakeEngine`` turns a reply into that sample; a subclass says what each request answers:
``ScriptedEngine`` by episode and turn, ``InOrderEngine`` request after request,
``test_published_templates.TemplateEngine`` by episode with a family's own end-of-turn id, and
``test_agent_parity.PolicyFake`` as a function of the prompt.
"""

from __future__ import annotations

from typing import Any

from common.engine import Sample

Spans = list[tuple[str, int, int]]  # [(weight version, start, end)] of a reply's tokens


class FakeEngine:
    """A fake engine: ``answer`` chooses each request's text (or ``(text, spans)``), which is
    encoded, closed by the end-of-turn id ``eos`` (default ``<|im_end|>``'s) and cut at
    ``max_tokens`` (finish "length"); spans given are cut to the reply, others come from
    ``spans`` (all of it sampled by ``version``), and the log-probs from ``logprobs``
    (``logprob`` for every token)."""

    def __init__(self, tok, *, logprob: float, version: str, eos: int | None = None) -> None:
        self.tok, self.logprob, self.version = tok, logprob, version
        self.eos = tok.convert_tokens_to_ids("<|im_end|>") if eos is None else eos

    def answer(self, ids: list[int], request_id: str) -> str | tuple[str, Spans]:
        raise NotImplementedError

    def logprobs(self, ids: list[int], n: int) -> list[float]:
        return [self.logprob] * n

    def spans(self, ids: list[int], n: int) -> Spans:
        return [(self.version, 0, n)]

    def reply(self, text: str, max_tokens: int) -> tuple[list[int], str]:
        """``text``'s ids closed by the end-of-turn id, cut at ``max_tokens``; the finish reason."""
        out = [*self.tok(text, add_special_tokens=False).input_ids, self.eos]
        if len(out) > max_tokens:
            return out[:max_tokens], "length"
        return out, "stop"

    async def generate_group(self, ids: Any, params: Any, request_id: str) -> list[Sample]:
        entry = self.answer(list(ids), request_id)
        text, spans = entry if isinstance(entry, tuple) else (entry, None)
        out, finish = self.reply(text, params.max_tokens)
        if spans is None:
            spans = self.spans(list(ids), len(out))
        return [
            Sample(
                token_ids=out,
                logprobs=self.logprobs(list(ids), len(out)),
                finish_reason=finish,
                text=text,
                seconds=0.01,
                weight_versions=[(v, s, min(e, len(out))) for v, s, e in spans],
            )
        ]


class ScriptedEngine(FakeEngine):
    """Turn k of request ``<id>/t<k>`` answers ``script[<id>][k]``, a text or a
    ``(text, [(version, start, end)])`` pair; ``prompts[<id>]`` holds the episode's prompts."""

    def __init__(self, tok, script: dict[str, list], *, logprob: float = -0.5, version="7"):
        super().__init__(tok, logprob=logprob, version=version)
        self.script = script
        self.prompts: dict[str, list[list[int]]] = {}

    def answer(self, ids: list[int], request_id: str) -> str | tuple[str, Spans]:
        episode, _, turn = request_id.rpartition("/t")
        self.prompts.setdefault(episode, []).append(ids)
        return self.script[episode][int(turn)]


class InOrderEngine(FakeEngine):
    """The k-th request answers ``script[k]``, whatever its id; ``prompts`` in order."""

    def __init__(self, tok, script: list[str], *, logprob: float = -0.25, version="3") -> None:
        super().__init__(tok, logprob=logprob, version=version)
        self.script = list(script)
        self.prompts: list[list[int]] = []

    def answer(self, ids: list[int], request_id: str) -> str:
        self.prompts.append(ids)
        return self.script.pop(0)
