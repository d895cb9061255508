"""The inline-PTX bf16 decoders of the MMA tile (`kernels._common.DECODE8_ASM` and `DECODE8_PAIRED_ASM`),
run on the CPU by a small emulator of the PTX instructions they use, against the oracle's E2M1 values:
every code in every position of a word, with and without `kernels.gemm.pair_layout`, times E4M3 scales.
The GPU runs the same text (the MMA tests with bf16_decode=True there); this checks its bit logic
everywhere."""
import re

import numpy as np
import pytest
import torch

from kernels import reference as ref
from kernels._common import DECODE8_ASM, DECODE8_ORDER, DECODE8_PAIRED_ASM
from kernels.gemm import pair_layout

M32 = 0xFFFFFFFF


def _bf16_bits_to_f64(b):
    return torch.tensor([b << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).double().item()


def _f64_to_bf16_bits(x):
    t = torch.tensor([x], dtype=torch.float64).to(torch.bfloat16)  # round to nearest even
    return int(t.view(torch.int16).item()) & 0xFFFF


def run_ptx(text: str, operands: list[int]) -> list[int]:
    """Emulate the decoder: operands $0..$7 outputs (16-bit), $8 the word (32-bit), $9 the bf16 scale bits."""
    regs = {f"${i}": v for i, v in enumerate(operands)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & M32

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if m := re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", args):  # mov.b32 {lo, hi}, r
            r = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = r & 0xFFFF, r >> 16
            continue
        if m := re.fullmatch(r"(\S+), \{(\S+), (\S+)\}", args):  # mov.b32 r, {lo, hi}
            regs[m.group(1)] = val(m.group(2)) | (val(m.group(3)) << 16)
            continue
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(x) for x in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & M32
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "bfe.u32":
            r = (a[0] >> a[1]) & ((1 << a[2]) - 1)
        elif op == "mul.lo.u32":
            r = (a[0] * a[1]) & M32
        elif op == "mad.lo.u32":
            r = (a[0] * a[1] + a[2]) & M32
        elif op == "prmt.b32":  # default mode: byte i of the result = byte sel[i] of (a, b)
            src = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            assert all(((a[2] >> (4 * i)) & 8) == 0 for i in range(4)), "sign-replicating selectors not emulated"
            r = sum(src[(a[2] >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op == "cvt.u32.u16":
            r = a[0] & 0xFFFF
        elif op == "mul.rn.bf16x2":
            r = 0
            for half in (0, 16):
                x = _bf16_bits_to_f64((a[0] >> half) & 0xFFFF) * _bf16_bits_to_f64((a[1] >> half) & 0xFFFF)
                r |= _f64_to_bf16_bits(x) << half
        else:
            raise AssertionError(f"instruction not emulated: {op}")
        regs[d] = r
    return [regs[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("paired", [False, True])
def test_ptx_decoders_give_the_oracle_values(paired):
    text = (DECODE8_PAIRED_ASM if paired else DECODE8_ASM).value
    g = torch.Generator().manual_seed(7)
    codes = torch.cat([torch.arange(16, dtype=torch.uint8).repeat(8, 1).T.reshape(16, 8),  # each code everywhere
                       torch.randint(0, 16, (64, 8), generator=g, dtype=torch.uint8)])   # [80, 8]
    words = ref.pack_fp4(codes).contiguous().view(torch.int32).reshape(-1)  # [80]
    if paired:
        words = pair_layout(words)
    values = torch.tensor(ref.E2M1_GRID)[codes.long() & 7] * torch.where(codes >= 8, -1.0, 1.0)  # [80, 8]
    for scale in (1.0, 0.001953125, 0.375, 448.0):  # E4M3 values: subnormal min, a fraction, the max
        sc = scale * 2.0**119  # the decode's scale: s_b * 2^119
        sbits = _f64_to_bf16_bits(sc)
        assert _bf16_bits_to_f64(sbits) == sc
        for i in range(codes.shape[0]):
            out = run_ptx(text, [0] * 8 + [int(words[i]) & M32, sbits])
            if not paired:  # output o holds element DECODE8_ORDER[o]
                out = [out[DECODE8_ORDER.index(j)] for j in range(8)]
            got = np.array([_bf16_bits_to_f64(b) for b in out])
            want = values[i].double().numpy() * scale * 2.0**-7
            assert np.array_equal(got, want), (i, codes[i].tolist(), got, want)


def test_pair_layout_puts_every_bit_where_the_decoder_reads_it():
    """Element 2p + h's code bit i sits at bit PAIR_BITS[p][i] + 16 h, and the table uses each of the 32 bits once."""
    from kernels._common import PAIR_BITS

    assert sorted(b + 16 * h for row in PAIR_BITS for b in row for h in (0, 1)) == list(range(32))
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    words = ref.pack_fp4(codes).contiguous().view(torch.int32)  # [5, 8]
    pw = pair_layout(words).to(torch.int64) & M32
    for j in range(8):
        got = sum(((pw >> (PAIR_BITS[j // 2][i] + 16 * (j % 2))) & 1) << i for i in range(4))
        assert torch.equal(got, codes[:, j::8].long())


def test_a_prepared_weight_builds_its_pair_layout_once():
    from kernels.gemm import prepare_weight

    c, s, o = ref.nvfp4_quantize(torch.randn(8, 64))
    w = prepare_weight(c, s, o)
    assert w.pair_words is None  # only a bf16-decode call builds it
    p = w.paired()
    assert p is w.paired() and torch.equal(p, pair_layout(w.words))


def test_dot_layout_holds_every_code_where_the_decode_reads_it():
    """Element k of a row sits in word (G / 8) (k // G) + (G / 32) q + t, its code bit i at bit PAIR_BITS[e // 2][i] +
    16 (e % 2), with k % G = 32 t + 16 s0 + 8 h + 2 q + c and e = 4 s0 + 2 h + c, for groups G of 64 and 128."""
    from kernels._common import PAIR_BITS, dot_layout

    codes = torch.randint(0, 16, (2, 3, 384), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for G in (64, 128):
        words = dot_layout(codes, G).to(torch.int64) & M32  # [2, 3, 48]
        k = torch.arange(384)
        r = k % G
        t, s0, h, q, c = r // 32, (r // 16) % 2, (r // 8) % 2, (r // 2) % 4, r % 2
        col = (G // 8) * (k // G) + (G // 32) * q + t
        e = 4 * s0 + 2 * h + c
        bits = torch.tensor(PAIR_BITS)[e // 2] + 16 * (e % 2)[:, None]  # [384, 4]: code bit i -> word bit
        got = sum(((words[..., col] >> bits[:, i]) & 1) << i for i in range(4))
        assert torch.equal(got.to(torch.uint8), codes), G
    with pytest.raises(ValueError, match="multiple of 128"):
        dot_layout(codes[..., :192], 128)


def test_scale_bytes_become_the_bf16_multiplier_by_one_multiply_add():
    """Every positive E4M3 scale (subnormals included) re-encoded (`dot_scales`) and made a bf16 as the dot decode's PTX
    does ((byte << 4) + 0x7680 per half, one multiply-add over two bytes) is s_b * 2^119 exactly; a zero scale is
    byte 0; consecutive blocks share a word, the lower block in the lower byte."""
    from kernels._common import SCALE_MAD, dot_scales
    from kernels.gemm import _DOT_ASM

    b = torch.arange(0, 127, dtype=torch.uint8)  # 0 and every positive finite E4M3 value
    enc = dot_scales(torch.stack([b, b.flip(0)], -1).reshape(1, -1))  # [1, 127] int16
    pairs = enc.view(torch.uint8).reshape(127, 2).to(torch.int64)
    assert torch.equal(pairs[:, 0].flip(0), pairs[:, 1])
    assert f"mad.lo.u32 sp, x, 16, {SCALE_MAD};" in _DOT_ASM.value
    word = ((pairs[:, 0] | (pairs[:, 1] << 16)) * 16 + SCALE_MAD) & M32
    lo, hi = word & 0xFFFF, word >> 16
    want = (ref.e4m3_decode(b) * 2.0**119).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    assert int(pairs[0, 0]) == 0
    assert torch.equal(lo[1:], want[1:]) and torch.equal(hi[:-1], want.flip(0)[:-1])


def test_dot_order_decoder_gives_the_oracle_values():
    """`kernels.gemm._DOT_ASM` (the tile's decode in the dot order) run by the emulator on words from
    `kernels._common.dot_layout` (groups of 128) and the int32 scale words of `PreparedFP4Weight.dotted`: word 4 q + t
    with the scale word t // 2 of its group and selector t % 2 gives element e = 4 s0 + 2 h + c of
    k = 32 t + 16 s0 + 8 h + 2 q + c as E2M1(code) * s_b * 2^-7, for every code and E4M3 scales from the subnormal
    minimum to the maximum (a zero block too)."""
    from kernels._common import dot_layout, dot_scales
    from kernels.gemm import _DOT_ASM

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (6, 128), generator=g, dtype=torch.uint8)
    codes[0] = torch.arange(128) % 16  # every code in every position class
    sv = torch.tensor([0.001953125, 0.375, 448.0, 1.0, 2.5, 0.0078125, 96.0, 0.0])
    scale_vals = torch.stack([sv.roll(r) for r in range(6)])  # [6, 8]
    codes[scale_vals.repeat_interleave(16, 1) == 0] = 0  # a zero scale's block holds zero codes
    words = dot_layout(codes, 128).to(torch.int64) & M32  # [6, 16]
    s32 = dot_scales(ref.e4m3_encode(scale_vals)).view(torch.int32).to(torch.int64) & M32  # [6, 2]
    values = torch.tensor(ref.E2M1_GRID)[codes.long() & 7] * torch.where(codes >= 8, -1.0, 1.0)  # [6, 128]
    for r in range(codes.shape[0]):
        for q in range(4):
            for t in range(4):
                out = run_ptx(_DOT_ASM.value, [0] * 8 + [int(words[r, 4 * q + t]), int(s32[r, t // 2]),
                                                         0x4140 + 0x202 * (t % 2)])
                for e in range(8):
                    k = 32 * t + 16 * (e >> 2) + 8 * ((e >> 1) & 1) + 2 * q + (e & 1)
                    want = float(values[r, k]) * float(scale_vals[r, k // 16]) * 2.0**-7
                    assert _bf16_bits_to_f64(out[e]) == want, (r, q, t, e, k)
