"""The register-operand decode attention (kernels/attention_mma.py) against the oracle over the dequantized cache
(GPU), and its compile-time guarantees on any machine: the decoded K/V reach mma.sync with no shared memory
(offline sm_90 compile, `assert_trivial` layouts), and the dimension orders are permutations that pair what the
decode pairs."""
import pytest
import torch

from kernels import attention_mma as am
from kernels import reference as ref
from kernels._common import DECODE8_ORDER
from kernels.attention import FP4KVCache, decode_attention, kv_store
from tests.kernels.conftest import DEV, GPU_TOL_ATTN, ON_GPU, bf16_exact, compile_sm90, dev, host, rel

SIG = {"q_ptr": "*bf16", "kp_ptr": "*i32", "ks_ptr": "*u8", "kf_ptr": "*fp32", "vp_ptr": "*i32", "vs_ptr": "*u8",
       "vf_ptr": "*fp32", "starts_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*bf16", "lse_ptr": "*bf16",
       "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32", "per_split": "i32", "NSPLIT": "i32"}


def test_dim_orders_pair_what_the_decode_pairs():
    """k_dim_order / v_dim_order are permutations of the head dim; consecutive k (an MMA register's two halves) are
    elements p and p + 4 of one word, the pair `DECODE8_ASM` writes into one register; a thread's 32 k of S^T are
    its four words, and a thread's 16 rows of O^T are one NVFP4 block (one scale)."""
    ko, vo = am.k_dim_order(), am.v_dim_order()
    assert sorted(ko) == list(range(128)) and sorted(vo) == list(range(128))
    for k in range(0, 128, 2):
        w, j = divmod(ko[k], 8)
        assert ko[k + 1] == ko[k] + 4 and DECODE8_ORDER.index(j) % 2 == 0 and w == ko[k + 1] // 8
    for t in range(4):  # lane t of a quad: k = 2t + {0, 1} + 8 j
        ks = [k for k in range(128) if (k >> 1) & 3 == t]
        assert {ko[k] // 8 for k in ks} == set(range(4 * t, 4 * t + 4))
    for g in range(8):  # lane group g: rows g + 8 j
        assert {vo[m] // 16 for m in range(g, 128, 8)} == {g}


def test_decoded_tiles_reach_the_mma_in_registers():
    """Offline sm_90 compile (no GPU): the decoded K and V tiles' conversions into mma.sync's A layout are asserted
    trivial at compile time, and the kernel reads no shared memory at all (P^T moves by shuffles)."""
    for T, pre in ((16, False), (32, True)):
        n = compile_sm90("kernels.attention_mma", "_decode_attn_mma_kernel", SIG,
                         {"G": 8, "GP": 8, "T": T, "PREFETCH": pre, "DIRECT": True}, ("mma.sync", "ldmatrix", "ld.shared"),
                         num_warps=1)
        assert n["mma.sync"] >= T and n["ldmatrix"] == 0 and n["ld.shared"] == 0, (T, n)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernel: a GPU")
@pytest.mark.parametrize("Hq,Hkv", [(8, 1), (16, 4), (32, 4), (32, 2)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_matches_the_oracle(Hq, Hkv, splits):
    """Variable lengths (0, 1, not a multiple of the 16-key step, the longest), G = 2 .. 16 query rows per KV head
    (padded to the MMA's 8 or 16), one split and several: within the Triton kernel's tolerance of the oracle."""
    torch.manual_seed(Hq * 10 + Hkv + (splits or 0))
    D, Bq, Lq = 128, 4, 300
    k, v = torch.randn(Bq * Lq, Hkv, D) * 4, torch.randn(Bq * Lq, Hkv, D)
    q = bf16_exact(torch.randn(Bq, Hq, D))
    lens, starts = torch.tensor([Lq, 0, 1, 173]), torch.arange(Bq) * Lq
    cache = FP4KVCache.allocate(Bq * Lq, Hkv, D, DEV)
    kv_store(cache, *dev(k, v, torch.randperm(Bq * Lq)))
    args = (dev(q).to(torch.bfloat16), cache, *dev(starts, lens), Lq)
    hc = host(cache)
    kh, vh = (ref.kv_dequantize(p, s, o).view(Bq, Lq, Hkv, D)
              for p, s, o in ((hc.k_packed, hc.k_scales, hc.k_outer), (hc.v_packed, hc.v_scales, hc.v_outer)))
    r = ref.decode_attention_reference(q, kh, vh, lens)
    tri = decode_attention(*args).float().cpu()
    for kw in ({}, {"prefetch": True}, {"keys_per_step": 16}, {"maxnreg": 128}):  # the default and the bench's variants
        out = am.decode_attention_mma(*args, num_splits=splits, **kw)
        assert out.dtype == torch.bfloat16 and out.shape == (Bq, Hq, D)
        assert float(out[1].abs().max()) == 0.0  # empty sequence
        assert rel(out.float(), r) < GPU_TOL_ATTN, kw
        assert rel(out.float(), tri) < GPU_TOL_ATTN, kw
