"""Model registry (four MoE families x tiny/small/paper flavors), character tokenizer, checkpoints.

See ``trace/models/FAMILIES.md`` for the module trees and the patch points of each family.
"""
from trace.models.checkpoint import load_checkpoint, save_checkpoint
from trace.models.registry import (
    FAMILIES,
    FLAVORS,
    FP4_MULTIPLE,
    FamilyInfo,
    ModelSpec,
    build_config,
    build_model,
    check_fp4_dims,
    family_of,
    fp4_reduction_dims,
    get_spec,
    head_dim_of,
    list_models,
    register_family,
    unregister_family,
)
from trace.models.tokenizer import BOS_ID, CHARSET, EOS_ID, PAD_ID, UNK_ID, VOCAB_SIZE, build_tokenizer

__all__ = [
    "BOS_ID", "CHARSET", "EOS_ID", "FAMILIES", "FLAVORS", "FP4_MULTIPLE", "FamilyInfo", "ModelSpec", "PAD_ID",
    "UNK_ID", "VOCAB_SIZE", "build_config", "build_model", "build_tokenizer", "check_fp4_dims", "family_of",
    "fp4_reduction_dims", "get_spec", "head_dim_of", "list_models", "load_checkpoint", "register_family",
    "save_checkpoint", "unregister_family",
]
