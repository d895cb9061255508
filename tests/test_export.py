"""trace.export (compressed-tensors NVFP4): for the four families' tiny flavors, the written codes, E4M3 scales
and global scales equal the rollout engine's (trace/rollout/weights.py) bit for bit; compressed-tensors' own
decompressor (0.20.1, where installed) gives the trainer's fake-quantized weights, and the decompressed model's
logits equal the trainer's weight-only fake-quant forward; the names are transformers' on-disk names."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from trace import fp4
from trace.export import ExportError, export, main
from trace.models import build_model, list_models, save_checkpoint
from trace.rollout.weights import Arch, EngineWeights

FAMILIES = [n.removesuffix("-tiny") for n in list_models(flavor="tiny")]
EXPERTS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
DEFAULT = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def _exported(tmp_path, family):
    model = build_model(f"{family}-tiny", seed=3, dtype=torch.bfloat16)
    ckpt = save_checkpoint(model, None, tmp_path / "ckpt")
    out = export(ckpt, tmp_path / "out", allow_fused_scale_mismatch=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return model, ckpt, out, tensors


def _disk(family, name):
    block = EXPERTS.get(family, DEFAULT)[0]
    return name.replace(".mlp.", f".{block}.") if ".layers." in name else name


def _gather(family, name, tensors, part):
    """One in-memory weight's `part` (packed, scale, global_scale) from the file, experts re-fused."""
    block, (g, u, d) = EXPERTS.get(family, DEFAULT)
    if ".experts." not in name:
        return tensors[f"{_disk(family, name).removesuffix('.weight')}.weight_{part}"]
    layer = name.split(".")[2]
    n_exp = sum(1 for k in tensors if k.startswith(f"model.layers.{layer}.{block}.experts.") and k.endswith(
        f".{d}.weight_packed"))
    per = []
    for e in range(n_exp):
        pre = f"model.layers.{layer}.{block}.experts.{e}"
        if name.endswith("down_proj"):
            per.append(tensors[f"{pre}.{d}.weight_{part}"])
        elif part == "global_scale":
            gs, us = tensors[f"{pre}.{g}.weight_{part}"], tensors[f"{pre}.{u}.weight_{part}"]
            assert torch.equal(gs, us)  # one S_enc for an expert's gate and up rows
            per.append(gs)
        else:
            per.append(torch.cat([tensors[f"{pre}.{g}.weight_{part}"], tensors[f"{pre}.{u}.weight_{part}"]]))
    return torch.stack(per)


@pytest.mark.parametrize("family", FAMILIES)
def test_codes_and_scales_are_the_engines(tmp_path, family):
    model, _, out, tensors = _exported(tmp_path, family)
    eng = EngineWeights.load(Arch.from_config(model.config), model, "w4a4", "nvfp4", torch.bfloat16, "cpu")
    assert eng.fp4
    for name, t in eng.fp4.items():
        assert torch.equal(fp4.unpack(_gather(family, name, tensors, "packed")), t.codes), name
        scale = _gather(family, name, tensors, "scale")
        assert scale.dtype == torch.float8_e4m3fn
        assert torch.equal(scale.view(torch.uint8), t.scales), name
        gs = _gather(family, name, tensors, "global_scale")
        assert gs.dtype == torch.float32 and torch.equal(gs.reshape(-1), t.outer.reshape(-1)), name
    # every other tensor in BF16; together the names are those transformers' save_pretrained writes
    quantized = {k.removesuffix("_packed") for k in tensors if k.endswith(".weight_packed")}
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == quantized | {k for k in tensors if not k.rsplit(".", 1)[-1].startswith("weight_")}
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k.endswith((".weight", ".bias")))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"] and all(not k.startswith(tuple(f"{i}." for i in qc["ignore"]))
                                             for k in tensors if "weight_packed" in k)


def _decompressed_state_dict(family, out, tensors):
    """The exported directory read back through compressed-tensors' NVFP4 decompressor, in-memory names."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme

    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert isinstance(scheme, QuantizationScheme) and ct.__version__ == "0.20.1"
    preset = preset_name_to_scheme("NVFP4A16", ["Linear"])  # the scheme vLLM's W4A16 FP4 path takes
    assert scheme.weights == preset.weights and scheme.input_activations is None and scheme.targets == ["Linear"]
    assert scheme.format == qc.format == "nvfp4-pack-quantized"
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    dense, spec = {}, {}
    for k in [k for k in tensors if k.endswith(".weight_packed")]:
        mod = k.removesuffix(".weight_packed")
        sd = {p: tensors[f"{mod}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
        dense[f"{mod}.weight"] = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        # the same codes and scales (compressed-tensors' unpacking) in DESIGN.md §2's order: q * s_b / S_enc
        m, n = sd["weight_packed"].shape
        q = unpack_fp4_from_uint8(sd["weight_packed"], m, 2 * n, torch.float32).unflatten(-1, (-1, 16))
        w = q * sd["weight_scale"].float().unsqueeze(-1) / sd["weight_global_scale"]
        spec[f"{mod}.weight"] = w.flatten(-2).to(torch.bfloat16)
    dense.update({k: v for k, v in tensors.items() if not k.rsplit(".", 1)[-1].startswith("weight_")})
    return _in_memory(family, dense), _in_memory(family, {**dense, **spec})


def _in_memory(family, dense):
    """Disk names -> transformers' in-memory names (experts fused into gate_up_proj / down_proj)."""
    dense = dict(dense)
    block, (g, u, d) = EXPERTS.get(family, DEFAULT)
    sd, layers = {}, {int(k.split(".")[2]) for k in dense if ".experts." in k}
    for i in layers:
        pre = f"model.layers.{i}.{block}.experts"
        n = sum(1 for k in dense if k.startswith(f"{pre}.") and k.endswith(f".{d}.weight"))
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([dense.pop(f"{pre}.{e}.{g}.weight"), dense.pop(f"{pre}.{e}.{u}.weight")]) for e in range(n)])
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([dense.pop(f"{pre}.{e}.{d}.weight")
                                                                     for e in range(n)])
    for k, v in dense.items():
        sd[k.replace(f".{block}.", ".mlp.") if block != "mlp" else k] = v
    return sd


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_round_trip_is_the_trainers_fake_quant(tmp_path, family):
    from trace.qat.patch import patch_model, runtime

    model, _, out, tensors = _exported(tmp_path, family)
    sd, spec = _decompressed_state_dict(family, out, tensors)
    patch_model(model, "w4a16")
    rt = runtime(model)
    own = dict(model.state_dict())
    assert sd.keys() == own.keys() == spec.keys()
    n_quant = n_off = 0
    for k, w in own.items():
        fq = rt.weight(w) if k.endswith(("_proj", "proj.weight")) and "shared_expert_gate" not in k else w
        if fq is w:
            assert torch.equal(sd[k], w), k
            continue
        n_quant += fq.numel()
        # the stored numbers, dequantized in DESIGN.md's order, are the trainer's fake-quantized weights
        assert torch.equal(spec[k], fq), k
        # compressed-tensors' decompressor divides the block scale by the global scale before multiplying by
        # the code: one more float32 rounding, so a few values land one bf16 ulp away
        assert sd[k].dtype == torch.bfloat16
        off = sd[k] != fq
        n_off += int(off.sum())
        ulps = (sd[k].view(torch.int16).int() - fq.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, k
    assert n_quant > 0 and n_off <= n_quant // 200
    # logits: the decompressed weights in the plain transformers model vs the trainer's fake-quant forward
    served = build_model(f"{family}-tiny", seed=0, dtype=torch.bfloat16)
    served.load_state_dict(sd, strict=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(ids).logits.float(), served(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))


def test_refusals_are_one_line(tmp_path, capsys):
    model = build_model("olmoe-tiny", seed=1, dtype=torch.bfloat16)
    ckpt = save_checkpoint(model, None, tmp_path / "ckpt")
    assert main(["--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2  # q/k/v S_enc differ
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trace.export:")]
    assert len(err) == 1
    err = err[0]
    assert "self_attn.q_proj" in err and "--allow-fused-scale-mismatch" in err
    assert not (tmp_path / "o").exists()
    assert main(["--ckpt", str(ckpt), "--out", str(tmp_path / "o"), "--format", "gguf"]) == 2
    with pytest.raises(ExportError, match="no checkpoint"):
        export(tmp_path / "nothing", tmp_path / "o2")
