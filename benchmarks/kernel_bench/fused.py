"""The sampling, norm and routing kernels' part of the kernel benchmark."""
from __future__ import annotations

import torch

from benchmarks.kernel_bench.harness import bench, check, log, record
from kernels import reference as ref


def run_sampling(dev, quick):
    """The rollout engine's per-step sampling at the Qwen3 vocabulary (151,936) over 64 and 256 rows of bf16 logits:
    its torch passes (`RolloutEngine.sample_torch`) against `kernels.sampling.fused_sample`, greedy and at
    temperature 1, eager (as the engine launches them: outside its CUDA graphs). Checks first: greedy tokens equal
    torch.argmax's, log-probs (greedy and sampled) within 1e-4 of float64 log_softmax."""
    from kernels.sampling import fused_sample
    from trace.rollout.engine import RolloutEngine

    log("== sampling (one decode step's logits -> tokens, log-probs, finite flag)")
    V = 151936
    for A in (64, 256):
        x = (torch.randn(A, V, device=dev) * 3).to(torch.bfloat16)
        shape = f"A{A} V{V}"
        tok, lp, _ = fused_sample(x, 0.0)
        want_tok, want_lp, _ = ref.sample_reference(x, 0.0)
        e = float((lp.double() - want_lp).abs().max())
        check(f"sampling greedy {shape}", torch.equal(tok, want_tok) and e < 1e-4, f"max |dlogp| {e:.1e}")
        tok, lp, _ = fused_sample(x, 1.0, seed=1)  # the log-probs of the sampled tokens (the tokens: the tests)
        e = float((lp.double() - torch.log_softmax(x.double(), -1).gather(-1, tok[:, None]).squeeze(-1)).abs().max())
        check(f"sampling t=1 {shape}", e < 1e-4, f"max |dlogp| {e:.1e}")
        gen = torch.Generator(device=dev)
        gen.manual_seed(0)
        for t, name in ((0.0, "greedy"), (1.0, "t1")):
            base = record("sampling", shape, f"torch-{name}", bench(lambda t=t, x=x: RolloutEngine.sample_torch(x, t, 1.0, gen),
                                                                   graph=False), x.numel() * 2)
            record("sampling", shape, f"fused-{name}", bench(lambda t=t, x=x: fused_sample(x, t, 7), graph=False),
                   x.numel() * 2, base_ms=base, config="block=4096;num_warps=8")
        del x


def run_fused(dev, quick):
    """The rollout engine's small fused ops at a Qwen3-30B-A3B decode step (256 and 64 rows; H 2048, 32 / 4 heads x
    128, 128 experts top-8): the torch ops of `trace/rollout/forward.py` (residual add + RMSNorm; per-head q/k RMSNorm +
    RoPE; the router's softmax + top-k + renormalisation) against `kernels.norm` / `kernels.routing`, in CUDA graphs as
    the engine replays them. Checks first: the residual sums and a RoPE without the norm bit-identical to torch's, the
    normed values within 3 bf16 roundings, the routing's experts torch's where no two probabilities are near-tied."""
    from kernels.norm import norm_rope, rms_norm
    from kernels.routing import topk_softmax
    from trace.rollout.forward import rms_norm as torch_rms_norm
    from trace.rollout.forward import rope

    log("== norms (residual add + RMSNorm, q/k norm + RoPE)")
    H, nh, nkv, D, eps, bf = 2048, 32, 4, 128, 1e-6, torch.bfloat16
    for R in (256, 64):
        x, r = (torch.randn(R, H, device=dev) * 4).to(bf), torch.randn(R, H, device=dev).to(bf)
        w = (1 + 0.3 * torch.randn(H, device=dev)).to(bf)
        s, y = rms_norm(x, w, eps, residual=r)
        want = torch_rms_norm(x + r, w, eps)
        e = float(((y.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max())
        check(f"add+rmsnorm R{R}", torch.equal(s, x + r) and e <= 3 * 2 ** -7, f"sum exact; max rel {e:.1e}")

        def torch_add_norm(x=x, r=r, w=w):
            t = x + r
            return t, torch_rms_norm(t, w, eps)

        shape = f"R{R} H{H}"
        nbytes = 4 * R * H * 2  # x, residual in; sum, norm out
        base = record("norm", shape, "torch-add+rmsnorm", bench(torch_add_norm), nbytes)
        record("norm", shape, "fused-add+rmsnorm", bench(lambda x=x, r=r, w=w: rms_norm(x, w, eps, residual=r)), nbytes,
               base_ms=base)
        pos = torch.randint(0, 4096, (R,), device=dev).float()
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
        emb = torch.cat([pos[:, None] * inv] * 2, -1)
        c, sn = emb.cos().to(bf), emb.sin().to(bf)
        q, k = torch.randn(R, nh, D, device=dev).to(bf), torch.randn(R, nkv, D, device=dev).to(bf)
        qw, kw = (1 + 0.3 * torch.randn(D, device=dev)).to(bf), (1 + 0.3 * torch.randn(D, device=dev)).to(bf)

        def torch_rope(t, wt):
            return rope(torch_rms_norm(t, wt, eps), c, sn)

        check(f"rope R{R}", torch.equal(norm_rope(q, c, sn), rope(q, c, sn)), "bit-identical without the norm")
        shape = f"R{R} q{nh} k{nkv} x{D}"
        nbytes = 2 * R * (nh + nkv) * D * 2
        base = record("norm", shape, "torch-qk-norm+rope", bench(lambda: (torch_rope(q, qw), torch_rope(k, kw))), nbytes)
        record("norm", shape, "fused-qk-norm+rope", bench(lambda: (norm_rope(q, c, sn, qw, eps), norm_rope(k, c, sn, kw, eps))),
               nbytes, base_ms=base)
        E, k = 128, 8
        logits = torch.randn(R, E, device=dev).to(bf)

        def torch_route():
            v, i = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
            return (v / v.sum(-1, keepdim=True)).to(bf), i

        (v, i), (wv, wi) = topk_softmax(logits, k, True, bf), torch_route()
        p = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        clear = ((p[:, :k] - p[:, 1:k + 1]) > 1e-5 * p[:, :k]).all(-1)  # rows with no near-tie in their top k + 1
        same = bool((i == wi).all(-1)[clear].all()) and bool(((v.float() - wv.float()).abs() <= 2 ** -7 * wv.float().abs()).all(-1)[clear].all())
        check(f"routing R{R}", same, f"experts and weights torch's on {int(clear.sum())} of {R} rows without a near-tie")
        shape, nbytes = f"R{R} E{E} top{k}", R * E * 2
        base = record("routing", shape, "torch-softmax+topk+renorm", bench(torch_route), nbytes)
        record("routing", shape, "fused-topk-softmax", bench(lambda: topk_softmax(logits, k, True, bf)), nbytes, base_ms=base)
