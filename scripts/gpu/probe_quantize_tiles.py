"""Where the quantize kernel's codes part from the reference ops on this GPU: `trace.fp4.quantize_weight`
(and per-row RTN) on the Triton kernel (TRACE_FP4_KERNELS=on) against the reference (off), at mixtral-small's
expert down projection (8 x 512 x 1792) and its slices, fp32 and bf16, at random widths K, and with the kernel's
tile forced (warps, one chunk or several) at the failing case. Per case: how many codes and scale bytes differ
and, where codes do, which rows and columns, with the first differing block's values.

    PYTHONPATH=$PWD python3 scripts/gpu/probe_quantize_tiles.py

Compared against: `kernels/reference.py` through trace.fp4's reference path. kernels/NOTES.md v2k has what it
printed on an H200 (fp32, 2048-wide chunks at 4 warps: every row's first 1024 columns wrong, scales exact).
`tests/kernels/test_quantize.py::test_every_gpu_tile_bit_exact` keeps the tiles the GPU gets exact.
"""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from kernels import quantize as kq  # noqa: E402
from trace import fp4  # noqa: E402
from trace.models import build_model  # noqa: E402

DEV = "cuda"


def compare(w: torch.Tensor, tag: str, outer: str | None = None) -> None:
    """Print how the kernel's codes and scales of w (per weight rule, or per `outer`) differ from the reference's."""
    got = {}
    for mode in ("off", "on"):
        os.environ["TRACE_FP4_KERNELS"] = mode
        got[mode] = fp4.quantize_weight(w) if outer is None else fp4.quantize(w, "nvfp4", outer)
    r, k = got["off"], got["on"]
    dc, ds = k.codes != r.codes, k.scales != r.scales
    msg = (f"{tag:40s} shape={tuple(w.shape)} {w.dtype} codes_diff={int(dc.sum())} scales_diff={int(ds.sum())} "
           f"outer_diff={int((k.outer != r.outer).sum())}")
    if dc.any():
        K = w.shape[-1]
        idx = dc.reshape(-1, K).nonzero()
        cols = idx[:, 1].unique()
        r0, b = int(idx[0, 0]), int(idx[0, 1]) // 16
        xs = w.reshape(-1, K)[r0, b * 16:(b + 1) * 16].float()
        msg += (f"\n   rows with a difference {idx[:, 0].unique().numel()}/{dc.numel() // K}, columns "
                f"{int(cols.min())}..{int(cols.max())} ({cols.numel()})"
                f"\n   row {r0} block {b}: x[:6]={[f'{v:.4g}' for v in xs[:6].tolist()]} amax={float(xs.abs().max()):.4g}"
                f"\n   ref codes={r.codes.reshape(-1, K)[r0, b * 16:b * 16 + 16].tolist()} "
                f"scale={int(r.scales.reshape(-1, K // 16)[r0, b])}"
                f"\n   ker codes={k.codes.reshape(-1, K)[r0, b * 16:b * 16 + 16].tolist()} "
                f"scale={int(k.scales.reshape(-1, K // 16)[r0, b])}")
    print(msg, flush=True)


def main() -> None:
    torch.manual_seed(0)
    p = dict(build_model("mixtral-small", seed=0).named_parameters())["model.layers.0.mlp.experts.down_proj"].detach()
    scale = torch.exp2(torch.linspace(-3, 3, p.shape[-1]))  # blocks of unequal scale, as the GPU test has
    for dt in (torch.float32, torch.bfloat16):
        w = (p * scale).to(DEV, dt)
        compare(w, "down_proj, scaled columns")
        compare(p.to(DEV, dt), "down_proj")
        compare(w[:2, :64].contiguous(), "the CPU test's slice [:2, :64]")
        compare(w[:1].contiguous(), "one expert")
        compare(w[:, :1].contiguous(), "one row per expert")
        compare(w.reshape(-1, w.shape[-1]), "2-D, per tensor")
        compare(w.reshape(-1, w.shape[-1]), "2-D, per row", outer="row")
    for K in (512, 1024, 1536, 1792, 2048, 2560, 3584, 4096):
        compare((torch.randn(8, 512, K) * torch.exp2(torch.linspace(-3, 3, K))).to(DEV), f"randn K={K}")
    w = (p * scale).to(DEV, torch.float32)
    chosen = kq._config
    try:
        for nw, single, ch in itertools.product((2, 4, 8, 16), (True, False), (2048, 1024)):
            if single and ch != 2048:
                continue
            kq._config = lambda M, K, block, interpret=False, nw=nw, single=single, ch=ch: (1, ch // block, single, nw)
            compare(w, f"tile: {nw} warps, one chunk {single}, chunk {ch}")
    finally:
        kq._config = chosen


if __name__ == "__main__":
    main()
