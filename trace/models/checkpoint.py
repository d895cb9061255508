"""Save / load a model + tokenizer as a local Hugging Face directory (safetensors, no hub access).

``save_checkpoint`` writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer files with ``save_pretrained``. ``load_checkpoint`` reads them back with the Auto classes from
that directory only (``local_files_only=True``), re-applying the attention / experts implementations
the registry uses, because transformers does not serialize those into ``config.json``.
``check_checkpoint_model(name, ckpt_dir)`` compares a checkpoint's ``config.json`` with the registry
config of model ``name`` (model type and shape fields), so a run cannot train one architecture while
recording another. Compared against: tests/test_cli.py (mismatch errors of the entry points).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trace.models.registry import ATTN_IMPLEMENTATION, EXPERTS_IMPLEMENTATION, build_config


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


# Fields that fix the architecture and the parameter shapes (the union over the four families; a
# field absent from either side is not compared).
SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
    "max_position_embeddings",
)


def check_checkpoint_model(name: str, ckpt_dir: str | os.PathLike) -> None:
    """Raise ValueError when the checkpoint in ``ckpt_dir`` is not an instance of registry model ``name``
    (KeyError for an unknown name). Reads ``config.json`` only, no weights."""
    want = build_config(name, check_fp4=False).to_dict()
    cfg_path = Path(ckpt_dir) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(ckpt_dir)!r}")
    have = json.loads(cfg_path.read_text())
    diff = [f"{k} {have[k]!r} (model {want[k]!r})" for k in SHAPE_FIELDS
            if k in have and k in want and have[k] != want[k]]
    if diff:
        raise ValueError(f"checkpoint {str(ckpt_dir)!r} does not match model={name!r}: " + ", ".join(diff))


__all__ = ["SHAPE_FIELDS", "check_checkpoint_model", "load_checkpoint", "save_checkpoint"]
