"""PPO math after OpenRLHF: KL estimators, token rewards, GAE, advantage whitening, clipped losses, KL controllers.

Pure torch, tensor in and tensor out; shapes in the docstrings. B = batch of sequences, T = response (action)
positions. ``action_mask`` (B, T) is 1 on real response tokens (EOS included) and 0 on the padding after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .gspo import gspo_log_ratio
from .losses import last_token_index, masked_mean, masked_sum
from .vocab import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, KLEstimator, LossAggregation, PolicyLoss


def approx_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor | None = None,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens, with d = logprobs - ref_logprobs.

    k1 = d; k2 = d**2 / 2; k3 = exp(-d) - 1 + d (non-negative, unbiased; Schulman's "k3"), with d first clamped to
    [-10, 10] for k3 so that exp never overflows: its value and gradient stay finite for any d (at d = -100 the
    unclamped exp(100) is inf in float32 and the backward pass gives 0 * inf = NaN). So k3 saturates at
    e^10 - 1 - 10 -> 10 (after the final clamp) for d <= -10 and at e^-10 - 1 + 10 = 9.0000454 for d >= 10.

    Args:
        logprobs: (B, T) log pi(a_t) of the sampled tokens under the policy.
        ref_logprobs: (B, T) the same under the reference model.
        action_mask: (B, T) or None (= every position counts).
        estimator: "k1", "k2" or "k3".
    Returns:
        (B, T), clamped to [-10, 10], 0 where ``action_mask`` is 0.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = d.square() / 2
    elif estimator == "k3":
        d = d.clamp(-10.0, 10.0)
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
    kl = kl.clamp(-10.0, 10.0)
    if action_mask is not None:
        # where, not multiply: an inf/nan log-prob on a padding position must not leak through 0 * inf.
        kl = torch.where(action_mask.bool(), kl, torch.zeros_like(kl))
    return kl


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, action_mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Dense PPO rewards: a KL penalty on every action token plus the sequence score on the last one.

    Args:
        scores: (B,) reward-model score of each sequence (already normalised/clipped if wanted).
        kl: (B, T) per-token KL estimate (see :func:`approx_kl`).
        action_mask: (B, T).
        kl_coef: the KL coefficient beta.
    Returns:
        (B, T): r_t = -kl_coef * kl_t, plus ``scores[b]`` at the last action token of row b; 0 on padding
        (a row without action tokens is all 0).
    """
    mask = action_mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    last = last_token_index(action_mask)  # (B,)
    score_at_last = torch.zeros_like(rewards).scatter_(1, last.unsqueeze(1), scores.to(kl.dtype).unsqueeze(1))
    return rewards + score_at_last * mask


def normalize_scores(scores: torch.Tensor, mean: float, std: float, eps: float = 1e-8) -> torch.Tensor:
    """(scores - mean) / (std + eps), with the reward model's stored statistics. Any shape in, same shape out."""
    return (scores - mean) / (std + eps)


def clip_scores(scores: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Clamp scores to [low, high]. Any shape in, same shape out."""
    return scores.clamp(low, high)


def apply_missing_eos_penalty(scores: torch.Tensor, truncated: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """Add ``penalty`` (usually negative) to the score of each response cut at max_new_tokens without an EOS.

    Args:
        scores: (B,) reward-model scores.
        truncated: (B,) bool, True where the response had no EOS (see ``batching.ensure_eos``).
        penalty: added where ``truncated``; None = no penalty (``scores`` returned unchanged).
    Returns:
        (B,) ``scores + penalty`` where ``truncated``, ``scores`` elsewhere.
    """
    if penalty is None:
        return scores
    return torch.where(truncated.bool(), scores + penalty, scores)


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, backwards over the action tokens of each row.

    For an action token t (mask 1), with n = the next action token after t in the row:
    delta_t = r_t + gamma * V_n - V_t;  A_t = delta_t + gamma * lam * A_n;  returns_t = A_t + V_t.
    V and A after the last action token count as 0. Masked positions (padding, and holes inside a response such as
    tool output) are not time steps: the recursion skips them, carrying V_n and A_n across unchanged, so the tokens
    before a hole still see the reward after it. With a contiguous mask this is the usual GAE over t, t+1, ...

    Args:
        rewards: (B, T) from :func:`token_rewards`.
        values: (B, T) critic values V(s_t) from the rollout.
        action_mask: (B, T).
        gamma: discount.
        lam: GAE lambda.
    Returns:
        (advantages, returns), both (B, T), 0 where ``action_mask`` is 0; no grad.
    """
    keep = action_mask.bool()
    mask = keep.to(values.dtype)
    # where, not multiply: a non-finite value or reward on a masked position must not leak through 0 * inf.
    values = torch.where(keep, values, torch.zeros_like(values))
    rewards = torch.where(keep, rewards.to(values.dtype), torch.zeros_like(values))
    T = rewards.size(1)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * mask[:, t]
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def _whiten_from_sums(
    x: torch.Tensor, mask: torch.Tensor, sums: torch.Tensor, shift_mean: bool, divide_std: bool, eps: float
) -> torch.Tensor:
    # sums = [sum(x*m), sum(x^2*m), sum(m)] in float64, local or all-reduced; population variance E[x^2] - E[x]^2.
    count = sums[2].clamp(min=1.0)
    mean = sums[0] / count
    var = (sums[1] / count - mean.square()).clamp(min=0.0)
    out = x.double()
    if shift_mean:
        out = out - mean
    if divide_std:
        out = out * torch.rsqrt(var + eps)
    return (out * mask).to(x.dtype)


def _masked_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x64, m64 = x.double(), mask.double()
    return torch.stack([(x64 * m64).sum(), (x64.square() * m64).sum(), m64.sum()])


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, divide_std: bool = True
) -> torch.Tensor:
    """Whiten ``x`` with the mean and population variance (divide by the count) of its masked entries.

    shift_mean=True (default): (x - mean) / sqrt(var + eps).
    shift_mean=False: x / sqrt(var + eps) -- scaled by the same std, the mean NOT subtracted.
    divide_std=False: no division -- with shift_mean=True this is x - mean, which is what OpenRLHF's
    ``--algo.advantage.no_std_norm`` does (mean only). Note that is the opposite of shift_mean=False.

    Args:
        x: any shape, e.g. (B, T) advantages.
        mask: same shape, 0/1.
    Returns:
        same shape and dtype as ``x``; 0 where ``mask`` is 0. Statistics are computed in float64.
    """
    mask = mask.to(x.dtype)
    return _whiten_from_sums(x, mask, _masked_sums(x, mask), shift_mean, divide_std, eps)


def distributed_masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
    divide_std: bool = True,
) -> torch.Tensor:
    """:func:`masked_whiten` with the statistics of the union of every data-parallel rank's masked entries.

    ``all_reduce_sum`` sums [sum(x*m), sum(x^2*m), sum(m)] (float64) over the data-parallel ranks in place; every
    rank must call it. The math knows no process group: the caller passes its device-aware collective
    (``DeepSpeedStrategy.all_reduce_sum``). With None this is exactly :func:`masked_whiten`.

    Args:
        x: any shape, this rank's part (e.g. (B_rank, T) advantages; B and T may differ between ranks).
        mask: same shape, 0/1.
        all_reduce_sum: in-place SUM over the ranks of a float64 tensor of 3 elements; None = this rank alone.
    Returns:
        same shape and dtype as ``x``; 0 where ``mask`` is 0.
    """
    mask = mask.to(x.dtype)
    sums = _masked_sums(x, mask)
    if all_reduce_sum is not None:
        sums = all_reduce_sum(sums)
    return _whiten_from_sums(x, mask, sums, shift_mean, divide_std, eps)


def policy_loss_tokens(
    pi_logprobs: torch.Tensor,
    pi_old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    policy_loss: PolicyLoss = "ppo",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO clipped surrogate loss, with clip-higher, dual clip, importance weights and GSPO's ratio.

    ratio = exp(clamp(pi_logprobs - pi_old_logprobs, -20, 20)); ``policy_loss="gspo"``: GSPO-token's ratio
    s_i,t (value: the row's sequence ratio s_i, gradient: logp_t's; ``gspo.gspo_log_ratio``), clipped the same way;
    loss_t = -min(ratio * A_t, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A_t);
    dual clip (Ye et al. 2020), where A_t < 0: loss_t = min(loss_t, -dual_clip * A_t), so that a token whose ratio
    has run far above 1 + eps contributes at most dual_clip x |A| (and no gradient);
    ``is_weights``: loss_t * w_t (the off-policy correction between rollout engine and trainer, no grad;
    ``is_correction.is_correction_weights``).

    Args:
        pi_logprobs: (B, T) log-probs under the policy being trained (with grad).
        pi_old_logprobs: (B, T) log-probs under the rollout policy.
        advantages: (B, T).
        action_mask: (B, T).
        clip_eps_low: the ratio's lower bound is 1 - clip_eps_low.
        clip_eps_high: its upper bound is 1 + clip_eps_high ("clip-higher", DAPO); None = clip_eps_low.
        dual_clip: c > 1, or None for no dual clip.
        is_weights: (B, T) weights, or None.
        policy_loss: "ppo" (token ratio) or "gspo" (sequence ratio).
    Returns:
        (loss_t, stats): (B, T), 0 where ``action_mask`` is 0; ``clip_frac`` = fraction of action tokens where the
        clipped term is the (strict) minimum; ``approx_kl`` = token mean of pi_old_logprobs - pi_logprobs;
        ``dual_clip_frac`` = fraction of action tokens where the dual-clip bound is the (strict) active one; gspo:
        ``seq_ratio`` = mean of s_i over the rows with an action token.
    """
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {policy_loss!r}; choose one of {POLICY_LOSSES}")
    log_ratio = (pi_logprobs - pi_old_logprobs).clamp(-20.0, 20.0)
    gspo = policy_loss == "gspo"
    ratio = (gspo_log_ratio(pi_logprobs, pi_old_logprobs, action_mask) if gspo else log_ratio).exp()
    surr = ratio * advantages
    surr_clipped = ratio.clamp(1 - clip_eps_low, 1 + high) * advantages
    loss_t = -torch.min(surr, surr_clipped)
    dual_active = torch.zeros_like(loss_t, dtype=torch.bool)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (bound < loss_t)
        loss_t = torch.where(dual_active, bound, loss_t)
    if is_weights is not None:
        loss_t = loss_t * is_weights.detach()
    keep = action_mask.bool()
    loss_t = torch.where(keep, loss_t, torch.zeros_like(loss_t))
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((surr_clipped < surr).to(surr.dtype), action_mask).item(),
            "approx_kl": masked_mean(-log_ratio, action_mask).item(),
            "dual_clip_frac": masked_mean(dual_active.to(surr.dtype), action_mask).item(),
        }
        if gspo:
            rows = action_mask.sum(1) > 0
            stats["seq_ratio"] = ratio[:, 0][rows].mean().item() if bool(rows.any()) else 1.0
    return loss_t, stats


def aggregate_loss(
    loss_t: torch.Tensor,
    action_mask: torch.Tensor,
    mode: LossAggregation = "token_mean",
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """A per-token loss reduced to a scalar.

    token_mean: sum_t(loss_t * m_t) / num_tokens (every token weighs the same);
    seq_mean: sum over the rows with an action token of (the row's token mean) / num_sequences (every sequence
    weighs the same, whatever its length);
    seq_sum_norm (Dr. GRPO): sum over rows of (the row's token sum / norm_len) / num_sequences, a constant length
    instead of each row's own.

    Args:
        loss_t: (B, T) per-token loss.
        action_mask: (B, T).
        mode: one of :data:`LOSS_AGGREGATIONS`.
        num_tokens: token_mean's denominator; None = this batch's action tokens (at least 1). With a window's count
            (``role_base.WindowNorm``) every token of a gradient-accumulation window weighs the same.
        num_sequences: the sequence modes' denominator; None = this batch's rows with an action token (at least 1).
        norm_len: seq_sum_norm's constant length (> 0), e.g. rollout.max_new_tokens.
    Returns:
        scalar.
    """
    mask = action_mask.to(loss_t.dtype)
    if mode == "token_mean":
        tokens = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return masked_sum(loss_t, mask) / tokens
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")
    has_tokens = mask.sum(1) > 0
    sequences = has_tokens.sum().clamp(min=1).to(loss_t.dtype) if num_sequences is None else num_sequences
    if mode == "seq_mean":
        return masked_mean(loss_t, mask, dim=1)[has_tokens].sum() / sequences
    if norm_len is None or not norm_len > 0:
        raise ValueError(f"loss aggregation seq_sum_norm needs norm_len > 0 (the constant length), got {norm_len}")
    return (masked_sum(loss_t, mask, dim=1) / norm_len).sum() / sequences


def policy_loss(
    pi_logprobs: torch.Tensor,
    pi_old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss: token mean over the action tokens of the batch, or token sum / ``num_tokens``
    (:func:`policy_loss_tokens` with a symmetric clip, reduced by :func:`aggregate_loss` token_mean).

    ratio = exp(clamp(pi_logprobs - pi_old_logprobs, -20, 20));
    loss_t = -min(ratio * A_t, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A_t).

    Args:
        pi_logprobs: (B, T) log-probs under the policy being trained (with grad).
        pi_old_logprobs: (B, T) log-probs under the rollout policy.
        advantages: (B, T).
        action_mask: (B, T).
        clip_eps: epsilon of the ratio clip.
        num_tokens: None = token mean over this batch's action tokens; a number (or scalar tensor) =
            sum_t(loss_t * mask_t) / num_tokens, e.g. the action tokens of the whole accumulation window so that
            every token of the window weighs the same (see ``losses.window_loss_scale``).
    Returns:
        (loss, stats): scalar loss; ``clip_frac`` = fraction of action tokens where the clipped term is the
        (strict) minimum, so its gradient is 0; ``approx_kl`` = token mean of pi_old_logprobs - pi_logprobs. The
        stats are token means over this batch whatever ``num_tokens`` is.
    """
    loss_t, stats = policy_loss_tokens(pi_logprobs, pi_old_logprobs, advantages, action_mask, clip_eps)
    stats.pop("dual_clip_frac")
    return aggregate_loss(loss_t, action_mask, "token_mean", num_tokens=num_tokens), stats


def kl_loss_tokens(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: KLEstimator = "k3",
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) as a loss term (GRPO's kl_mode=loss), with its gradient through ``logprobs``.

    :func:`approx_kl` of the current log-probs; with ``old_logprobs`` (the unbiased option, DeepSeek-V3.2) times the
    ratio pi / pi_old = exp(clamp(logprobs - old_logprobs, -20, 20)), which keeps its gradient: the samples come
    from pi_old, and the ratio makes the estimate that of the KL under pi. For k3 with d = logprobs - ref_logprobs:
    d k3 / d logprobs = 1 - e^-d; with the ratio at pi = pi_old the gradient is k3 + 1 - e^-d = d.

    Args:
        logprobs: (B, T) log-probs under the policy being trained (with grad).
        ref_logprobs: (B, T) under the reference.
        action_mask: (B, T).
        estimator: "k1", "k2" or "k3".
        old_logprobs: (B, T) under the rollout policy, or None.
    Returns:
        (B, T), 0 where ``action_mask`` is 0.
    """
    kl = approx_kl(logprobs, ref_logprobs, action_mask, estimator)
    if old_logprobs is not None:
        kl = kl * (logprobs - old_logprobs).clamp(-20.0, 20.0).exp()
    return torch.where(action_mask.bool(), kl, torch.zeros_like(kl))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float | None = 0.5,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: token mean over the action tokens of the batch, or token sum / ``num_tokens``.

    v_clip = old + clamp(v - old, -c, c);  loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2).
    ``clip_eps=None``: loss_t = 0.5 * (v - R)^2.

    Args:
        values: (B, T) critic values being trained (with grad).
        old_values: (B, T) critic values from the rollout.
        returns: (B, T) GAE returns.
        action_mask: (B, T).
        clip_eps: c, or None for no clipping.
        num_tokens: None = token mean over this batch's action tokens; a number (or scalar tensor) =
            sum_t(loss_t * mask_t) / num_tokens (see :func:`policy_loss`).
    Returns:
        (loss, stats): scalar loss; ``value_clip_frac`` = fraction of action tokens of this batch where the
        clipped term is the (strict) maximum (0.0 without clipping).
    """

    def reduce(loss_t: torch.Tensor) -> torch.Tensor:
        if num_tokens is None:
            return masked_mean(loss_t, action_mask)
        return masked_sum(loss_t, action_mask) / num_tokens

    err = (values - returns).square()
    if clip_eps is None:
        return 0.5 * reduce(err), {"value_clip_frac": 0.0}
    values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    err_clipped = (values_clipped - returns).square()
    loss = 0.5 * reduce(torch.max(err, err_clipped))
    with torch.no_grad():
        clip_frac = masked_mean((err_clipped > err).to(err.dtype), action_mask).item()
    return loss, {"value_clip_frac": clip_frac}


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al. 2019, OpenRLHF ``kl_controller.py``).

    update: error = clip(current_kl / target - 1, -0.2, 0.2);  value *= 1 + error * n_steps / horizon.
    """

    def __init__(self, init_value: float, target: float, horizon: float):
        self.value = float(init_value)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # Only the evolving coefficient: target and horizon come from the config of the resumed run.
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    init_value: float, target: float | None = None, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """Fixed controller when ``target`` is None, adaptive otherwise."""
    if init_value < 0:
        raise ValueError(f"KL coefficient must be >= 0, got {init_value}")
    if target is None:
        return FixedKLController(init_value)
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
    return AdaptiveKLController(init_value, target, horizon)
