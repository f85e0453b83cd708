"""A batch of one optimizer step takes its old log-probs from the training forward, detached: the ratio is 1 on every
token and the gradient is the plain policy gradient -A x w (w: the IS weight), for every policy loss and clip option,
the unbiased KL term's as well, by hand."""

import pytest
import torch

from rlhf_core.algos.ppo import kl_loss_tokens, policy_loss_tokens

LOGP = torch.tensor([[-0.7, -1.3, -0.2, -2.0], [-0.4, -0.9, -1.1, 0.0]])
ADV = torch.tensor([[1.5, -2.0, 0.5, 1.0], [-0.5, 3.0, -1.0, 2.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
WEIGHTS = torch.tensor([[0.5, 1.0, 2.0, 1.0], [1.0, 0.0, 1.5, 1.0]])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"clip_eps_high": 0.28, "dual_clip": 3.0},
        {"is_weights": WEIGHTS},
        {"policy_loss": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    ],
)
def test_the_detached_training_logprobs_make_ratio_one_and_the_plain_policy_gradient(options):
    logp = LOGP.clone().requires_grad_(True)
    loss_t, stats = policy_loss_tokens(logp, logp.detach(), ADV, MASK, **options)
    w = options.get("is_weights", torch.ones_like(ADV))
    torch.testing.assert_close(loss_t * MASK, -ADV * w * MASK)  # ratio 1: the surrogate is -A x w
    assert stats["clip_frac"] == 0.0
    (loss_t * MASK).sum().backward()
    # GSPO's token form too: d s_i,t / d logp_t = s_i = 1
    torch.testing.assert_close(logp.grad, (-ADV * w * MASK).float())


def test_the_unbiased_kl_term_with_detached_old_logprobs_keeps_its_score_function_gradient():
    ref = torch.tensor([[-1.0, -1.0, -0.5, -1.5], [-0.2, -1.2, -1.0, -0.3]])
    logp = LOGP.clone().requires_grad_(True)
    kl_t = kl_loss_tokens(logp, ref, MASK, "k1", old_logprobs=logp.detach())
    torch.testing.assert_close(kl_t, (LOGP - ref) * MASK)
    kl_t.sum().backward()
    # d/dlogp [(logp - ref) x exp(logp - old)] at old = logp: 1 + (logp - ref)
    torch.testing.assert_close(logp.grad, (1 + LOGP - ref) * MASK)
