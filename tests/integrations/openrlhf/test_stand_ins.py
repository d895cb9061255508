"""The flash-attn / vLLM stand-ins: OpenRLHF imports with them, and the pad helpers round-trip."""
import sys

import torch

from trace.integrations.openrlhf import stand_ins


def test_openrlhf_modules_import_with_stand_ins():
    stand_ins.install()
    import openrlhf.cli.train_ppo_ray  # noqa: F401
    import openrlhf.trainer.ppo_utils.samples_generator as sg
    from transformers.utils import is_flash_attn_2_available
    assert sg.SamplingParams is sys.modules["vllm"].SamplingParams
    # transformers must not think flash-attn is usable because a stand-in module exists
    assert not (stand_ins.is_stand_in("flash_attn") and is_flash_attn_2_available())


def test_unpad_pad_round_trip():
    x = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    rows, idx, cu, max_len, _ = stand_ins.unpad_input(x, mask)
    assert rows.shape == (9, 4) and cu.tolist() == [0, 3, 8, 9] and max_len == 5
    back = stand_ins.pad_input(rows, idx, 3, 5)
    assert torch.equal(back[mask.bool()], x[mask.bool()])
    assert bool((back[~mask.bool()] == 0).all())
