"""Rollout throughput: the embedded engine (BF16, FP4 W4A4, W4A4 + FP4 KV) vs transformers `generate` (BF16).

What: for each model shape, batch size and provider, generate `--gen` tokens after a `--prompt`-token random
prompt (greedy, no stop), and report generated tokens per second (prefill included, wall clock, after
one short warm-up). Providers: `engine-bf16`, `engine-w4a4`, `engine-w4a4-kv4` (trace.rollout.RolloutEngine)
and `hf-bf16` (transformers `model.generate`, BF16, `experts_implementation` as given by --hf-experts).
Shapes: the tiny flavors (`qwen3_moe-tiny`, ...) and `qwen3_30b_a3b` = Qwen3-30B-A3B layer shape
(H 2048, 32/4 heads x 128, 128 experts top-8, I 768, vocab 151936) with random weights and FEWER
LAYERS (`--layers`, default 4; tokens/s scale ~1/layers for the decoder part).

With `--breakdown`, each engine provider is also profiled (torch.profiler, up to 64 tokens) and
rows `op=rollout_breakdown` give ms per generated token in attention / moe / other / total
(`note=component=...`, `ms_per_step` holds the value).

Output: long-format CSV (op, shape, provider, batch, prompt, gen, tokens_per_s, elapsed_s, ms_per_step,
gpu, commit) at `--out` (default $OUT/bench_rollout.csv if $OUT is set, else results/rollout/bench_rollout.csv),
written row by row; `--deadline` seconds stops starting new runs (the GPU budget is small).

Run (CPU, small): `.venv/bin/python benchmarks/bench_rollout.py --models qwen3_moe-tiny --batch 4 --prompt 16 --gen 16`
Run (GPU):        `python3 benchmarks/bench_rollout.py --device cuda --models qwen3_30b_a3b qwen3_moe-tiny --batch 64 256`
Compared against: transformers generate (same weights, BF16) and the engine's own BF16 mode.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trace.models import build_config, get_spec  # noqa: E402
from trace.rollout import RolloutEngine  # noqa: E402

PROVIDERS = ("engine-bf16", "engine-w4a4", "engine-w4a4-kv4", "hf-bf16")
FIELDS = ("op", "shape", "provider", "batch", "prompt", "gen", "tokens_per_s", "elapsed_s", "ms_per_step", "dtype",
          "layers", "note", "gpu", "commit")


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return os.environ.get("GIT_COMMIT", "unknown")


def build(name: str, layers: int, device, dtype, hf_experts: str, max_len: int):
    if name == "qwen3_30b_a3b":
        cfg = build_config("qwen3_moe-paper", num_hidden_layers=layers, max_position_embeddings=max(max_len, 4096),
                           experts_implementation=hf_experts)
        cls = get_spec("qwen3_moe-paper").model_cls
    else:
        cfg = build_config(name, max_position_embeddings=max(max_len, 256), experts_implementation=hf_experts)
        cls = get_spec(name).model_cls
    torch.manual_seed(0)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(cfg)
        finally:
            torch.set_default_dtype(prev)
    return model.to(dtype).eval()


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(model, mode, kv, prompts, gen, device, dtype):
    eng = RolloutEngine(model.config, mode=mode, kv_fp4=kv, dtype=dtype, device=device,
                        max_seq_len=len(prompts[0]) + gen + 1)
    eng.sync_weights(model)
    eng.generate([p[:8] for p in prompts[:2]], max_new_tokens=2, temperature=0.0)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = eng.generate(prompts, max_new_tokens=gen, temperature=0.0)
    sync(device)
    dt = time.perf_counter() - t0
    del eng
    return out.num_generated_tokens, dt


def breakdown(model, mode, kv, prompts, gen, device, dtype) -> dict[str, float]:
    """Milliseconds per generated token in attention, MoE (or dense MLP) and everything else, from
    torch.profiler over one generate call (device time on CUDA, CPU time otherwise). The labels
    are the `record_function` scopes of trace/rollout/forward.py; 'other' = total - both."""
    from torch.profiler import ProfilerActivity, profile

    eng = RolloutEngine(model.config, mode=mode, kv_fp4=kv, dtype=dtype, device=device,
                        max_seq_len=len(prompts[0]) + gen + 1)
    eng.sync_weights(model)
    eng.generate([p[:8] for p in prompts[:2]], max_new_tokens=2, temperature=0.0)  # warm-up
    cuda = str(device).startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        out = eng.generate(prompts, max_new_tokens=gen, temperature=0.0)
        sync(device)
    wall_ms = 1000 * (time.perf_counter() - t0)

    def t_us(evt):  # device time on CUDA (its name changed across torch versions), CPU time otherwise
        if cuda:
            return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        return evt.cpu_time_total

    parts = {k: 0.0 for k in ("attention", "moe")}
    for evt in prof.key_averages():
        for k in parts:
            if evt.key == f"rollout.{k}":
                parts[k] += t_us(evt) / 1000.0
    if cuda:  # total device time: every kernel once (self time), not the nested label totals
        total = sum(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
                    for e in prof.key_averages()) / 1000.0
    else:
        total = wall_ms
    n = max(out.num_generated_tokens, 1)
    res = {k: v / n for k, v in parts.items()}
    res["other"] = max(total - sum(parts.values()), 0.0) / n
    res["total"] = total / n
    return res


def run_hf(model, prompts, gen, device):
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, max_new_tokens=gen, min_new_tokens=gen, pad_token_id=0, eos_token_id=None)
    model.generate(ids[:2, :8], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0], time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3_moe-tiny"])
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--batch", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on GPU) or float32 (default on CPU)")
    ap.add_argument("--hf-experts", default="grouped_mm", help="transformers experts_implementation for hf-bf16")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which no new run starts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile each engine provider: ms per token in attention / moe / other (op rollout_breakdown)")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    out = Path(a.out or (Path(os.environ["OUT"]) / "bench_rollout.csv" if os.environ.get("OUT")
                         else Path("results/rollout/bench_rollout.csv")))
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    commit, t_start = _commit(), time.perf_counter()
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for name in a.models:
            model = build(name, a.layers, a.device, dtype, a.hf_experts, a.prompt + a.gen + 1)
            vocab = model.config.vocab_size
            for bsz in a.batch:
                g = torch.Generator().manual_seed(bsz)
                prompts = torch.randint(4, min(vocab, 100), (bsz, a.prompt), generator=g).tolist()
                for prov in a.providers:
                    if time.perf_counter() - t_start > a.deadline:
                        print(f"deadline reached, skipping {name} b{bsz} {prov}", flush=True)
                        continue
                    note = ""
                    try:
                        if prov == "hf-bf16":
                            ntok, dt = run_hf(model, prompts, a.gen, a.device)
                            note = f"experts={a.hf_experts}"
                        else:
                            mode = "bf16" if prov == "engine-bf16" else "w4a4"
                            ntok, dt = run_engine(model, mode, prov.endswith("kv4"), prompts, a.gen, a.device, dtype)
                    except Exception as e:  # noqa: BLE001 - record the failure, keep benchmarking
                        ntok, dt, note = 0, float("nan"), f"error: {type(e).__name__}: {str(e)[:120]}"
                    row = dict(op="rollout_generate", shape=name, provider=prov, batch=bsz, prompt=a.prompt, gen=a.gen,
                               tokens_per_s=round(ntok / dt, 2) if ntok else 0.0, elapsed_s=round(dt, 3),
                               ms_per_step=round(1000 * dt / a.gen, 3), dtype=str(dtype).replace("torch.", ""),
                               layers=model.config.num_hidden_layers, note=note, gpu=gpu, commit=commit)
                    w.writerow(row)
                    f.flush()
                    print(row, flush=True)
                    if a.breakdown and prov != "hf-bf16" and ntok:
                        mode = "bf16" if prov == "engine-bf16" else "w4a4"
                        parts = breakdown(model, mode, prov.endswith("kv4"), prompts, min(a.gen, 64), a.device, dtype)
                        for comp, ms in parts.items():
                            w.writerow(dict(row, op="rollout_breakdown", gen=min(a.gen, 64), tokens_per_s="",
                                            elapsed_s="", ms_per_step=round(ms, 5), note=f"component={comp}"))
                        f.flush()
                        print("breakdown", prov, {k: round(v, 4) for k, v in parts.items()}, flush=True)
                    if a.device.startswith("cuda"):
                        torch.cuda.empty_cache()
            del model
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
