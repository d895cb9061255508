"""CPU check of the variant's offline order + decode + tensor chain (no GPU, no interpreter: inline asm does not run
there). The PTX text `variant._VAR_ASM` is executed by a small vectorized numpy emulator of exactly the instructions it
uses; the Triton tensor ops of `_variant_decode` (broadcast / join / reshape / permute) are replayed in numpy with
Triton's semantics (join stacks on a new LAST axis; reshape is row-major; permute = np.transpose). The result must equal
e2m1(code) * e4m3(scale) * 2^-7 for every element of random weights (every code, E4M3 subnormal and normal scales,
zero blocks). Also checks a few deliberate mistakes fail.
Run (repository root): PYTHONPATH=. python benchmarks/layout_study/verify_variant.py"""
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant import _VAR_ASM, _VAR_ASM32, variant_codes_order, variant_scales, variant_words  # noqa: E402

from kernels import reference as ref  # noqa: E402

M32 = np.uint64(0xFFFFFFFF)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def bf16_to_f64(b):
    return ((b.astype(np.uint64) & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.uint32).view(np.float32).astype(np.float64)


def f64_to_bf16(x):
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint64) & np.uint64(0xFFFF)


def prmt(a, b, sel):
    src = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)] + [(b >> np.uint64(8 * i)) & np.uint64(0xFF)
                                                                             for i in range(4)]
    r = np.zeros_like(a)
    for i in range(4):
        r |= src[(sel >> (4 * i)) & 7] << np.uint64(8 * i)
    return r


def run_ptx(text, word, s16, sel=None):
    """vectorized: word uint32 array, s16 uint16 (or uint32) array, sel (optional $10) -> 8 uint16 arrays ($0..$7)."""
    regs = {"$8": word.astype(np.uint64), "$9": s16.astype(np.uint64)}
    if sel is not None:
        regs["$10"] = sel.astype(np.uint64)
    shape = word.shape

    def val(t):
        t = t.strip()
        return regs[t] if t in regs else np.full(shape, int(t, 0), np.uint64)

    body = text.strip()[1:-1]
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if m := re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", args):  # mov.b32 {lo, hi}, r
            r = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = r & np.uint64(0xFFFF), (r >> np.uint64(16)) & np.uint64(0xFFFF)
            continue
        if m := re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", args):  # mov.b32 r, {lo, hi}
            regs[m.group(1)] = (val(m.group(2)) & np.uint64(0xFFFF)) | ((val(m.group(3)) & np.uint64(0xFFFF)) << np.uint64(16))
            continue
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            sl = val(src[2])
            r = np.zeros(shape, np.uint64)
            for sv in np.unique(sl):
                r = np.where(sl == sv, prmt(val(src[0]), val(src[1]), int(sv)), r)
        else:
            a = [val(x) for x in src]
            if op == "shl.b32":
                r = (a[0] << a[1]) & M32
            elif op == "shr.u32":
                r = a[0] >> a[1]
            elif op == "and.b32":
                r = a[0] & a[1]
            elif op == "or.b32":
                r = a[0] | a[1]
            elif op == "mad.lo.u32":
                r = (a[0] * a[1] + a[2]) & M32
            elif op == "mul.rn.bf16x2":
                r = np.zeros(shape, np.uint64)
                for half in (0, 16):
                    h = np.uint64(half)
                    r |= f64_to_bf16(bf16_to_f64(a[0] >> h) * bf16_to_f64(a[1] >> h)) << h
            else:
                raise AssertionError(f"instruction not emulated: {op}")
        regs[d] = r
    return [regs[f"${i}"] for i in range(8)]


def decode_tile(w, s16, BN, BK, G, asm=_VAR_ASM.value, perm=(0, 1, 3, 6, 5, 2, 4)):
    """numpy replay of variant._variant_decode on one tile: w uint32 [BN, BK/8], s16 uint16 [BN, BK/32]."""
    U, T = BK // G, G // 32
    sw = np.broadcast_to(s16.reshape(BN, U, 1, T), (BN, U, 4, T)).reshape(BN, BK // 8)
    o = [bf16_to_f64(x) for x in run_ptx(asm, w, sw)]
    j = lambda a, b: np.stack([a, b], -1)  # noqa: E731  (tl.join)
    v = j(j(j(o[0], o[1]), j(o[2], o[3])), j(j(o[4], o[5]), j(o[6], o[7])))
    v = v.reshape(BN, U, 4, T, 2, 2, 2).transpose(perm)
    return v.reshape(BN, BK)


def decode_tile32(w, s32, BN, BK, G):
    """numpy replay of variant._variant_decode32: s32 uint32 [BN, BK/64]."""
    U, T = BK // G, G // 32
    sw = np.broadcast_to(s32.reshape(BN, U, 1, T // 2, 1), (BN, U, 4, T // 2, 2)).reshape(BN, BK // 8)
    sel = np.broadcast_to((0x4140 + 0x202 * np.arange(2)).reshape(1, 1, 1, 1, 2), (BN, U, 4, T // 2, 2)).reshape(BN, BK // 8)
    o = [bf16_to_f64(x) for x in run_ptx(_VAR_ASM32.value, w, sw, sel)]
    j = lambda a, b: np.stack([a, b], -1)  # noqa: E731
    v = j(j(j(o[0], o[1]), j(o[2], o[3])), j(j(o[4], o[5]), j(o[6], o[7])))
    return v.reshape(BN, U, 4, T, 2, 2, 2).transpose(0, 1, 3, 6, 5, 2, 4).reshape(BN, BK)


def check32(N=128, K=512, BN=64, BK=128, G=128):
    codes, scales = make_weight(N, K)
    want = E2M1[codes.numpy()] * ref.e4m3_decode(scales).double().numpy().repeat(16, 1) * 2.0**-7
    words = variant_words(codes, G).numpy().view(np.uint32)
    s32 = variant_scales(scales).contiguous().view(torch.int32).numpy().view(np.uint32)
    got = np.zeros((N, K))
    for n0 in range(0, N, BN):
        for k0 in range(0, K, BK):
            got[n0:n0 + BN, k0:k0 + BK] = decode_tile32(words[n0:n0 + BN, k0 // 8:(k0 + BK) // 8],
                                                        s32[n0:n0 + BN, k0 // 64:(k0 + BK) // 64], BN, BK, G)
    return np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))


def make_weight(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    # E4M3 scale bytes: positive finite 0x01..0x7E (subnormals 1..7 included), and some all-zero blocks (scale 0)
    scales = torch.randint(1, 0x7F, (N, K // 16), generator=g, dtype=torch.uint8)
    zero = torch.rand(N, K // 16, generator=g) < 0.05
    scales[zero] = 0
    codes.view(N, K // 16, 16)[zero] = 0
    return codes, scales


def check(N=128, K=512, BN=64, BK=128, G=128, **kw):
    codes, scales = make_weight(N, K)
    want = E2M1[codes.numpy()] * ref.e4m3_decode(scales).double().numpy().repeat(16, 1) * 2.0**-7
    words = variant_words(codes, G).numpy().view(np.uint32)
    s16 = variant_scales(scales).numpy().view(np.uint16)
    got = np.zeros((N, K))
    for n0 in range(0, N, BN):
        for k0 in range(0, K, BK):
            got[n0:n0 + BN, k0:k0 + BK] = decode_tile(words[n0:n0 + BN, k0 // 8:(k0 + BK) // 8],
                                                      s16[n0:n0 + BN, k0 // 32:(k0 + BK) // 32], BN, BK, G, **kw)
    return np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))


if __name__ == "__main__":
    # the order statement agrees with the packer
    N, K = 4, 256
    codes = torch.arange(K).repeat(N, 1) % 16  # not used for the order itself
    for G in (64, 128):
        kk = variant_codes_order(1, 256, G)[0]
        assert sorted(kk.reshape(-1).tolist()) == list(range(256))
        # packing codes == k % 16 with PAIR_BITS, decoding element e must give k_of(w, e) % 16
        c = torch.tensor([[k % 16 for k in range(256)]], dtype=torch.uint8)
        w = variant_words(c, G).numpy().view(np.uint32)[0]
        from kernels._common import PAIR_BITS
        for wi in range(32):
            for e in range(8):
                code = sum(((int(w[wi]) >> (PAIR_BITS[e // 2][i] + 16 * (e % 2))) & 1) << i for i in range(4))
                assert code == kk[wi, e] % 16, (G, wi, e)
    ok = {}
    for BN, BK, G in ((64, 128, 128), (64, 128, 64), (128, 128, 128), (64, 256, 128), (64, 64, 64), (64, 256, 64)):
        ok[(BN, BK, G)] = check(N=128, K=512, BN=BN, BK=BK, G=G)
    for BN, BK, G in ((64, 128, 128), (64, 128, 64), (128, 128, 128), (64, 256, 128)):
        ok[("s32", BN, BK, G)] = check32(N=128, K=512, BN=BN, BK=BK, G=G)
    print("exact:", ok)
    assert all(ok.values())
    # deliberate mistakes must fail: wrong permute, swapped scale bytes, BK/G mismatch between packer and decoder
    bad_perm = check(perm=(0, 1, 3, 5, 6, 2, 4))
    bad_asm = check(asm=_VAR_ASM.value.replace("0x4140", "0x4041"))
    codes, scales = make_weight(64, 256)
    w = variant_words(codes, 64).numpy().view(np.uint32)  # packed for G 64, decoded as G 128
    s16 = variant_scales(scales).numpy().view(np.uint16)
    want = E2M1[codes.numpy()] * ref.e4m3_decode(scales).double().numpy().repeat(16, 1) * 2.0**-7
    got = np.concatenate([decode_tile(w[:, i * 16:(i + 1) * 16], s16[:, i * 4:(i + 1) * 4], 64, 128, 128)
                          for i in range(2)], 1)
    bad_g = np.array_equal(got, want)
    print("mutants pass (must all be False):", bad_perm, bad_asm, bad_g)
    assert not (bad_perm or bad_asm or bad_g)
    print("OK")
