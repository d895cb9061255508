"""The quantize kernels' part of the kernel benchmark: bit-exact codes and scales against the oracle, then timings."""
from __future__ import annotations

import json

import torch

from benchmarks.kernel_bench.harness import bench, check, log, record
from kernels import reference as ref
from kernels.quantize import quantize_rows


def run_quantize(dev, quick):
    log("== activation quantize")
    for M, K in [(256, 4096), (33, 6144), (128, 2048)]:  # 1 row of 256 / 512 blocks, 2 rows of 128 per program
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * torch.exp(torch.randn(M, 1, device=dev) * 2)
        x[0, :64] = 0
        for fmt in ("nvfp4", "mxfp4"):
            q = quantize_rows(x, fmt, guidance=True, fake_dtype=torch.bfloat16)
            q = type(q)(q.packed.cpu(), q.scales.cpu(), q.outer.cpu(), q.mantissa.cpu(), fmt, q.fake.cpu())
            q0 = quantize_rows(x, fmt)  # the variant the W4A4 GEMM calls (no mantissa bits, no dequantized output)
            plain = torch.equal(q0.packed.cpu(), q.packed) and torch.equal(q0.scales.cpu(), q.scales)
            xc = x.cpu()  # the oracle runs on the CPU: on CUDA, torch evaluates `t / 6.0` as t * (1/6) (see NOTES.md)
            if fmt == "nvfp4":
                c, s, o = ref.nvfp4_quantize(xc.float(), outer="row")
                ok = torch.equal(q.outer, o)
                deq = ref.nvfp4_dequantize(c, s, o)
            else:
                c, s = ref.mxfp4_quantize(xc.float())
                ok = True
                deq = ref.mxfp4_dequantize(c, s)
            parts = dict(outer=ok, codes=torch.equal(q.packed, ref.pack_fp4(c)), scales=torch.equal(q.scales, s),
                         mant=torch.equal(q.mantissa, ref.pack_bits(c & 1)),
                         fake_bf16=float((q.fake != deq.to(torch.bfloat16)).float().mean()) < 1e-3, plain=plain)
            det = {k2: v2 for k2, v2 in parts.items()}
            if not all(parts.values()):
                bad = (ref.unpack_fp4(q.packed) != c).nonzero()[:3].tolist()
                sb = (q.scales != s).nonzero()[:3].tolist()
                det.update(first_code_mismatch=bad, first_scale_mismatch=sb,
                           outer_mismatch=int((q.outer != o).sum()) if fmt == "nvfp4" else 0)
                if not plain:  # the codes-only variant against the guidance variant (equal to the oracle or not)
                    pc = ref.unpack_fp4(q0.packed.cpu()) != ref.unpack_fp4(q.packed)
                    det.update(plain_codes_differ=int(pc.sum()), plain_first_code=pc.nonzero()[:3].tolist(),
                               plain_scales_differ=int((q0.scales.cpu() != q.scales).sum()),
                               plain_repeat_equal=torch.equal(quantize_rows(x, fmt).packed.cpu(), q0.packed.cpu()))
                if sb:
                    r0, b0 = sb[0]
                    det.update(kernel_scale=int(q.scales[r0, b0]), ref_scale=int(s[r0, b0]),
                               amax=float(xc[r0, b0 * 16:(b0 + 1) * 16].float().abs().max()), outer=float(o[r0, 0]) if fmt == "nvfp4" else 0)
            check(f"quantize {fmt} {M}x{K} bit-exact", all(parts.values()), json.dumps(det))
            # the rounding by threshold compares (fma_rtn=False; the default rounds on the FMA pipe), plain and with
            # guidance bits, against the oracle
            for name, kw in (("compares", dict(fma_rtn=False)),):
                qf, qg = quantize_rows(x, fmt, **kw), quantize_rows(x, fmt, guidance=True, **kw)
                fparts = dict(codes=torch.equal(qf.packed.cpu(), ref.pack_fp4(c)), scales=torch.equal(qf.scales.cpu(), s),
                              guide_codes=torch.equal(qg.packed.cpu(), ref.pack_fp4(c)),
                              mant=torch.equal(qg.mantissa.cpu(), ref.pack_bits(c & 1)))
                if fmt == "nvfp4":
                    fparts["outer"] = torch.equal(qf.outer.cpu(), o)
                fparts["codes_differ"] = int((ref.unpack_fp4(qf.packed.cpu()) != c).sum())
                check(f"quantize {fmt} {M}x{K} {name} bit-exact",
                      all(v is True for k, v in fparts.items() if k != "codes_differ"), json.dumps(fparts))
    # 16384x2048: one 2048-wide chunk per row, the tile v2k moved to 8 warps (Qwen3-30B-A3B's hidden width)
    shapes = [(8192, 4096), (16384, 2048)] + ([] if quick else [(256, 2048), (4096, 14336)])
    for M, K in shapes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        # (format, guidance bits, dequantized rows, rounding on the FMA pipe (the default) or by compares ("-cmp"))
        for fmt, guide, fake, fma in (("nvfp4", False, False, True), ("nvfp4", True, False, True),
                                      ("mxfp4", False, False, True), ("nvfp4", False, True, True),
                                      ("nvfp4", False, False, False), ("nvfp4", True, False, False),
                                      ("mxfp4", False, False, False)):
            blk = 16 if fmt == "nvfp4" else 32
            nbytes = (M * K * 2 + M * K // 2 + M * K // blk + (4 * M if fmt == "nvfp4" else 0) + (M * K // 8 if guide else 0)
                      + (M * K * 2 if fake else 0))
            fd = torch.bfloat16 if fake else None
            t = bench(lambda: quantize_rows(x, fmt, guidance=guide, fake_dtype=fd, check_finite=False, fma_rtn=fma))
            record("quantize", f"{M}x{K}", f"triton-{fmt}{'+guide' if guide else ''}{'+dequant' if fake else ''}"
                   f"{'' if fma else '-cmp'}", t, nbytes)
        if M * K <= 8192 * 4096 and not quick:
            t = bench(lambda: ref.nvfp4_quantize(x.float(), outer="row"))
            record("quantize", f"{M}x{K}", "torch-reference-nvfp4", t, M * K * 2 + M * K // 2 + M * K // 16 + 4 * M)


# MMA tiles timed around a config: (words per K-tile BKW, weight rows BN, warps, stages), the bf16 decode
