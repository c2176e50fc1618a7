"""Advantage estimators for critic-free policy-gradient RL (GRPO family, RLOO, REINFORCE++).

`compute_advantages` is sequence-level: one scalar reward per response goes in, one scalar
advantage per response comes out, and the caller broadcasts it to that response's tokens.
`kl_reward_advantages` is the token-level variant used when the KL to the reference is a reward
penalty (`learner.kl_in_reward`): one advantage per response token. `group_index[i]` names the
prompt that response `i` answers (responses to the same prompt form a group); group ids need not
be contiguous or sorted.

Standard deviations are *population* standard deviations (divide by n, `unbiased=False`) unless
`unbiased_std=True` (divide by n - 1, Bessel's correction, as verl and TRL do). A group of size 1
is centred on its own reward either way, so its grpo / drgrpo / rloo advantage is 0 (and its
reinforce_pp_baseline value is 0 before the batch whitening); with `unbiased_std` its std, which
n - 1 = 0 leaves undefined, is taken as 1 only to avoid 0 / 0. So `unbiased_std=True` reproduces
verl's numbers for groups of 2 or more but not for a group of one: verl's GRPO gives such a group
mean 0 and std 1, so its advantage is the raw reward, a signal no other response confirms; Tether
keeps 0. A group whose rewards are all equal gets advantage exactly 0. Arithmetic is done in
float64 and the result is cast back to the rewards' dtype.

**Episodes of several segments** (an agent whose conversation broke token continuity,
``services/generator/agent/episodes.py``): `episode_of[i] = j` says sample i is a segment of the
episode whose statistics row is sample j (j = i for the row itself), so group means, stds, sizes
and batch whitening count each episode once, and every segment gets its episode's advantage;
`episode_of[i] = -1` leaves sample i out (advantage 0: an episode whose agent failed). Without
`episode_of` every sample is its own episode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def _check_rewards(rewards: torch.Tensor, group_index: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (one reward per response), got shape {tuple(rewards.shape)}"
        )
    if group_index.shape != rewards.shape:
        raise ValueError(
            f"group_index shape {tuple(group_index.shape)} must equal rewards shape "
            f"{tuple(rewards.shape)}: pass the prompt/group id of every response"
        )
    if group_index.dtype.is_floating_point or group_index.dtype.is_complex:
        raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")


def _group_stats(
    values: torch.Tensor, group_index: torch.Tensor, *, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group std, group size), gathered back to each sample."""
    import torch

    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.bincount(inverse, minlength=n_groups).to(values.dtype)
    sums = values.new_zeros(n_groups).index_add_(0, inverse, values)
    mean = sums / counts
    sq = (values - mean[inverse]) ** 2
    sq_sums = values.new_zeros(n_groups).index_add_(0, inverse, sq)
    if unbiased:
        # A group of one has no spread to estimate: use std 1 (the advantage is 0 anyway).
        std = torch.where(counts > 1, (sq_sums / (counts - 1).clamp(min=1)).sqrt(), 1.0)
    else:
        std = (sq_sums / counts).sqrt()
    return mean[inverse], std[inverse], counts[inverse]


def _whiten(values: torch.Tensor, *, eps: float, unbiased: bool) -> torch.Tensor:
    if values.numel() == 0:
        return values
    if unbiased and values.numel() < 2:
        return values - values.mean()
    std = values.std(unbiased=unbiased)
    return (values - values.mean()) / (std + eps)


def _episode_rows(
    episode_of: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(statistics rows, the samples that count, each such sample's position among the rows)."""
    import torch

    if episode_of.shape != (n,) or episode_of.dtype.is_floating_point:
        raise ValueError(f"episode_of must be an integer tensor of shape [{n}]")
    valid = episode_of >= 0
    rows = torch.unique(episode_of[valid])
    if rows.numel() and (int(rows.max()) >= n or not bool((episode_of[rows] == rows).all())):
        raise ValueError("episode_of must name rows that are their own episode's row")
    return rows, valid, torch.searchsorted(rows, episode_of[valid])


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    estimator: str,
    norm_by_std: bool = True,
    unbiased_std: bool = False,
    eps: float = 1e-6,
    episode_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence-level advantages, shape [N] like `rewards`.

    With r the rewards, g(i) the group of sample i, mean_g / std_g the group mean / std,
    and mean_B / std_B the mean / std over the whole batch:

    - ``grpo``: A_i = r_i - mean_g(i); divided by (std_g(i) + eps) when `norm_by_std`.
    - ``drgrpo`` (Dr. GRPO): A_i = r_i - mean_g(i), never divided by the std
      (`norm_by_std` is ignored; it is ``grpo`` with ``norm_by_std=False``).
    - ``rloo``: A_i = r_i - mean_{j in g(i), j != i} r_j = G/(G-1) * (r_i - mean_g(i)) for a group
      of size G; A_i = 0 for groups of size 1 (no other sample to form a baseline).
    - ``reinforce_pp`` (REINFORCE++): A = (r - mean_B) / (std_B + eps); groups are ignored.
    - ``reinforce_pp_baseline``: b = r - mean_g, then A = (b - mean_B(b)) / (std_B(b) + eps).

    The batch whitening of the REINFORCE++ estimators is over *sequences*. When the KL penalty is
    folded into per-token rewards, use `kl_reward_advantages` instead (token-level returns,
    whitened over tokens, as REINFORCE++ does).
    """
    import torch

    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid ones: {ESTIMATORS}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _check_rewards(rewards, group_index)
    if episode_of is not None:
        rows, valid, pos = _episode_rows(episode_of, rewards.numel())
        per_row = compute_advantages(rewards[rows], group_index[rows], estimator=estimator,
                                     norm_by_std=norm_by_std, unbiased_std=unbiased_std, eps=eps)  # fmt: skip
        out = torch.zeros_like(rewards)
        out[valid] = per_row[pos]
        return out
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.detach().to(torch.float64)

    if estimator == "reinforce_pp":
        out = _whiten(r, eps=eps, unbiased=unbiased_std)
    else:
        mean, std, size = _group_stats(r, group_index, unbiased=unbiased_std)
        centered = r - mean
        if estimator == "grpo":
            out = centered / (std + eps) if norm_by_std else centered
        elif estimator == "drgrpo":
            out = centered
        elif estimator == "rloo":
            out = torch.where(size > 1, centered * size / (size - 1).clamp(min=1), 0.0)
        else:  # reinforce_pp_baseline
            out = _whiten(centered, eps=eps, unbiased=unbiased_std)
    return out.to(rewards.dtype)


def token_rewards_with_kl(
    seq_rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty: per-token rewards and their discounted returns, both [N, T].

    With m the response mask (1 on response tokens) and t_last(i) the last position where
    m[i] == 1:

        r[i, t] = -kl_coef * kl[i, t] * m[i, t]  +  seq_rewards[i] * [t == t_last(i)]
        G[i, t] = (sum_{k >= t} gamma^(k - t) * r[i, k]) * m[i, t]

    `kl` is a per-token estimate (e.g. `losses.kl_penalty(logp, ref_logp, kind="k1")`) and is
    treated as data (detached). The discount counts tensor positions, so masked gaps inside a
    row (multi-turn) still advance the discount; with the default gamma = 1 that does not
    matter. Rows with no valid token get all-zero rewards and returns. `kl_reward_advantages`
    turns these returns into advantages for each estimator.
    """
    import torch

    if kl.shape != mask.shape or kl.dim() != 2:
        raise ValueError(f"kl {tuple(kl.shape)} and mask {tuple(mask.shape)} must both be [N, T]")
    if seq_rewards.shape != (kl.shape[0],):
        raise ValueError(
            f"seq_rewards must be [N] = [{kl.shape[0]}], got {tuple(seq_rewards.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    m = mask.detach().to(torch.float64)
    n, t = m.shape
    rewards = -kl_coef * kl.detach().to(torch.float64) * m
    has_token = m.sum(dim=1) > 0
    # Index of the last valid position: T - 1 - (first valid position of the flipped row).
    last = (t - 1) - torch.argmax(m.flip(1), dim=1)
    rows = torch.arange(n, device=m.device)[has_token]
    rewards[rows, last[has_token]] += seq_rewards.detach().to(torch.float64)[has_token]
    if gamma == 1.0:
        returns = rewards.flip(1).cumsum(dim=1).flip(1)
    else:
        returns = torch.zeros_like(rewards)
        running = m.new_zeros(n)
        for pos in range(t - 1, -1, -1):
            running = rewards[:, pos] + gamma * running
            returns[:, pos] = running
    returns = returns * m
    return rewards.to(kl.dtype), returns.to(kl.dtype)


def kl_reward_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str,
    kl_coef: float,
    norm_by_std: bool = True,
    unbiased_std: bool = False,
    eps: float = 1e-6,
    episode_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages [N, T] with the KL penalty folded into the reward; 0 where masked.

    Every response token t earns the reward -kl_coef * kl[i, t]; the response's outcome reward,
    shaped by the estimator's group rule, is added on its last token; the advantage of a token is
    built from its return (the reward-to-go, gamma = 1, see `token_rewards_with_kl`). So a token
    is charged the KL of itself and of the tokens after it, never of the ones before (they do not
    depend on it). With K[i, t] = sum_{k >= t} m[i, k] * kl[i, k]:

    - ``grpo``, ``drgrpo``, ``rloo``: A[i, t] = a_i - kl_coef * K[i, t], where a_i is
      `compute_advantages` of the outcome rewards alone (group mean, std, leave-one-out exactly
      as without KL). The KL part is NOT divided by the group's reward std: it is a penalty in
      advantage units whose strength kl_coef sets, whatever the spread of a group's rewards. (verl
      instead sums the penalised token rewards into one score per response and normalises that,
      so in a group whose rewards are all equal its std is the KL's spread alone and the KL noise
      is blown up to unit-size advantages. OpenRLHF shapes the outcome reward first, as here.)
    - ``reinforce_pp``: G[i, t] = r_i - kl_coef * K[i, t]; A = `whiten_tokens`(G) over the valid
      tokens of the whole batch (REINFORCE++'s token-level returns and token whitening).
    - ``reinforce_pp_baseline``: as ``reinforce_pp`` with r_i - mean_g(i) in place of r_i.

    `kl` is the per-token KL estimate [N, T] (treated as data), `mask` the response mask [N, T].
    Without KL (kl = 0) the GRPO family reduces to `compute_advantages` broadcast over tokens; the
    REINFORCE++ family then whitens over tokens rather than sequences.

    With `episode_of` (module docstring) the outcome statistics count each episode once; the
    KL-to-go is each segment's own, and the token whitening covers every counted sample's tokens.
    """
    import torch

    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid ones: {ESTIMATORS}")
    _check_rewards(rewards, group_index)
    if kl.dim() != 2 or kl.shape != mask.shape or kl.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"kl {tuple(kl.shape)} and mask {tuple(mask.shape)} must both be [N, T] with "
            f"N = {rewards.shape[0]} responses"
        )
    if rewards.numel() == 0 or kl.shape[1] == 0:
        return torch.zeros_like(kl, dtype=rewards.dtype)
    r = rewards.detach().to(torch.float64)
    kl64 = kl.detach().to(torch.float64)
    if episode_of is not None:
        counted = (episode_of >= 0).to(mask.dtype)
        mask = mask * counted[:, None]  # a left-out sample's tokens get no advantage
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        if estimator == "reinforce_pp_baseline":
            if episode_of is None:
                r = r - _group_stats(r, group_index, unbiased=False)[0]
            else:
                rows, valid, pos = _episode_rows(episode_of, r.numel())
                means = _group_stats(r[rows], group_index[rows], unbiased=False)[0]
                r = torch.where(valid, r, 0.0)
                r[valid] = r[valid] - means[pos]
        _, returns = token_rewards_with_kl(r, kl64, mask, kl_coef=kl_coef)
        out = whiten_tokens(returns, mask, eps=eps, unbiased_std=unbiased_std)
    else:
        outcome = compute_advantages(
            r,
            group_index,
            estimator=estimator,
            norm_by_std=norm_by_std,
            unbiased_std=unbiased_std,
            eps=eps,
            episode_of=episode_of,
        )
        _, out = token_rewards_with_kl(outcome, kl64, mask, kl_coef=kl_coef)
    return out.to(rewards.dtype)


def whiten_tokens(
    values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6, unbiased_std: bool = False
) -> torch.Tensor:
    """(values - mean) / (std + eps) over the valid tokens of the whole batch; 0 where masked."""
    import torch

    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
    valid = mask.detach().bool()
    flat = values.detach().to(torch.float64)[valid]
    out = torch.zeros_like(values, dtype=torch.float64)
    out[valid] = _whiten(flat, eps=eps, unbiased=unbiased_std)
    return out.to(values.dtype)


def equal_reward_group_mask(
    rewards: torch.Tensor, group_index: torch.Tensor, *, atol: float = 0.0
) -> tuple[torch.Tensor, int]:
    """Which samples to keep when groups whose rewards are all equal are filtered out.

    A group is filtered when max - min of its rewards is <= `atol` (such a group carries no
    signal for group-relative estimators: all its advantages are 0). Groups of size 1 are
    therefore always filtered. Returns a bool keep-mask [N] and the number of filtered groups.
    """
    import torch

    _check_rewards(rewards, group_index)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device), 0
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    r = rewards.detach().to(torch.float64)
    gmax = r.new_full((n_groups,), -torch.inf).scatter_reduce(0, inverse, r, reduce="amax")
    gmin = r.new_full((n_groups,), torch.inf).scatter_reduce(0, inverse, r, reduce="amin")
    flat_group = (gmax - gmin) <= atol
    return ~flat_group[inverse], int(flat_group.sum().item())
