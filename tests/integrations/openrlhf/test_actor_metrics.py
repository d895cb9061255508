"""The policy actor's mismatch metrics are the embedded trainer's, and its metrics lines carry the names
analysis/ reads."""
import torch

from trace.integrations.openrlhf.actor import metrics_line, mismatch_metrics, positions
from trace.rl.losses import mismatch_metrics as trainer_metrics


def test_mismatch_metrics_equal_the_trainers():
    g = torch.Generator().manual_seed(0)
    lp_train, lp_roll = -torch.rand(4, 9, generator=g) * 3, -torch.rand(4, 9, generator=g) * 3
    mask = torch.rand(4, 9, generator=g) > 0.3
    assert mismatch_metrics(lp_train, lp_roll, mask) == trainer_metrics(lp_train, lp_roll, mask)


def test_metrics_line_and_positions():
    status = {"reward": 0.5, "accuracy": 0.25, "k3": 1e-4, "policy_loss": 0.1, "ppo_loss": 0.09,
              "code_flip_rate/3": 0.2, "code_flip_rate/2": 0.1, "actor_grad_norm": 1.0}
    rec = metrics_line(4, "trace", status, kl_on=False)
    assert rec["step"] == 4 and rec["reward_mean"] == 0.5 and rec["k3"] == 1e-4
    assert rec["code_flip_rate"] == {3: 0.2, 2: 0.1} and rec["loss"] == 0.1 and rec["policy_loss"] == 0.09
    att = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert positions(att).tolist() == [[0, 1, 2, -1], [0, 1, 2, 3]]
