"""Save / load a model + tokenizer as a local Hugging Face directory (safetensors, no hub access).

``save_checkpoint`` writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer files with ``save_pretrained``. ``load_checkpoint`` reads them back with the Auto classes from
that directory only (``local_files_only=True``), re-applying the attention / experts implementations
the registry uses, because transformers does not serialize those into ``config.json``.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trace.models.registry import ATTN_IMPLEMENTATION, EXPERTS_IMPLEMENTATION


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | os.PathLike,
    max_shard_size: str = "5GB",
) -> Path:
    """Write ``model`` (safetensors) and ``tokenizer`` to ``out_dir``; returns the directory path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    experts_implementation: str = EXPERTS_IMPLEMENTATION,
    load_tokenizer: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load ``(model, tokenizer)`` saved by :func:`save_checkpoint` (or any local HF causal-LM dir).

    The model is returned in eval mode. ``dtype="auto"`` keeps the dtype recorded in the checkpoint.
    The tokenizer is ``None`` if ``load_tokenizer`` is False.
    """
    path = Path(ckpt_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        local_files_only=True,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if load_tokenizer else None
    return model, tokenizer


__all__ = ["load_checkpoint", "save_checkpoint"]
