"""Export a trained policy's FP4 weights as a compressed-tensors NVFP4 Hugging Face directory.

    python -m trace.export --ckpt RUN_DIR_or_CKPT --format compressed-tensors-nvfp4 --out DIR

What is written (DIR):
- `model.safetensors`: for every linear the rollout engine quantizes (`trace.rollout.weights.QUANTIZED`:
  attention q/k/v/o, the experts' gate/up/down, the shared expert's and dense MLPs' gate/up/down) the tensors
  `<module>.weight_packed` (uint8 [out, in/2], element 2i in the low nibble), `<module>.weight_scale`
  (float8_e4m3fn [out, in/16], the E4M3 block-scale bytes) and `<module>.weight_global_scale` (float32 [1]);
  every other tensor (router, `shared_expert_gate`, norms, biases, embeddings, lm_head) in BF16, the dtype
  the engine keeps them in. Module names are the on-disk Hugging Face names that transformers' own
  `save_pretrained` writes (experts unfused, one module per expert; Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`),
  which is what vLLM's model loaders read.
- `config.json`: the checkpoint's config with dtype bfloat16 and a compressed-tensors `quantization_config`
  (format `nvfp4-pack-quantized`, weights 4-bit float, strategy `tensor_group`, group 16, E4M3 scales; the
  unquantized linears listed in `ignore`); the other files of the checkpoint (tokenizer, generation config).

The codes and scales are `trace.fp4.quantize_weight` of the checkpoint's master tensors as stored, the very
call the engine's weight loader makes (trace/rollout/weights.py), so they are bit-identical to the engine's.

Scale conventions. compressed-tensors dequantizes `w = e2m1 * weight_scale / weight_global_scale`: its global
scale is in the encode direction, like our S_enc (DESIGN.md §2: `x_hat = q * s_b / S_enc`), so S_enc is
written as it is. Our weight S_enc is per tensor, and per expert for the fused experts (one S_enc for an
expert's gate and up rows together), which maps one to one onto a per-module `weight_global_scale`. Two things
do not map:
- Activations: the engine's activation S_enc is dynamic per token row, while compressed-tensors' NVFP4 W4A4
  scheme takes one static `input_global_scale` per module. The export therefore declares W4A16
  (`input_activations: null`, compressed-tensors' NVFP4A16 scheme), and a server computes with BF16
  activations.
- vLLM fuses q/k/v into one qkv_proj and a dense or shared MLP's gate/up into one gate_up_proj, and dequantizes
  such a fused layer with the largest of its shards' global scales
  (vllm compressed_tensors_w4a16_nvfp4.py, `weight_global_scale.max()`). Where the shards' S_enc differ (per-tensor
  scales generally do) a vLLM server would not compute with these weights, so the export refuses with one line
  unless `--allow-fused-scale-mismatch` is given; the file is then exact for compressed-tensors' decompressor
  and for the experts, o_proj and down_proj in vLLM (expert gate/up share one S_enc). Compared against:
  tests/test_export.py (engine codes bit for bit; compressed-tensors' own decompressor; logits).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from trace import fp4
from trace.models.registry import family_of
from trace.rollout.weights import LAYER_NAMES, QUANTIZED, Arch

FORMAT = "compressed-tensors-nvfp4"
CT_VERSION = "0.20.1"  # the compressed-tensors release whose format is written (and tested against)
_SKIP_FILES = {"config.json", "trainer_state.pt", "model.safetensors.index.json"}
# experts' on-disk module names (gate, up, down) and the MoE block's name, by family
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_DEFAULT_EXPERTS = ("mlp", ("gate_proj", "up_proj", "down_proj"))
# linears vLLM fuses into one layer (one global scale for all shards), by their keys in LAYER_NAMES
_FUSED = (("q", "k", "v"), ("sg", "su"), ("mg", "mu"))


class ExportError(Exception):
    """A checkpoint that cannot be exported as asked; its message is the one line the command prints."""


def _disk_name(family: str, name: str) -> str:
    """The on-disk (save_pretrained) name of an in-memory tensor name outside the fused experts."""
    block, _ = _EXPERT_NAMES.get(family, _DEFAULT_EXPERTS)
    return name.replace(".mlp.", f".{block}.") if block != "mlp" and ".layers." in name else name


def _fp4_entries(module: str, t: fp4.FP4Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' three tensors of one 2-D FP4 weight [out, in] with a scalar S_enc."""
    return {f"{module}.weight_packed": t.packed().clone(),  # own storage each: safetensors refuses shared memory
            f"{module}.weight_scale": t.scales.clone().view(torch.float8_e4m3fn),
            f"{module}.weight_global_scale": t.outer.reshape(1).to(torch.float32).clone()}


def _expert_entries(family: str, layer: int, key: str, t: fp4.FP4Tensor) -> dict[str, torch.Tensor]:
    """One fused expert weight (gate_up [E, 2I, H] or down [E, H, I]) as per-expert modules."""
    block, (g, u, d) = _EXPERT_NAMES.get(family, _DEFAULT_EXPERTS)
    out: dict[str, torch.Tensor] = {}
    for e in range(t.codes.shape[0]):
        one = fp4.FP4Tensor(t.codes[e], t.scales[e], t.outer[e], t.fmt, t.block_2d, t.dtype)
        prefix = f"model.layers.{layer}.{block}.experts.{e}"
        if key == "down":
            out.update(_fp4_entries(f"{prefix}.{d}", one))
            continue
        half = one.codes.shape[0] // 2
        for proj, rows in ((g, slice(0, half)), (u, slice(half, None))):
            out.update(_fp4_entries(f"{prefix}.{proj}", fp4.FP4Tensor(
                one.codes[rows], one.scales[rows], one.outer, one.fmt, one.block_2d, one.dtype)))
    return out


def _check_fused(family: str, layer: int, q: dict[str, fp4.FP4Tensor]) -> str | None:
    """The first fused group of `layer` whose shards' S_enc differ, as words, or None."""
    for group in _FUSED:
        have = [k for k in group if k in q]
        vals = {float(q[k].outer) for k in have}
        if len(vals) > 1:
            names = [_disk_name(family, f"model.layers.{layer}.{LAYER_NAMES[k]}").removesuffix(".weight")
                     for k in have]
            return f"{', '.join(names)} (S_enc {sorted(vals)})"
    return None


def export_state_dict(config, sd: dict[str, torch.Tensor], allow_fused_scale_mismatch: bool = False):
    """(tensors to write, names of the unquantized linears) from a model's in-memory state dict.
    Raises ExportError where vLLM's fused layers would need one global scale and the shards' differ."""
    family = family_of(config)
    arch = Arch.from_config(config)
    if arch.num_layers == 0:
        raise ExportError("the checkpoint has no layers")
    quantized_names = set()
    out: dict[str, torch.Tensor] = {}
    for i in range(arch.num_layers):
        q: dict[str, fp4.FP4Tensor] = {}
        for key in QUANTIZED:
            name = f"model.layers.{i}.{LAYER_NAMES[key]}"
            if name not in sd:
                continue
            quantized_names.add(name)
            q[key] = fp4.quantize_weight(sd[name].detach(), "nvfp4")  # the engine's call (weights.py)
            if key in ("gate_up", "down"):
                out.update(_expert_entries(family, i, key, q[key]))
            else:
                out.update(_fp4_entries(_disk_name(family, name).removesuffix(".weight"), q[key]))
        bad = _check_fused(family, i, q)
        if bad is not None and not allow_fused_scale_mismatch:
            raise ExportError(
                f"refused: vLLM fuses {bad} into one layer and dequantizes it with the largest global scale, "
                "so it would serve other weights than the engine's; pass --allow-fused-scale-mismatch to write "
                "the file anyway (exact for compressed-tensors' decompressor)")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    ignore = []
    for name, t in sd.items():
        if name in quantized_names or (tied and name == "lm_head.weight"):
            continue
        disk = _disk_name(family, name)
        out[disk] = t.detach().to(torch.bfloat16).contiguous()
        if t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "norm" not in name:
            ignore.append(disk.removesuffix(".weight"))  # router, shared_expert_gate, lm_head
    return out, sorted(ignore)


def quantization_config(ignore: list[str]) -> dict:
    """compressed-tensors' `quantization_config` for NVFP4 weights with BF16 activations (W4A16)."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
               "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
             "format": "nvfp4-pack-quantized"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignore,
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}, "version": CT_VERSION}


def _run_fmt(ckpt: Path) -> str | None:
    """rl.fmt of the run that wrote ckpt (DIR/ckpt/step_N/), where its config.yaml is there."""
    import yaml

    cfg = ckpt.parent.parent / "config.yaml"
    if not cfg.is_file():
        return None
    data = yaml.safe_load(cfg.read_text()) or {}
    return (data.get("rl") or {}).get("fmt")


def export(ckpt, out, fmt: str = FORMAT, allow_fused_scale_mismatch: bool = False) -> Path:
    """Write the export of checkpoint (or run dir) `ckpt` to the new directory `out`; returns out."""
    from trace.models import load_checkpoint
    from trace.rundir import resolve_checkpoint

    if fmt != FORMAT:
        raise ExportError(f"--format must be {FORMAT}, got {fmt!r}")
    try:
        src = resolve_checkpoint(ckpt)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    run_fmt = _run_fmt(src)
    if run_fmt not in (None, "nvfp4"):
        raise ExportError(f"the run trained with rl.fmt={run_fmt!r}; {FORMAT} holds NVFP4 weights only")
    dst = Path(out)
    if dst.exists() and any(dst.iterdir()):
        raise ExportError(f"--out {str(dst)!r} exists and is not empty")
    model, _ = load_checkpoint(src, dtype="auto", load_tokenizer=False)  # the master tensors as stored
    tensors, ignore = export_state_dict(model.config, dict(model.state_dict()), allow_fused_scale_mismatch)
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config(ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():  # tokenizer and generation config
        if f.is_file() and f.name not in _SKIP_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trace.export", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint dir (config.json) or a run dir (ckpt/latest)")
    p.add_argument("--format", default=FORMAT, help=f"export format (only {FORMAT})")
    p.add_argument("--out", required=True, help="new output directory")
    p.add_argument("--allow-fused-scale-mismatch", action="store_true",
                   help="write the file even where vLLM's fused q/k/v or gate/up layers would use another scale")
    a = p.parse_args(argv)
    try:
        dst = export(a.ckpt, a.out, a.format, a.allow_fused_scale_mismatch)
    except ExportError as e:
        print(f"trace.export: {e}", file=sys.stderr)
        return 2
    print(f"trace.export: wrote {dst} (NVFP4 weights, BF16 activations: compressed-tensors W4A16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
