"""Pin a Hugging Face decoder's layer inputs to given values, with a straight-through gradient.

What: `pinned_inputs(model, streams)` is a context in which decoder layer i of `model.model.layers` receives
`streams[i]` as its hidden-state input and the final norm `model.model.norm` receives `streams[-1]`, each as
`s + (h - h.detach())`: the value is `s` (cast to h's dtype), the gradient with respect to h is the identity. The
exact arm (DESIGN.md §4 "Exact on-policy arm") passes the rollout engine's residual stream at each layer boundary
(`RolloutEngine.score(streams=...)`), so each layer's straight-through QAT backward is evaluated at the engine's own
activations, and the chain between layers is the straight-through identity, while the log-prob values come from the
engine. Outside the context the model is unchanged (the hooks are removed on exit).

    with pinned_inputs(model, streams):      # streams: L + 1 tensors [B, T, H]
        logits = model(input_ids=ids, attention_mask=att).logits

Compared against: tests/qat/test_pin.py (a pinned forward gives the logits of the run the streams came from, bit for
bit, and its gradient reaches every layer).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def _straight_through(value: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if value.shape != h.shape:
        raise ValueError(f"pinned value {tuple(value.shape)} does not match the layer input {tuple(h.shape)}")
    v = value.to(device=h.device, dtype=h.dtype)
    return v + (h - h.detach()) if h.requires_grad else v


@contextlib.contextmanager
def pinned_inputs(model: nn.Module, streams: list[torch.Tensor]):
    """Inside the context, decoder layer i's input is streams[i] and the final norm's streams[-1] (straight-through
    gradient); len(streams) must be the number of layers + 1."""
    layers = list(model.model.layers)
    if len(streams) != len(layers) + 1:
        raise ValueError(f"need {len(layers) + 1} streams (one per layer input and the final norm's), got {len(streams)}")

    def hook_for(value):
        def hook(_module, args, kwargs):
            if args:
                return (_straight_through(value, args[0]), *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = _straight_through(value, kwargs["hidden_states"])
            return args, kwargs
        return hook

    handles = [layer.register_forward_pre_hook(hook_for(s), with_kwargs=True) for layer, s in zip(layers, streams[:-1], strict=True)]
    handles.append(model.model.norm.register_forward_pre_hook(hook_for(streams[-1]), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


__all__ = ["pinned_inputs"]
