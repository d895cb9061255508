"""The policy actor's metrics lines are `trace.metrics.StepMetrics` records, the names analysis/ reads (its mismatch
metrics are the embedded trainer's: both call trace.guidance.mismatch; tests/test_metrics.py checks the fields)."""
import torch

from trace.integrations.openrlhf.actor import metrics_line, positions


def test_metrics_line_and_positions():
    status = {"reward": 0.5, "accuracy": 0.25, "k3": 1e-4, "policy_loss": 0.1, "ppo_loss": 0.09,
              "code_flip_rate/3": 0.2, "code_flip_rate/2": 0.1, "actor_grad_norm": 1.0}
    rec = metrics_line(4, "trace", status, kl_on=False).to_dict()
    assert rec["step"] == 4 and rec["reward_mean"] == 0.5 and rec["k3"] == 1e-4
    assert rec["code_flip_rate"] == {3: 0.2, 2: 0.1} and rec["loss"] == 0.1 and rec["policy_loss"] == 0.09
    assert "align_scales_share" not in rec  # an arm without the alignment term logs no parts
    rec = metrics_line(5, "trace", {**status, "align_codes_hinge": 0.1, "align_scales_share": 0.75},
                       kl_on=False).to_dict()
    assert rec["align_codes_hinge"] == 0.1 and rec["align_scales_share"] == 0.75
    att = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert positions(att).tolist() == [[0, 1, 2, -1], [0, 1, 2, 3]]
