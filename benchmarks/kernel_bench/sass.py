"""Offline SASS instruction counts of the kernels (`bench_kernels.py --sass`, no GPU needed)."""
from __future__ import annotations

import os
import re
import subprocess

import triton

from benchmarks.kernel_bench.harness import RUN, _emit, log

SASS_ALU_OPS = {"LOP3", "SHF", "IADD3", "SEL", "FSEL", "FSETP", "ISETP", "PRMT", "FMNMX", "IMNMX", "VIMNMX", "SGXT",
                "LEA", "MOV", "P2R", "R2P", "PLOP3", "BMSK", "FLO", "POPC", "BREV", "VIADD", "IABS", "I2FP", "F2FP"}


def _loop_sass(fn, sig, aligned, constexprs, num_warps, num_stages, name, whole=False, gluon=False):
    """Compile fn for sm_90 -> (instructions of the loop (the span of the last backward branch; of the longest for
    a Gluon kernel, whose epilogue may loop; with whole, of the kernel), op counts, TTGIR convert_layout count,
    shared bytes). gluon: fn is a Gluon kernel (its layouts and pipelining are in the source: no num_stages)."""
    import glob
    from collections import Counter

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bindir = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin"))[0]
    attrs = {(list(sig).index(k),): [["tt.divisibility", 16]] for k in aligned}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src, opts = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), dict(num_warps=num_warps)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        opts = dict(num_warps=num_warps, num_stages=num_stages)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    path = f"/tmp/{name}.cubin"
    with open(path, "wb") as f:
        f.write(ck.asm["cubin"])
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    body = [x for _, x in ins] if whole else []
    # out-of-line code after the kernel's last unpredicated EXIT (mbarrier try-wait retries of TMA loads) branches back
    # into the loop: not a loop of its own
    end = max((a for a, t in ins if t == "EXIT"), default=ins[-1][0] if ins else 0)
    if not whole:
        for a, t in ins:
            if a > end:
                break
            tg = re.search(r"BRA\s+0x([0-9a-f]+)", t)
            if tg and int(tg.group(1), 16) < a:
                span = [x for b, x in ins if int(tg.group(1), 16) <= b <= a]
                body = max(body, span, key=len) if gluon else span
    # memory and barrier instructions keep their width suffix (LDG.E.128 against STG.E.U8), the rest are grouped
    ops = Counter(op if op.startswith(("LDG", "STG", "LDS", "STS", "BAR")) else op.split(".")[0]
                  for op in (re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body))
    return len(body), ops, ck.asm["ttgir"].count("convert_layout"), ck.metadata.shared


def _mem_ops(ops, prefixes=("LDG", "UTMA", "SYNCS", "LDS", "STS")) -> str:
    """The memory and barrier instructions of a SASS op count, `name:count` sorted (a `_sass_row` stat)."""
    return " ".join(f"{k}:{v}" for k, v in sorted(ops.items()) if k.startswith(prefixes))


def _sass_row(rows, shape, provider, config, ops, **stats):
    """One offline SASS row (the loop's stats and its 8 most frequent instructions in `note`), appended and logged."""
    stats["top_ops"] = " ".join(f"{k}:{v}" for k, v in ops.most_common(8))
    rows.append(dict(op="sass", shape=shape, provider=provider, config=config,
                     note=";".join(f"{k}={v}" for k, v in stats.items())))
    log(rows[-1])


def sass_counts():
    from kernels.gemm import _fp4_gemm_kernel
    from kernels.gemv import _fp4_gemv2_kernel
    from kernels.moe import _moe_gemm_kernel

    rows = []
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "wf_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "G": "i32", "stride_xm": "i32", "g_per_split": "i32", "BN": "constexpr", "BM": "constexpr",
           "U": "constexpr", "SPLIT": "constexpr", "NIT": "constexpr", "EVEN": "constexpr", "PREFETCH": "constexpr"}
    aligned = ["x_ptr", "w_ptr", "s_ptr", "wf_ptr", "out_ptr", "N", "K", "stride_xm"]
    for bn, bm, u, nw, pf in [(32, 1, 2, 4, False), (64, 1, 2, 4, False), (16, 1, 2, 4, False), (32, 2, 2, 4, False),
                              (32, 4, 2, 4, False), (64, 4, 2, 4, False), (32, 1, 1, 4, True)]:
        cst = dict(BN=bn, BM=bm, U=u, SPLIT=1, NIT=16 // u, EVEN=not pf, PREFETCH=pf)  # K=4096: 16 groups
        n, ops, cvt, _ = _loop_sass(_fp4_gemv2_kernel, sig, aligned, cst, nw, 1, f"gemv2_{bn}_{bm}_{u}_{nw}_{int(pf)}")
        wpt = (bn // (4 * nw)) * 32 * u  # weights per thread per iteration (rows/thread * 32 * U)
        _sass_row(rows, "K4096", "_fp4_gemv2_kernel", f"BN={bn};BM={bm};U={u};num_warps={nw};prefetch={pf}", ops,
                  ttgir_convert_layouts=cvt, loop_instr=n, weights_per_thread_iter=wpt,
                  instr_per_weight=round(n / wpt, 3), instr_per_weight_row=round(n / wpt / bm, 3))
    # MoE gate/up MMA kernel (GATED), K 2048, BN 64, BKW 16, 4 warps: the v3a tile (kernels/NOTES.md v3a: one dot
    # per K-tile), decoding in fp32 and in bf16 (BF16D: inline PTX, the weight words in pair_layout); A: bf16
    # (W4A16) or dec (W4A4: the tile values its quantize pass writes, times the row's 2^7 / S_enc after the MMA)
    moe_sig = {"x_ptr": "*bf16", "xf_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wf_ptr": "*fp32",
               "out_ptr": "*bf16", "slots_ptr": "*i32", "bexp_ptr": "*i32", "rw_ptr": "*fp32", "S": "i32", "N": "i32",
               "KW": "i32", "stride_xm": "i32", "A_DIV": "i32", "BM": "constexpr", "BN": "constexpr",
               "BKW": "constexpr", "GATED": "constexpr", "ROUTE_W": "constexpr", "INTERP": "constexpr",
               "NIT": "constexpr", "BF16D": "constexpr", "XF": "constexpr"}
    moe_aligned = ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "N", "KW", "stride_xm", "slots_ptr"]
    for mode in ("bf16", "dec"):
        sig = dict(moe_sig, xf_ptr="*bf16" if mode == "bf16" else "*fp32")
        for tile, bkw, st, bf in [("v3a", 16, 3, False), ("v3a-bf16", 16, 3, True)]:
            for bm in (16, 64):
                cst = dict(BM=bm, BN=64, BKW=bkw, GATED=True, ROUTE_W=False, INTERP=False,
                           NIT=256 // bkw, BF16D=bf, XF=mode != "bf16")
                n, ops, cvt, shared = _loop_sass(_moe_gemm_kernel, sig, moe_aligned, cst, 4, st,
                                                 f"moe_{tile}_{mode}_{bm}")
                w_iter = 64 * 8 * bkw * 2  # weight elements per loop iteration (gate and up)
                _sass_row(rows, "K2048 gate+up", f"_moe_gemm_kernel {tile}",
                          f"A={mode};BM={bm};BN=64;BKW={bkw};num_warps=4;num_stages={st}", ops, loop_instr=n,
                          lane_instr_per_weight=round(n * 128 / w_iter, 2), shared_bytes=shared,
                          ttgir_convert_layouts=cvt)
    # dense MMA kernel, the default tile at 14336x4096, M 16: BM 16, BN 64, BKW 16, split-K 4 (FP32 atomics), 4 warps,
    # 3 stages, the bf16 decode; A as above. kw_per_split is divisible by 16 at every launch (a multiple of BKW), which
    # Triton's JIT specializes on, so the offline compile says so too
    dense_sig = {"x_ptr": "*bf16", "xf_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wf_ptr": "*fp32",
                 "out_ptr": "*fp32", "M": "i32", "N": "i32", "KW": "i32", "stride_xm": "i32", "kw_per_split": "i32",
                 "BM": "constexpr", "BN": "constexpr", "BKW": "constexpr", "SPLIT": "constexpr", "INTERP": "constexpr",
                 "NIT": "constexpr", "BF16D": "constexpr", "XF": "constexpr"}
    dense_aligned = ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "N", "KW", "stride_xm", "kw_per_split"]
    for mode in ("bf16", "dec"):
        sig = dict(dense_sig, xf_ptr="*bf16" if mode == "bf16" else "*fp32")
        cst = dict(BM=16, BN=64, BKW=16, SPLIT=4, INTERP=False, NIT=8, BF16D=True, XF=mode != "bf16")
        n, ops, cvt, shared = _loop_sass(_fp4_gemm_kernel, sig, dense_aligned, cst, 4, 3, f"dense_v3a-bf16_{mode}")
        _sass_row(rows, "K4096 split4", "_fp4_gemm_kernel v3a-bf16", f"A={mode};BM=16;BN=64;BKW=16;num_warps=4;num_stages=3",
                  ops, loop_instr=n, lane_instr_per_weight=round(n * 128 / (64 * 8 * 16), 2), shared_bytes=shared,
                  ttgir_convert_layouts=cvt)
    # v5a: both tiles (W4A16, bf16 decode, BM 16) with the weight words and scales by TMA (`tma=True`; BKW 32 for
    # 16-byte scale rows), and the pointer tiles at BKW 32 beside them
    for fn, sig, aligned, cst, shape, w_iter in (
            (_moe_gemm_kernel, moe_sig, moe_aligned, dict(GATED=True, ROUTE_W=False, NIT=8), "K2048 gate+up", 2),
            (_fp4_gemm_kernel, dense_sig, dense_aligned, dict(SPLIT=4, NIT=4), "K4096 split4", 1)):
        for tma in (False, True):
            s_tma = dict(sig, WDESC="constexpr")
            if tma:
                s_tma.update(w_ptr="tensordesc<i32[64, 32]>", ws_ptr="tensordesc<u8[64, 16]>")
            n, ops, cvt, shared = _loop_sass(
                fn, s_tma, [a for a in aligned if not (tma and a in ("w_ptr", "ws_ptr"))],
                dict(cst, BM=16, BN=64, BKW=32, INTERP=False, BF16D=True, XF=False, WDESC=tma), 4, 3,
                f"{fn.__name__}_v5a_{int(tma)}")
            _sass_row(rows, shape, f"{fn.__name__} {'v5a-tma' if tma else 'v3a-bf16'}",
                      "A=bf16;BM=16;BN=64;BKW=32;num_warps=4;num_stages=3", ops, loop_instr=n,
                      lane_instr_per_weight=round(n * 128 / (64 * 8 * 32 * w_iter), 2), shared_bytes=shared,
                      ttgir_convert_layouts=cvt, memory_ops=_mem_ops(ops))
    # v5k: both tiles (W4A16, bf16 decode, K-tiles of 128) with the weights in the dot order (int32 scale words) beside
    # the pair order: the decoded tile's shared-memory trip (STS, LDSM, barriers) gone
    for fn, sig, aligned, cst, shape, w_iter in (
            (_moe_gemm_kernel, moe_sig, moe_aligned, dict(GATED=True, ROUTE_W=False, NIT=16), "K2048 gate+up", 2),
            (_fp4_gemm_kernel, dense_sig, dense_aligned, dict(SPLIT=4, NIT=8, KMASK=False), "K4096 split4", 1)):
        for bm in (16, 32):
            for dot in (False, True):
                s_dot = dict(sig, WDESC="constexpr", DOT="constexpr", ws_ptr="*i32" if dot else "*u8",
                             **({"KMASK": "constexpr"} if "KMASK" in cst else {}))
                c = dict(cst, BM=bm, BN=64, BKW=16, INTERP=False, BF16D=True, XF=False, WDESC=False, DOT=dot)
                if "KMASK" in c:
                    c["KMASK"] = not dot
                n, ops, cvt, shared = _loop_sass(fn, s_dot, aligned, c, 4, 3, f"{fn.__name__}_v5k_{bm}_{int(dot)}")
                _sass_row(rows, shape, f"{fn.__name__} {'v5k-dot' if dot else 'v3a-bf16'}",
                          f"A=bf16;BM={bm};BN=64;BKW=16;num_warps=4;num_stages=3", ops, loop_instr=n,
                          lane_instr_per_weight=round(n * 128 / (64 * 8 * 16 * w_iter), 2), shared_bytes=shared,
                          ttgir_convert_layouts=cvt, memory_ops=_mem_ops(ops))
    # FP4-KV decode attention, D 128, 8 query heads per KV head (16 MMA rows), 64-token tiles, 4 warps (the
    # engine's default tile): loop instructions per K/V element (kernels/NOTES.md v2i, v3b)
    from kernels.attention import _decode_attn_kernel
    sig = {"q_ptr": "*bf16", "kp_ptr": "*i32", "ks_ptr": "*u8", "kf_ptr": "*fp32", "vp_ptr": "*i32",
           "vs_ptr": "*u8", "vf_ptr": "*fp32", "starts_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*fp32",
           "lse_ptr": "*fp32", "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32", "per_split": "i32", "NSPLIT": "i32",
           "G": "constexpr", "GP": "constexpr", "D": "constexpr", "BLOCK_N": "constexpr", "NIT": "constexpr",
           "INTERP": "constexpr", "DIRECT": "constexpr"}
    aligned = ["q_ptr", "kp_ptr", "ks_ptr", "kf_ptr", "vp_ptr", "vs_ptr", "vf_ptr", "o_ptr", "lse_ptr"]
    for bn in (32, 64, 128):
        cst = dict(G=8, GP=16, D=128, BLOCK_N=bn, NIT=8192 // bn, INTERP=False, DIRECT=False)
        n, ops, cvt, shared = _loop_sass(_decode_attn_kernel, sig, aligned, cst, 4, 1, f"attn_{bn}")
        _sass_row(rows, "D128 G8", "_decode_attn_kernel", f"BLOCK_N={bn};num_warps=4", ops, loop_instr=n,
                  lane_instr_per_kv_element=round(n * 128 / (2 * bn * 128), 2), shared_bytes=shared,
                  ttgir_convert_layouts=cvt)
    # the register-operand kernel (kernels/attention_mma.py, Gluon; one warp per program): per loop step of 16 or 32
    # keys a thread holds 2 keys x 32 elements of K and of V (v5j, v5k), registers bound the programs per SM
    from kernels.attention_mma import _decode_attn_mma_kernel
    sig = {"q_ptr": "*bf16", "kp_ptr": "*i32", "ks_ptr": "*u8", "kf_ptr": "*fp32", "vp_ptr": "*i32", "vs_ptr": "*u8",
           "vf_ptr": "*fp32", "starts_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*bf16", "lse_ptr": "*bf16",
           "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32", "per_split": "i32", "NSPLIT": "i32"}
    for keys in (16, 32):
        name = f"attn_mma_{keys}"
        n, ops, _, shared = _loop_sass(_decode_attn_mma_kernel, sig, [k for k in sig if sig[k].startswith("*")],
                                       dict(G=8, GP=8, T=keys, PREFETCH=False, DIRECT=True), 1, 1, name, gluon=True)
        res = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"),
                              "-res-usage", f"/tmp/{name}.cubin"], capture_output=True, text=True).stdout
        _sass_row(rows, "D128 G8", "_decode_attn_mma_kernel", f"keys_per_step={keys};num_warps=1", ops, loop_instr=n,
                  lane_instr_per_kv_element=round(n / (2 * keys * 128 / 32), 2), shared_bytes=shared,
                  registers=int(re.search(r"REG:(\d+)", res).group(1)))
    # activation quantize, one row of 4096 per program (the GPU's tile at 8192x4096), bf16 in, RTN, codes and scales
    # out: whole-kernel instructions per element and the widths of its loads and stores (kernels/NOTES.md, quantize)
    from kernels.quantize import _quant_rows_kernel
    sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "outer_ptr": "*fp32", "mbits_ptr": "*u8",
           "dst_ptr": "*u8", "fq_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32", "seed": "i32",
           "amax_min": "fp32"}
    aligned = ["x_ptr", "codes_ptr", "scales_ptr", "outer_ptr", "mbits_ptr", "fq_ptr", "K", "stride_xm"]
    for fmt, block, fma in (("nvfp4", 16, False), ("mxfp4", 32, False), ("nvfp4", 16, True), ("mxfp4", 32, True)):
        cst = dict(BM=1, NB=4096 // block, BLOCK=block, IS_NV=fmt == "nvfp4", NOCLIP=False, STOCH=False, GUIDE=False,
                   FAKE=False, FAKE_EXACT=False, FAKE_TILE=False, HAS_DST=False, SINGLE=True, CH=4096, NCH=1,
                   INTERP=False, GIVEN=False, FMA_RTN=fma, rec_m_ptr=None, rec_s_ptr=None, rec_o_ptr=None,
                   rec_c_ptr=None, step_ptr=None, REC=False, REC_CODES=False)  # no record outputs
        sig.update({k: "constexpr" for k in cst})
        n, ops, cvt, shared = _loop_sass(_quant_rows_kernel, sig, aligned, cst, 4, 1, f"quant_{fmt}_{int(fma)}",
                                         whole=True)
        alu = sum(v for k, v in ops.items() if k in SASS_ALU_OPS)
        # us for 8192 rows x 4 warps at c clocks per row-warp on 132 SMs x 4 sub-partitions at 1.98 GHz
        bound_us = lambda c: round(8192 * 4 * c / (132 * 4 * 1.98e9) * 1e6, 1)  # noqa: E731
        _sass_row(rows, "8192x4096", f"_quant_rows_kernel {fmt}{'' if fma else '-cmp'}",
                  "BM=1;CH=4096;num_warps=4", ops, kernel_instr=n,
                  instr_per_element=round(n * 128 / 4096, 2), shared_bytes=shared, ttgir_convert_layouts=cvt,
                  memory_ops=_mem_ops(ops, ("LDG", "STG", "BAR")), alu_ops=alu,
                  alu_bound_us=bound_us(2 * alu), issue_bound_us=bound_us(n))
    # the engine's sampling pass (kernels/sampling.py): 4096 logits per loop step over 8 warps (16 per thread); the
    # stride and vocabulary divisible by 16 as at 151,936, as the runtime specializes them
    from kernels.sampling import _sample_kernel

    sig = {"x_ptr": "*bf16", "stride": "i32", "V": "i32", "V4": "i32", "inv_t": "fp32", "seed": "i64",
           "tok_ptr": "*i64", "lp_ptr": "*fp32", "bad_ptr": "*i32", "GREEDY": "constexpr", "ASM": "constexpr",
           "BLOCK": "constexpr"}
    for greedy in (True, False):
        n, ops, _, _ = _loop_sass(_sample_kernel, sig, ["x_ptr", "stride", "V", "V4"],
                                  dict(GREEDY=greedy, ASM=True, BLOCK=4096), 8, 1, f"sample_{int(greedy)}")
        _sass_row(rows, "V 151936", "_sample_kernel", f"{'greedy' if greedy else 'temperature'};BLOCK=4096;num_warps=8",
                  ops, loop_instr=n, instr_per_logit=round(n / 16, 2))
    RUN.update(gpu="sm_90 (offline ptxas)")
    for r in rows:
        _emit(r)
