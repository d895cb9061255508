"""Mismatch probe: how far a step-by-step decode and a full-sequence forward of the same FP4 model
disagree, per layer, and how much TRACE guidance closes the gap.

For each tiny family (random init, W4A4 + FP4 KV, NVFP4, BF16 autocast on FP32 master weights):
the "rollout" decodes the tokens one at a time with the HF KV cache and records full codes; the
"trainer" runs one full-sequence forward and replays the record unguided (flip statistics) and
guided with rho in {0.25, 0.5, 1} (routing replay on in every case). Reports per-layer code-flip,
scale-flip and unrecoverable rates, k3 and mean |dlp| of the sequence's tokens.

    python -m trace.qat.probe --out results/guidance/probe.json
Compared against: DESIGN.md §3's independent small experiment (unguided 10-20% flips per layer,
k3 ~1.5e-3; rho 1/3 ~8x lower k3, 1/2 ~15x, all ~1000x).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from trace.guidance import Recorder, guided_layer_indices
from trace.models import build_model, list_models
from trace.qat import patch_model, recording, replay


def _mismatch(lp_train: torch.Tensor, lp_roll: torch.Tensor) -> dict[str, float]:
    d = lp_train - lp_roll
    r = torch.exp(d)
    return {"k3": (r - 1 - d).mean().item(), "dlp_abs_mean": d.abs().mean().item(), "dlp_abs_max": d.abs().max().item()}


@torch.no_grad()
def probe(name: str, batch: int = 4, seq_len: int = 48, seed: int = 0, mode: str = "w4a4kv4") -> dict:
    m = build_model(name, seed=seed)
    patch_model(m, mode)
    n_layers = len(m.model.layers)
    ids = torch.randint(5, m.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    seq = torch.arange(batch)
    ac = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    rec = Recorder(full_codes=True)
    cache = DynamicCache(config=m.config)
    lp_steps = []
    with ac():
        for t in range(seq_len):
            pos = torch.full((batch, 1), t)
            with recording(m, rec, seq, pos):
                logits = m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
            lp_steps.append(torch.log_softmax(logits[:, -1].float(), -1))
    record = rec.finish()
    lp_roll = torch.stack(lp_steps, 1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    pos = torch.arange(seq_len).expand(batch, seq_len)

    def trainer(**kw):
        with ac(), replay(m, record, seq, pos, **kw) as st:
            lp = torch.log_softmax(m(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        return _mismatch(lp, lp_roll), st.summary()

    out = {"model": name, "mode": mode, "batch": batch, "seq_len": seq_len,
           "bits_per_element": record.bits_per_element(), "bytes_per_token_all_layers": record.bytes_per_token(True)}
    mm, summ = trainer(guide=False)
    out["unguided"] = {**mm, **{k: {str(i): v for i, v in d.items()} for k, d in summ.items()}}
    for rho in (0.25, 0.5, 1.0):
        layers = guided_layer_indices(n_layers, rho)
        mm, summ = trainer(guide_layers=layers)
        out[f"rho_{rho}"] = {**mm, "layers": layers,
                             "unrecoverable_rate": {str(i): summ["unrecoverable_rate"][i] for i in layers}}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/guidance/probe.json")
    ap.add_argument("--models", nargs="*", default=list_models(flavor="tiny"))  # every registered family
    ap.add_argument("--seq-len", type=int, default=48)
    args = ap.parse_args(argv)
    t0 = time.time()
    res = [probe(n, seq_len=args.seq_len) for n in args.models]
    for r in res:
        u = r["unguided"]
        flips = " ".join(f"{float(v):.3f}" for v in u["code_flip_rate"].values())
        print(f"{r['model']:16s} flips/layer [{flips}]  k3 unguided {u['k3']:.2e} |dlp| {u['dlp_abs_mean']:.2e}"
              + "".join(f" | rho {k[4:]}: k3 {r[k]['k3']:.2e} |dlp| {r[k]['dlp_abs_mean']:.2e}"
                        for k in ("rho_0.25", "rho_0.5", "rho_1.0")))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": res, "seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
