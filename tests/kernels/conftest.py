"""Device and tolerances of the kernel tests, which run on a CUDA GPU as well as in the Triton interpreter.

DEV is "cuda" when a GPU is present and the interpreter is off (`kernels._common.INTERPRET`, set by
tests/conftest.py where there is no GPU), else "cpu". Inputs are generated on the CPU with seeded
generators (the same values on every device) and moved with `dev()` for the kernel call; the oracle
(`kernels/reference.py`) runs on the CPU copies, because torch itself rounds some divisions
differently on CUDA (kernels/NOTES.md); kernel outputs come back with `host()` before comparing.

What holds on each device (DESIGN.md §6a):
- Quantize codes, scale bytes, outer scales and mantissa bits: bit-exact on both (the GPU casts to
  E4M3 in hardware, the interpreter by integer arithmetic, because its fp8 cast neither saturates nor
  rounds correctly).
- FP32 FMA kernels (GEMV paths): relative Frobenius error TOL = 1e-5 on both; only the summation
  order differs from the oracle (and FP32 atomics order under split-K).
- Tensor-core paths (`tl.dot`): the interpreter dots in FP32 (`input_precision="ieee"`, its BF16 dot
  works on raw bit patterns), the GPU in BF16 with FP32 accumulation. Decoded FP4 operands are exact
  in BF16; FP32 activations are rounded to BF16 on the GPU, so the tests feed BF16-exact activations
  (`bf16_exact`) and the only GPU difference left is the tensor cores' summation (TOL_MMA). Where an
  FP32 intermediate is read by a second dot (MoE h, attention P), the GPU rounds it to BF16; those
  GPU tolerances (TOL_MOE_MMA, TOL_ATTN) are >= 5x that rounding's effect on the tests' own inputs
  (rounding the intermediate in the oracle on the CPU) and below the GPU benchmark's 2e-2.
- `tl.dot` needs K >= 16 on the GPU; the dot's K in the FP4 GEMM/MoE kernels is BKW (words per
  K-tile), so explicit MMA configs use MMA_KW: BKW=4 and one warp in the interpreter (small tiles,
  several K-iterations), BKW=16 and four warps on the GPU.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kernels._common import INTERPRET

ON_GPU = torch.cuda.is_available() and not INTERPRET
DEV = torch.device("cuda" if ON_GPU else "cpu")

TOL = 1e-5
# The GPU tolerances are checked on the CPU against emulations of the GPU's roundings on the tests'
# own inputs (the *_gpu_tolerance_* tests, which run everywhere): each is >= 5x the emulated error.
# GPU: BF16 x BF16 products are exact in FP32, but tensor cores do not round each FP32 addition to
# nearest (they truncate, on the generations measured in the literature); truncating every add in
# the emulation gives at most 5.5e-6 on test_gemm's inputs.
GPU_TOL_MMA = 1e-4
TOL_MMA = GPU_TOL_MMA if ON_GPU else TOL
# GPU: the MoE down GEMM reads h = silu(g) * u (FP32) as BF16, up to 2^-9 per element (rounding h
# in the oracle instead: 1.4e-3 to 1.9e-3 on test_moe's inputs); the GPU benchmark allows 2e-2.
GPU_TOL_MOE_MMA = 1e-2
TOL_MOE_MMA = GPU_TOL_MOE_MMA if ON_GPU else TOL
# GPU: the P @ V dot reads P * 2^7/S_enc as BF16 (rounded in the oracle: up to 6.6e-4 on
# test_attention's inputs); the GPU benchmark allows 2e-2.
GPU_TOL_ATTN = 5e-3
TOL_ATTN = GPU_TOL_ATTN if ON_GPU else TOL
MMA_KW = dict(BKW=16, num_warps=4) if ON_GPU else dict(BKW=4, num_warps=1)


def _to_dev(t):
    return tuple(_to_dev(u) for u in t) if isinstance(t, (tuple, list)) else t.to(DEV)


def dev(*ts):
    """CPU tensors (or tuples of them) -> DEV; one argument gives one result, several a tuple."""
    out = tuple(_to_dev(t) for t in ts)
    return out[0] if len(ts) == 1 else out


def host(x):
    """Kernel outputs -> CPU: a tensor, a tuple of them, or a dataclass of tensors (QuantizedRows,
    FP4KVCache)."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return tuple(host(t) for t in x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: host(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if isinstance(getattr(x, f.name), torch.Tensor)})
    raise TypeError(f"host() takes tensors or a dataclass of tensors, got {type(x).__name__}")


def bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """FP32 values that BF16 represents exactly, so the GPU's BF16 operand rounding is a no-op."""
    return x.bfloat16().float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a kernel output (any device) against a CPU oracle."""
    a = a.cpu().float()
    return float((a - b).norm() / b.norm())


_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, sig, cst, keys, options, wide = json.loads(sys.argv[1])
# as a launch specializes them: pointers and the integers the host keeps multiples of 16
names = list(sig)
attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in names if sig[k].startswith("*") or k in wide}
fn = getattr(importlib.import_module(module), name)
if type(fn).__name__.startswith("Gluon"):
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
src = ASTSource(fn=fn, signature=sig, constexprs=cst, attrs=attrs)
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
print(json.dumps(dict({k: ck.asm["ptx"].count(k) for k in keys}, shared=ck.metadata.shared)))
"""


def compile_sm90(module: str, name: str, sig: dict, constexprs: dict, keys, num_warps: int, wide=(),
                 options=None) -> dict:
    """Compile the Triton or Gluon kernel `module.name` for sm_90 (no GPU needed) in a fresh process (the interpreter
    that other kernel tests run in this process patches Triton's language in place, which breaks a real compile) ->
    how often each PTX string of `keys` occurs, and the shared memory in bytes. wide: integer arguments compiled as
    multiples of 16; options: the launch's compile options (e.g. enable_fp_fusion) beside num_warps."""
    import pytest

    pytest.importorskip("triton.experimental.gluon")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    job = json.dumps([module, name, sig, constexprs, list(keys), dict(options or {}, num_warps=num_warps), list(wide)])
    out = subprocess.run([sys.executable, "-c", _COMPILE, job], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
