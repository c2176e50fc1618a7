"""Routing replay (R3) in the learner's forward: a mixture-of-experts layer sends each token to
the experts the generator chose for it when it sampled, not to those the learner's own router
picks from its slightly different numbers.

In an MoE model a tiny numerical difference between vLLM and the learner (kernels, dtypes, batch
shapes) flips a token's top-k now and then; the learner then scores a different network than the
one that sampled, and the training-inference mismatch grows with training. Replaying the sampled
routing removes that cause (slime's rollout routing replay, arXiv 2510.11370; verl's
``router_replay.mode=R3``).

What a router computes under replay, for a token with recorded experts ``e_1..e_k``:

- the experts: ``e_1..e_k`` (the learner's own top-k is computed and only counted against them);
- their gate weights: the learner's softmax over all its router logits, taken at ``e_1..e_k``
  (renormalised over them where the model normalises its top-k), so the router still learns:
  its weight gets gradients through every logit of the softmax, and only the replayed experts
  get gradients through the expert MLPs;
- the router logits (returned for the load-balancing loss) are the learner's, unchanged.

A token whose routing was not recorded (any id < 0) keeps the learner's own top-k; such tokens
are counted (``fallback_tokens``). Routers are found by class: transformers' ``*TopKRouter`` modules
that return ``(logits, scores, indices)`` (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE); a model with
none is refused, naming the setting.

The routing of one forward is ``[N, L, K]`` expert ids for the ``N`` tokens in the order the
forward flattens them (``[B, T]`` row-major, or the packed rows', see ``flat_routing``), ``L`` MoE
layers in model order, ``K`` = top-k; FSDP2 and LoRA leave the routers' names and calls intact.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch  # noqa: TID253 - the learner's own: loaded with its model

ROUTER_CLASSES = frozenset(
    {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"}
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
NOT_RECORDED = -1
PADDING = -2  # a position of no token (padding, packed slack): routed by the learner, not counted


@dataclass
class ReplayCounts:
    """Tokens seen by the first MoE layer since the last ``take_counts`` (so each token counts
    once, not once per layer; padding not at all), and routing decisions (token × layer) where
    the learner's own top-k, as a set, differed from the replayed one."""

    replayed_tokens: int = 0
    fallback_tokens: int = 0
    decisions: int = 0
    differing_decisions: int = 0

    @property
    def differing_share(self) -> float:
        return self.differing_decisions / self.decisions if self.decisions else 0.0

    def as_stats(self) -> dict[str, float]:
        """The step record's counts (``losses.merge_stats`` sums them and makes the fractions
        ``router_replay_fallback_frac`` and ``router_replay_differing_frac``)."""
        return {
            "router_replay_tokens_count": float(self.replayed_tokens + self.fallback_tokens),
            "router_replay_fallback_count": float(self.fallback_tokens),
            "router_replay_decisions_count": float(self.decisions),
            "router_replay_differing_count": float(self.differing_decisions),
        }


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """``(layer index, router)`` of every MoE router in ``model``, in layer order."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTER_CLASSES:
            m = _LAYER.search(name)
            if m is None:
                raise ValueError(f"router {name!r} is not inside a numbered decoder layer")
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda lr: lr[0])


class RouterReplay:
    """Installed once on a model (``RouterReplay(model)``); every forward inside
    ``replaying(routing)`` routes by ``routing``, every other forward as the model would.
    ``recording()`` captures the model's own routing in the same ``[N, L, K]`` form (what a
    generator's engine reports)."""

    def __init__(self, model: Any) -> None:
        routers = moe_routers(model)
        if not routers:
            raise ValueError(
                f"learner.router_replay needs a mixture-of-experts model; {type(model).__name__} "
                f"has no router Tether knows ({', '.join(sorted(ROUTER_CLASSES))}). Set "
                'learner.router_replay = "off" for a dense model.'
            )
        self.layers = len(routers)
        self.top_k = int(routers[0][1].top_k)
        self.num_experts = int(routers[0][1].num_experts)
        self.layer_ids = [layer for layer, _ in routers]
        self._routing: torch.Tensor | None = None
        self._recorded: list[torch.Tensor | None] | None = None
        # [replayed tokens, fallback tokens, decisions, differing decisions], summed where the
        # forward runs: read on the host only by take_counts (no device sync per layer)
        self._counts: torch.Tensor | None = None
        for slot, (_, router) in enumerate(routers):
            if getattr(router, "_tether_replay", None) is not None:
                raise ValueError("routing replay is installed on this model already")
            original = router.forward
            router._tether_replay = self
            router.forward = types.MethodType(_replaying_forward(self, slot, original), router)

    @contextmanager
    def replaying(self, routing: torch.Tensor) -> Iterator[None]:
        """Forwards inside route by ``routing`` (``[N, L, K]`` integer expert ids, < 0 = not
        recorded: the learner's own router decides that token)."""
        if routing.dim() != 3 or tuple(routing.shape[1:]) != (self.layers, self.top_k):
            raise ValueError(
                f"routing of shape {tuple(routing.shape)}: expected [tokens, {self.layers} MoE "
                f"layers, top-{self.top_k}]"
            )
        if routing.numel() and int(routing.max()) >= self.num_experts:
            raise ValueError(f"routing names an expert id >= {self.num_experts} experts")
        self._routing = routing
        try:
            yield
        finally:
            self._routing = None

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor | None]]:
        """The model's own routing of the forwards inside, per layer (``[N, K]`` each); stack
        them with ``torch.stack(out, dim=1)`` for the ``[N, L, K]`` form."""
        self._recorded = [None] * self.layers
        try:
            yield self._recorded
        finally:
            self._recorded = None

    def take_counts(self) -> ReplayCounts:
        """The counts since the last call (one device-to-host copy), and start again."""
        acc, self._counts = self._counts, None
        return ReplayCounts() if acc is None else ReplayCounts(*(int(x) for x in acc.tolist()))

    def _route(self, router: Any, slot: int, logits, scores, indices):
        if self._recorded is not None:
            self._recorded[slot] = indices.detach().clone()
        routing = self._routing
        if routing is None:
            return logits, scores, indices
        recorded = routing[:, slot]
        if recorded.shape[0] != indices.shape[0]:
            raise ValueError(
                f"routing for {recorded.shape[0]} tokens, but the forward has {indices.shape[0]} "
                "(the routing must be flattened the way the forward flattens its tokens: "
                "router_replay.flat_routing)"
            )
        recorded = recorded.to(device=indices.device)
        use = (recorded >= 0).all(dim=-1)
        real = (recorded != PADDING).any(dim=-1)
        chosen = torch.where(use.unsqueeze(-1), recorded.to(indices.dtype), indices)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights = probs.gather(-1, chosen)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        own = indices.sort(dim=-1).values
        differs = (own != chosen.sort(dim=-1).values).any(dim=-1) & use
        n_use = use.sum()
        zero = torch.zeros_like(n_use)
        tokens = (n_use, real.sum() - n_use) if slot == 0 else (zero, zero)
        step = torch.stack([*tokens, n_use, differs.sum()])
        self._counts = step if self._counts is None else self._counts + step
        return logits, weights.to(scores.dtype), chosen


def _replaying_forward(replay: RouterReplay, slot: int, original):
    def forward(self, hidden_states):
        logits, scores, indices = original(hidden_states)
        return replay._route(self, slot, logits, scores, indices)

    return forward


def flat_routing(routing: torch.Tensor, attention_mask: torch.Tensor,
                 packed: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """``[B, T, L, K]`` routing of a micro-batch (padding rows anything) as the forward's
    ``[N, L, K]``: ``B·T`` tokens row-major for the padded forward, or the packed rows' ``R·W``
    positions (``packed_index``); padding and packed slack are ``PADDING``."""
    if packed is None:
        out = routing.clone()
        out[~attention_mask.bool()] = PADDING
        return out.reshape(-1, *routing.shape[2:])
    rows = packed["packed_input_ids"]
    out = torch.full((rows.numel(), *routing.shape[2:]), PADDING, dtype=routing.dtype,
                     device=routing.device)  # fmt: skip
    real = attention_mask.bool()
    out[packed["packed_index"][real]] = routing[real]
    return out
