"""Advantage estimators for critic-free policy-gradient RL (GRPO family, RLOO, REINFORCE++).

Everything here is sequence-level unless the name says "token": one scalar reward per
response goes in, one scalar advantage per response comes out, and the caller broadcasts it
to that response's tokens. `group_index[i]` names the prompt that response `i` answers
(responses to the same prompt form a group); group ids need not be contiguous or sorted.

Standard deviations are *population* standard deviations (divide by n, `unbiased=False`) unless
`unbiased_std=True`: a group of size 1 then has std 0 rather than NaN, and a group whose rewards
are all equal gets advantage exactly 0. verl and TRL use the unbiased std (divide by n - 1);
pass `unbiased_std=True` to reproduce their numbers (groups of size 1 then use std 1).
Arithmetic is done in float64 and the result is cast back to the rewards' dtype.
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


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    estimator: str,
    norm_by_std: bool = True,
    unbiased_std: bool = False,
    eps: float = 1e-6,
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
    folded into per-token rewards, use `token_rewards_with_kl` then `whiten_tokens` instead
    (whitening over tokens, as REINFORCE++ does with token-level returns).
    """
    import torch

    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid ones: {ESTIMATORS}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _check_rewards(rewards, group_index)
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
    matter. Rows with no valid token get all-zero rewards and returns. For REINFORCE++ with a
    KL reward, the advantages are `whiten_tokens(G, mask)`.
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
