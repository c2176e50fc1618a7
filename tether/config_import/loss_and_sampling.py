"""The peers' names for dynamic sampling, over-long shaping, GSPO / CISPO and rollout-train
mismatch correction, mapped onto ``learner.dynamic_sampling``, ``scorer.overlong_*``,
``learner.policy_loss``, ``learner.off_policy`` / ``is_cap`` and ``learner.mismatch_mask_*``.
Where a peer computes something else, the note on the mapped key says what differs."""

from __future__ import annotations

from typing import Any

from tether.config_import.mapping import Mapper

_A = "actor_rollout_ref.actor."
_RC = "algorithm.rollout_correction."

_DYNAMIC_NOTE = (
    "{peer} keeps sampling until its batch holds enough groups whose rewards differ and drops "
    "the rest; Tether over-samples by the observed filter rate and tops up, at most "
    "learner.max_extra_prompts_per_cycle extra prompts per cycle ({cap})"
)


def map_loss_and_sampling(peer: str, m: Mapper) -> None:
    {"verl": _verl, "openrlhf": _openrlhf, "slime": _slime}.get(peer, lambda m: None)(m)


def _dynamic(m: Mapper, key: str | tuple[str, ...], note: str) -> None:
    m.put("learner.filter_equal_reward_groups", True, key, "part of dynamic sampling")
    m.put("learner.dynamic_sampling", True, key, note)


def _bounds(spec: Any) -> list[float] | None:
    """verl's ratio bounds: "lower_upper", or one upper bound (the lower is its reciprocal)."""
    try:
        if isinstance(spec, str) and "_" in spec:
            low, high = (float(x) for x in spec.split("_", 1))
        else:
            high = float(spec)
            low = 1.0 / high
    except (TypeError, ValueError):
        return None
    return [low, high]


def _verl(m: Mapper) -> None:
    fe, fm, fx = (
        f"algorithm.filter_groups.{k}" for k in ("enable", "metric", "max_num_gen_batches")
    )
    if m.get(fe, False):
        metric = m.get(fm, "acc")
        gen = m.get("data.gen_batch_size", m.get("data.train_batch_size", 1024))
        batches = m.get(fx, 0)
        cap = (batches - 1) * gen if batches > 1 else 9 * gen
        why = (
            f"(max_num_gen_batches − 1) × gen_batch_size = {cap}"
            if batches > 1
            else f"verl's {batches} means no limit; Tether needs one: 9 × gen_batch_size = {cap}"
        )
        diff = ""
        if metric not in ("seq_reward", "score", "seq_final_reward"):
            diff = f"; verl compares the groups' {metric!r}, Tether their total rewards"
        _dynamic(m, (fe, fm), _DYNAMIC_NOTE.format(peer="verl", cap=why) + diff)
        if batches == 1:
            m.problem(f"{m.name(fx)}=1 allows no extra generation batch; Tether needs a cap ≥ 1.")
        else:
            m.put("learner.max_extra_prompts_per_cycle", cap, (fx, "data.gen_batch_size"), why)
    else:
        for key in (fm, fx, "algorithm.filter_groups.filter_function"):
            m.drop(key, "dynamic filtering is off in the peer config")
    mode = m.get(_A + "policy_loss.loss_mode", "vanilla")
    if m.given(_A + "policy_loss.loss_mode"):
        _put_loss(
            m,
            _A + "policy_loss.loss_mode",
            {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}.get(mode),
        )
    if mode == "gspo":
        m.put(
            "learner.loss_agg",
            "seq-mean-token-mean",
            _A + "policy_loss.loss_mode",
            "verl aggregates GSPO as seq-mean-token-mean whatever loss_agg_mode says",
        )
    _verl_rollout_correction(m)
    for base in (
        "reward_model.reward_kwargs.overlong_buffer_cfg.",
        "reward_model.overlong_buffer.",
    ):
        if m.get(base + "enable", False):
            _overlong_penalty(m, base + "len", base + "penalty_factor", base + "enable")


def _put_loss(m: Mapper, key: str, loss: str | None) -> None:
    if loss is None:
        m.drop(key, "Tether's policy_loss is ppo, gspo or cispo")
        return
    m.put("learner.policy_loss", loss, key)
    if loss != "ppo" and "dual_clip" in m.res.tether.get("learner", {}):
        del m.res.tether["learner"]["dual_clip"]
        m.res.mapping = [k for k in m.res.mapping if k.tether_key != "learner.dual_clip"]
        m.res.unmapped.append(
            (m.name(key), loss, f"the peer applies no dual clip to {loss}: dual_clip left out")
        )


def _verl_rollout_correction(m: Mapper) -> None:
    level, thr = m.get(_RC + "rollout_is"), m.get(_RC + "rollout_is_threshold", 2.0)
    if level == "token":
        m.put(
            "learner.off_policy",
            "tis",
            _RC + "rollout_is",
            "w = min(π_old / π_rollout, cap) per token",
        )
        m.put("learner.is_cap", thr, _RC + "rollout_is_threshold")
    elif level is not None:
        m.drop(_RC + "rollout_is", "Tether's importance weight is per token; use rollout_is=token")
    if m.get(_RC + "bypass_mode", m.get(_RC + "bypass_old_logprob_for_rollout", False)):
        m.put(
            "learner.off_policy",
            "none",
            _RC + "bypass_mode",
            "bypass: the ratio is anchored to the rollout log-probs",
        )
        if m.res.tether.get("learner", {}).pop("is_cap", None) is not None:
            m.res.mapping = [k for k in m.res.mapping if k.tether_key != "learner.is_cap"]
            m.res.unmapped.append(
                (m.name(_RC + "rollout_is_threshold"), thr, "no weight to cap in bypass mode")
            )
    rs = m.get(_RC + "rollout_rs")
    if rs is None:
        return
    options = [o.strip() for o in str(rs).split(",") if o.strip()]
    spec = m.get(_RC + "rollout_rs_threshold", thr)
    lower = m.get(_RC + "rollout_rs_threshold_lower")  # older verl: a separate lower bound
    specs = str(spec).split(",") if isinstance(spec, str) else [spec]
    table = {"token_k1": "token", "token": "token", "seq_sum_k1": "sequence",
             "sequence": "sequence", "seq_mean_k1": "geometric", "geometric": "geometric"}  # fmt: skip
    for i, option in enumerate(options):
        level_name = table.get(option)
        bounds = _bounds(specs[min(i, len(specs) - 1)])
        if level_name is None or bounds is None:
            m.drop(
                _RC + "rollout_rs", f"{option!r} has no Tether equivalent (ratio bounds only: *_k1)"
            )
            continue
        if lower is not None:
            bounds[0] = float(lower)
        low, high = bounds
        note = "masked tokens leave verl's loss denominator but stay in Tether's"
        if option.endswith("_k1"):  # older verl's token / sequence / geometric bound r itself
            bounds = [1.0 / high, 1.0 / low]
            note = (
                f"verl tests −log r against [log {low:g}, log {high:g}] for *_k1 (its code, Jan "
                f"2026), i.e. keeps r in [1/{high:g}, 1/{low:g}], written so here; " + note
            )
        m.put(
            f"learner.mismatch_mask_{level_name}",
            bounds,
            (_RC + "rollout_rs", _RC + "rollout_rs_threshold"),
            note,
        )


def _overlong_penalty(m: Mapper, length: str, factor: str, *keys: str) -> None:
    if m.given(length):
        m.put(
            "scorer.overlong_buffer_tokens",
            int(m.get(length)),
            (length, *keys),
            "same linear penalty",
        )
        m.put("scorer.overlong_penalty", m.get(factor, 1.0), factor, m.default_note(factor, 1.0))


def _openrlhf(m: Mapper) -> None:
    if m.get("dynamic_filtering", False):
        low, high = m.get("dynamic_filtering_reward_range", [0, 1])
        _dynamic(
            m,
            ("dynamic_filtering", "dynamic_filtering_reward_range"),
            _DYNAMIC_NOTE.format(peer="OpenRLHF", cap="derived: 2 × prompts_per_cycle")
            + f"; OpenRLHF keeps a group when {low} < mean reward < {high}, the same as 'rewards "
            f"differ' only for rewards in {{{low}, {high}}}",
        )
    loss = m.get("policy_loss_type", "ppo")
    if m.given("policy_loss_type"):
        _put_loss(m, "policy_loss_type", {"ppo": "ppo", "gspo": "gspo"}.get(loss))
    if m.get("enable_vllm_is_correction", False) and loss == "ppo":
        low, high = m.get("vllm_is_truncated_threshold", [0.5, 5.0])
        kind = m.get("vllm_is_correction_type", "tis")
        keys = ("enable_vllm_is_correction", "vllm_is_truncated_threshold")
        m.put("learner.off_policy", "tis", keys, "weights π_old / π_vllm per token")
        floor = (
            ""
            if kind != "tis"
            else f"; OpenRLHF also raises weights below {low} to it, Tether does not"
        )
        m.put("learner.is_cap", float(high), keys, f"{kind}: the weight's upper bound" + floor)
        if kind == "icepop":
            m.put(
                "learner.mismatch_mask_token",
                [float(low), float(high)],
                "vllm_is_correction_type",
                "icepop",
            )
        elif kind == "seq-mask-tis":
            m.put(
                "learner.mismatch_mask_geometric",
                [float(low), float(high)],
                "vllm_is_correction_type",
                "OpenRLHF keeps the token weights of kept sequences uncapped; Tether caps them at is_cap",
            )
    _overlong_penalty(m, "overlong_buffer_len", "overlong_penalty_factor")


_SLIME_FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


def _slime(m: Mapper) -> None:
    path = m.get("dynamic_sampling_filter_path")
    if path is not None and str(path).startswith(_SLIME_FILTER):
        _dynamic(
            m,
            "dynamic_sampling_filter_path",
            _DYNAMIC_NOTE.format(peer="slime", cap="derived: 2 × prompts_per_cycle"),
        )
        m.drop("over_sampling_batch_size", "Tether sizes extra prompts by the observed filter rate")
    elif path is not None:
        m.drop(
            "dynamic_sampling_filter_path",
            "a custom filter; Tether filters equal-reward groups only",
        )
    est = m.get("advantage_estimator", "grpo")
    if est in ("gspo", "cispo"):
        m.put(
            "learner.policy_loss",
            est,
            "advantage_estimator",
            "slime's GSPO/CISPO use GRPO advantages",
        )
    if m.get("use_tis", False):
        m.put("learner.off_policy", "tis", "use_tis", "weights π_old / π_rollout per token")
        m.put("learner.is_cap", m.get("tis_clip", 2.0), "tis_clip", m.default_note("tis_clip", 2.0))
        if m.get("tis_clip_low", 0) > 0:
            m.drop("tis_clip_low", "Tether does not raise small weights to a floor")
