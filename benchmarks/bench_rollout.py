"""Rollout throughput: the embedded engine (BF16, FP4 W4A4, W4A4 + FP4 KV) vs transformers `generate` (BF16).

What: for each model shape, batch size and provider, generate `--gen` tokens after a `--prompt`-token random
prompt (greedy, no stop), and report generated tokens per second (prefill included, wall clock, after
one short warm-up). Providers (trace.rollout.RolloutEngine unless hf): `engine-bf16` (the BF16 engine as the trainer
builds it: on a GPU with the fused norms, routing and sampling the FP4 modes use); `engine-w4a4` and `engine-w4a4-kv4`
(FP4 codes, computed with BF16 GEMMs on the dequantized FP4 weights: fp4_backend="torch", no Triton at all);
`engine-w4a4-triton`, `engine-w4a4-kv4-triton` (the Triton path: the FP4 kernels of kernels/ for decode
projections up to their crossover sizes, the same codes on BF16 GEMMs above, trace/rollout/fast.py);
`engine-w4a4-kv4-kernels` (the Triton path with the FP4 kernels at every size: TRACE_FP4_CROSSOVER=inf,inf);
`engine-w4a4-kv4-tritonattn` (the Triton path with the Triton decode attention, kernels/attention.py, in place of the
default register-operand one, kernels/attention_mma.py: TRACE_FP4_ATTN=triton);
`engine-w4a4-kv4-bi` (the batch-invariant mode of the exact on-policy arm: every op of every chunk on
`kernels.batch_invariant`, `RolloutEngine(batch_invariant=True)`; on a CPU only under TRITON_INTERPRET=1);
`engine-bf16-eager` (no CUDA graphs, to show what they are worth); `engine-w4a4-kv4-record` (what a TRACE
rollout costs: the engine the RL trainer builds (on a GPU the Triton kernels of the FP4 arms, recording
the codes they quantize; on a CPU the torch path), every call recording trace's guidance record, the
deepest half of the layers and every MoE layer's routing, and `finish()`es it inside the clock; on a GPU
its decode steps record inside their CUDA graphs); `hf-bf16` (transformers
`model.generate`, BF16, `experts_implementation` as given by --hf-experts). Engine caches are allocated
and decode graphs captured before the clock starts (`RolloutEngine.prepare`, as a server does at start-up).
Shapes: the tiny flavors (`qwen3_moe-tiny`, ...) and `qwen3_30b_a3b` = Qwen3-30B-A3B layer shape
(H 2048, 32/4 heads x 128, 128 experts top-8, I 768, vocab 151936) with random weights and FEWER
LAYERS (`--layers`, default 4; tokens/s scale ~1/layers for the decoder part).

With `--breakdown`, each engine provider is also profiled (torch.profiler, up to 64 tokens minus a prefill-only
run, at the timed run's mean context: the prompts extended by gen/2 of their own tokens, the rows' `prompt`) and rows
`op=rollout_breakdown` give ms per DECODED token (`note=component=...`, `ms_per_step` holds the value; multiply by
the batch for ms per step): eagerly, kernel time in attention / moe / sampling / other / total; on a GPU also through
the CUDA graphs the timed run replays, graph-busy (the device runs something) and graph-idle (the timed decode step
less graph-busy: the GPU waits for the host's bookkeeping, the tokens' copy, launches).

Output: rows APPENDED, one by one, to the long table `--out` (default results/rollout/rollout.csv; schema
`benchmarks.results_table.ROLLOUT_FIELDS`: version, commit, gpu, date, op, shape, provider, batch, prompt,
gen, tokens_per_s, ratio_vs_bf16 = tokens/s over engine-bf16's in the same run, ...); `--deadline`
seconds stops starting new runs. `--repeats N`: the providers of a batch are all built first, then timed in N
rounds, each provider once per round (the row: the median call; note: every round's tokens/s range and the median and
range of the per-round ratios against engine-bf16's call of the same round).

Run (CPU, small): `.venv/bin/python benchmarks/bench_rollout.py --models qwen3_moe-tiny --batch 4 --prompt 16 --gen 16`
Run (GPU):        `python3 benchmarks/bench_rollout.py --device cuda --models qwen3_30b_a3b qwen3_moe-tiny --batch 64 256`
Compared against: transformers generate (same weights, BF16) and the engine's own BF16 mode.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.results_table import ROLLOUT_FIELDS, append, git_commit, today  # noqa: E402
from trace.guidance import Recorder, guided_layer_indices  # noqa: E402
from trace.models import build_config, get_spec  # noqa: E402
from trace.rollout import RolloutEngine  # noqa: E402

PROVIDERS = ("engine-bf16", "engine-w4a4", "engine-w4a4-kv4", "engine-w4a4-triton", "engine-w4a4-kv4-triton",
             "engine-w4a4-kv4-kernels", "engine-w4a4-kv4-tritonattn", "engine-w4a4-kv4-record", "engine-w4a4-kv4-bi",
             "engine-bf16-eager", "hf-bf16")
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


def engine_kwargs(prov: str) -> dict:
    """engine-<bf16|w4a4>[-kv4][-triton|-eager|-record]: mode, FP4 KV cache, FP4 compute backend (torch =
    FP4 weights dequantized to BF16 at sync + per-row FP4 activation quant + BF16 GEMMs, i.e. the same
    codes on BF16 tensor cores; triton = the FP4 kernels of kernels/; -record = the engine's default, the
    kernels on a GPU and the torch path on a CPU, as the RL trainer builds it), CUDA graphs (off for -eager), the
    batch-invariant mode (-bi, on the Triton kernels).
    engine-bf16 is the BF16 engine as the trainer builds it ("auto"): on a GPU with the fused norms, routing and
    sampling that the FP4 modes use too, so the ratio is FP4's alone."""
    bf16 = prov.startswith("engine-bf16")
    return dict(mode="bf16" if bf16 else "w4a4", kv_fp4="-kv4" in prov,
                fp4_backend="triton" if prov.endswith(("-triton", "-kernels", "-tritonattn", "-bi"))
                else "auto" if bf16 or prov.endswith("-record") else "torch",
                cuda_graphs=not prov.endswith("-eager"), batch_invariant=prov.endswith("-bi"))


def recorder_for(prov: str, model):
    """A fresh recorder of trace's guidance record for `-record` providers (rho 0.5, routing), else None."""
    if not prov.endswith("-record"):
        return None
    n = model.config.num_hidden_layers
    return Recorder(layers=guided_layer_indices(n, 0.5), routing=True)


_CROSSOVER = os.environ.get("TRACE_FP4_CROSSOVER")
_ATTN = os.environ.get("TRACE_FP4_ATTN", "mma")


def make_engine(model, prov, prompts, gen, device, dtype):
    # read when the engine builds its Triton path (every weight sync); the caller's own setting otherwise
    crossover = "inf,inf" if prov.endswith("-kernels") else _CROSSOVER
    if crossover is None:
        os.environ.pop("TRACE_FP4_CROSSOVER", None)
    else:
        os.environ["TRACE_FP4_CROSSOVER"] = crossover
    os.environ["TRACE_FP4_ATTN"] = "triton" if prov.endswith("-tritonattn") else _ATTN
    eng = RolloutEngine(model.config, dtype=dtype, device=device, max_seq_len=len(prompts[0]) + gen + 1,
                        **engine_kwargs(prov))
    eng.sync_weights(model)
    # allocate the cache, capture the decode graphs (the recording ones for a -record provider)
    eng.prepare(len(prompts), len(prompts[0]), gen, recorder=recorder_for(prov, model))
    # warm-up at full size (prefill kernels, lazy init)
    eng.generate(prompts, max_new_tokens=2, temperature=0.0, recorder=recorder_for(prov, model))
    sync(device)
    return eng


def _generate(eng, prov, model, prompts, gen):
    """One timed call; a -record provider's record is finished inside it (as the RL step does)."""
    rec = recorder_for(prov, model)
    out = eng.generate(prompts, max_new_tokens=gen, temperature=0.0, recorder=rec)
    if rec is not None:
        rec.finish()
    return out


def _timed(fn, device):
    """(result of fn(), seconds including a device sync)."""
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def prepare_provider(model, prov, prompts, gen, device, dtype):
    """-> (engine or None for hf, fn(n) running one call of n new tokens and returning its tokens, setup seconds):
    an engine is built, its graphs captured and warmed up before the clock (`make_engine`), hf generate warmed up."""
    t0 = time.perf_counter()
    if prov == "hf-bf16":
        eng, fn = None, hf_runner(model, prompts, device)
    else:
        eng = make_engine(model, prov, prompts, gen, device, dtype)
        fn = lambda n: _generate(eng, prov, model, prompts, n).num_generated_tokens  # noqa: E731
    return eng, fn, time.perf_counter() - t0


# the breakdown's components: the `rollout.*` record_function labels, then everything else
COMPONENTS = ("attention", "moe", "sampling", "other")


def _trace_events(prof) -> list[dict]:
    """The profiler's Chrome-trace events (device kernels with their start and duration in us among them)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())["traceEvents"]


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _device_parts(prof) -> tuple[dict[str, float], dict[str, float]]:
    """Device milliseconds of every kernel / memcpy / memset, summed by the `rollout.*` label whose GPU-side
    span (a gpu_user_annotation event: first to last kernel of the scope) contains it, and by 'label/kernel name';
    from the profiler's Chrome trace, so no kernel is counted twice and launch gaps count nowhere."""
    events = _trace_events(prof)
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"].split(".", 1)[1]) for e in events
                   if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("rollout."))
    parts = dict.fromkeys(COMPONENTS, 0.0)
    kernels: dict[str, float] = {}
    starts = [s[0] for s in spans]
    for e in events:
        if e.get("cat") not in _DEVICE_CATS:
            continue
        j = bisect.bisect_right(starts, e["ts"]) - 1
        label = spans[j][2] if j >= 0 and e["ts"] < spans[j][1] else "other"
        label = label if label in parts else "other"
        parts[label] += e["dur"] / 1000.0
        key = f"{label}/{str(e.get('name', '?'))[:80]}"
        kernels[key] = kernels.get(key, 0.0) + e["dur"] / 1000.0
    return parts, kernels


def busy_ms(events) -> float:
    """Milliseconds during which the device runs at least one kernel, copy or memset: the union of their
    [ts, ts + dur) intervals (us), so overlapping work counts once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _DEVICE_CATS):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1000.0


def _graph_busy(eng, prompts, gen) -> tuple[float, int]:
    """(device-busy ms, generated tokens) of one generate through the CUDA graphs, the profiler recording device
    activity only (the kernels inside graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = eng.generate(prompts, max_new_tokens=gen, temperature=0.0)
        torch.cuda.synchronize()
    return busy_ms(_trace_events(prof)), out.num_generated_tokens


def graph_busy(eng, prompts, gen) -> float | None:
    """The timed engine's own decode (CUDA graphs on, as the timed calls run it): ms per DECODED token during which
    the GPU runs something, a `gen`-token call minus a prefill-and-one-token call, divided by the difference in
    tokens. The rest of a timed step is the GPU waiting ('graph-idle' in `main`: the host's bookkeeping, the sampled
    tokens' copy, launches). Not the profiled call's wall clock: the profiler itself made it 1.1-1.5x the timed
    step's on the H200 (v5e, kernels/NOTES.md). None where it saw no device work."""
    eng.cuda_graphs = True
    eng.generate(prompts, max_new_tokens=2, temperature=0.0)  # captures this cache size's graphs if new
    b_f, n_f = _graph_busy(eng, prompts, gen)
    b_p, n_p = _graph_busy(eng, prompts, 1)
    return max(b_f - b_p, 0.0) / max(n_f - n_p, 1) if b_f > 0 else None


def _profile(eng, prompts, gen, device) -> tuple[dict[str, float], dict[str, float], int]:
    from torch.profiler import ProfilerActivity, profile

    cuda = str(device).startswith("cuda")
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = eng.generate(prompts, max_new_tokens=gen, temperature=0.0)
        sync(device)
    wall_ms = 1000 * (time.perf_counter() - t0)
    kernels: dict[str, float] = {}
    if cuda:
        parts, kernels = _device_parts(prof)
    else:  # CPU time of the labelled scopes; the rest of the wall clock is 'other' (Python included)
        parts = dict.fromkeys(COMPONENTS[:-1], 0.0)
        for evt in prof.key_averages():
            for k in parts:
                if evt.key == f"rollout.{k}":
                    parts[k] += evt.cpu_time_total / 1000.0
        parts["other"] = max(wall_ms - sum(parts.values()), 0.0)
    return parts, kernels, out.num_generated_tokens


def extend_prompts(prompts, context: int) -> list[list[int]]:
    """Each prompt followed by its own tokens again up to `context` more: a decode step at that much more context
    (the breakdown profiles a few steps at the timed run's mean context)."""
    return [(p * (context // len(p) + 2))[: len(p) + context] for p in prompts]


def breakdown(eng, prompts, gen, device, top: int = 12) -> tuple[dict[str, float], dict[str, float]]:
    """Milliseconds per DECODED token in attention, MoE (or dense MLP), sampling (the passes over the logits,
    `RolloutEngine.sample`) and everything else (embedding, norms, lm_head): one profiled generate of `gen`
    tokens minus one of a single token (the prefill), divided by the difference in tokens. On CUDA: kernel time
    by label (launch gaps excluded, see _device_parts); on a CPU: CPU time of the labels, 'other' = wall - the
    labelled parts. The profiled engine runs eagerly (labels are not visible inside CUDA-graph replays); the
    kernels are the same ones the graphs replay. Labels: the `record_function` scopes of
    trace/rollout/forward.py and engine.py. `eng` is a synced engine (the timed one: its weights are not
    quantized again); its CUDA graphs are switched off. Also the `top` kernels by the same difference, keyed
    'component/kernel name' (on CUDA; what a component's time is made of)."""
    eng.cuda_graphs = False
    eng.generate(prompts, max_new_tokens=2, temperature=0.0)  # eager warm-up at full size
    full, kfull, n_full = _profile(eng, prompts, gen, device)
    pre, kpre, n_pre = _profile(eng, prompts, 1, device)
    n = max(n_full - n_pre, 1)
    res = {k: max(full[k] - pre[k], 0.0) / n for k in COMPONENTS}
    res["total"] = sum(res.values())
    per = {k: max(v - kpre.get(k, 0.0), 0.0) / n for k, v in kfull.items()}
    return res, dict(sorted(per.items(), key=lambda kv: -kv[1])[:top])


def hf_runner(model, prompts, device):
    """transformers generate, warmed up at full size -> fn(n) generating n tokens per row (no early stop)."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def fn(n):
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    fn(2)
    sync(device)
    return fn


def _spread(xs) -> str:
    return f"{min(xs):.0f}-{max(xs):.0f}"


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
    ap.add_argument("--out", default="results/rollout/rollout.csv", help="long table to append to")
    ap.add_argument("--version", default="dev", help="the engine / kernel version under test (a column of every row)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed calls per provider, in rounds that alternate the providers; rows give the median, "
                         "the range and the per-round ratios against engine-bf16 (note)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile each engine provider: ms per token in attention / moe / other (op rollout_breakdown)")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    out = a.out
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    run = dict(version=a.version, commit=git_commit(), gpu=gpu, date=today())
    t_start = time.perf_counter()
    bf16_tps: dict[tuple, float] = {}
    # rows are appended one by one, so a run cut short keeps what it measured
    for name in a.models:
        model = build(name, a.layers, a.device, dtype, a.hf_experts, a.prompt + a.gen + 1)
        vocab = model.config.vocab_size
        for bsz in a.batch:
            g = torch.Generator().manual_seed(bsz)
            prompts = torch.randint(4, min(vocab, 100), (bsz, a.prompt), generator=g).tolist()
            # every provider built first, then `--repeats` rounds timing each in turn: providers alternate, so a slow
            # stretch of the machine (the host's share of a step moves by up to ~1 ms between identical runs on the
            # H200, kernels/NOTES.md v5h) falls on all of them, and each round gives a paired ratio
            ready, notes = {}, {}
            for prov in a.providers:
                if time.perf_counter() - t_start > a.deadline:
                    print(f"deadline reached, skipping {name} b{bsz} {prov}", flush=True)
                    continue
                try:
                    ready[prov] = prepare_provider(model, prov, prompts, a.gen, a.device, dtype)
                except Exception as e:  # noqa: BLE001 - record the failure, keep benchmarking
                    notes[prov] = f"error: {type(e).__name__}: {str(e)[:120]}"
            times: dict[str, list[float]] = {p: [] for p in ready}
            ntoks: dict[str, int] = {}
            for r in range(a.repeats):
                if r and time.perf_counter() - t_start > a.deadline:
                    print(f"deadline reached after {r} rounds of {name} b{bsz}", flush=True)
                    break
                for prov, (_, fn, _) in ready.items():
                    if prov in notes:
                        continue
                    try:
                        ntoks[prov], dt = _timed(lambda fn=fn: fn(a.gen), a.device)
                        times[prov].append(dt)
                    except Exception as e:  # noqa: BLE001
                        notes[prov] = f"error: {type(e).__name__}: {str(e)[:120]}"
            for prov in a.providers:
                eng, fn, setup = ready.get(prov, (None, None, float("nan")))
                dts = times.get(prov) or []
                ntok = ntoks.get(prov, 0) if dts and prov not in notes else 0
                note = notes.get(prov, "")
                if prov == "hf-bf16":
                    note = ";".join(x for x in (note, f"experts={a.hf_experts}") if x)
                dt = float(statistics.median(dts)) if ntok else float("nan")
                pre = _timed(lambda fn=fn: fn(1), a.device)[1] if ntok else float("nan")
                if len(dts) > 1:  # tokens/s of every round, and the per-round ratios against BF16's same round
                    note = ";".join(x for x in (note, f"runs={len(dts)}", f"tok_s_range={_spread([ntok / t for t in dts])}") if x)
                    ref = times.get("engine-bf16") or []
                    if prov != "engine-bf16" and len(ref) == len(dts):
                        paired = sorted(rt / t for rt, t in zip(ref, dts, strict=True))
                        note += f";paired_ratio_median={statistics.median(paired):.3f}"
                        note += f";paired_ratio_range={paired[0]:.3f}-{paired[-1]:.3f}"
                # decode_ms_per_step: (whole call - prefill-and-one-token call) / (gen - 1)
                row = dict(op="rollout_generate", shape=name, provider=prov, batch=bsz, prompt=a.prompt, gen=a.gen,
                           tokens_per_s=round(ntok / dt, 2) if ntok else 0.0, elapsed_s=round(dt, 3),
                           ms_per_step=round(1000 * dt / a.gen, 3), prefill_s=round(pre, 4),
                           decode_ms_per_step=round(1000 * (dt - pre) / max(a.gen - 1, 1), 3),
                           setup_s=round(setup, 2), dtype=str(dtype).replace("torch.", ""),
                           layers=model.config.num_hidden_layers, note=note, **run)
                if prov == "engine-bf16" and ntok:
                    bf16_tps[(name, bsz)] = row["tokens_per_s"]
                b = bf16_tps.get((name, bsz))
                row["ratio_vs_bf16"] = round(row["tokens_per_s"] / b, 3) if (b and ntok) else ""
                append(out, [row], ROLLOUT_FIELDS)
                print(row, flush=True)
                if a.breakdown and eng is not None and not prov.endswith(("-eager", "-record")) and ntok:
                    # a few steps at the timed run's mean context (its attention grows with the context)
                    bgen = min(a.gen, 64)
                    ctx = max(0, min(a.gen // 2, eng.max_seq_len - a.prompt - bgen - 1))
                    bprompts = extend_prompts(prompts, ctx)
                    try:
                        parts, kernels = breakdown(eng, bprompts, bgen, a.device)
                        busy = graph_busy(eng, bprompts, bgen) if a.device.startswith("cuda") else None
                        if busy is not None:  # the timed step's ms per token: busy + idle
                            step = row["decode_ms_per_step"] / bsz
                            parts.update({"graph-busy": busy, "graph-idle": max(step - busy, 0.0)})
                    except Exception as e:  # noqa: BLE001
                        parts, kernels = {}, {}
                        print(f"breakdown {prov} failed: {type(e).__name__}: {e}", flush=True)
                    blank = dict(prompt=a.prompt + ctx, gen=bgen, tokens_per_s="", ratio_vs_bf16="", elapsed_s="",
                                 prefill_s="", decode_ms_per_step="", setup_s="")
                    # rows in ms per decoded token (x batch: per step), as the components
                    append(out, [dict(row, op="rollout_breakdown", **blank, ms_per_step=round(ms, 5),
                                      note=f"component={comp}") for comp, ms in parts.items()]
                           + [dict(row, op="rollout_kernel", **blank, ms_per_step=round(ms, 6),
                                   note=f"component={key.split('/', 1)[0]};kernel={key.split('/', 1)[1]}".replace(",", " "))
                              for key, ms in kernels.items()], ROLLOUT_FIELDS)
                    print("breakdown", prov, {k: round(v, 4) for k, v in parts.items()}, flush=True)
                    for key, ms in kernels.items():
                        print(f"  kernel {prov} {ms * bsz:8.3f} ms/step  {key}", flush=True)
            ready.clear()
            eng = None
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
        del model
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
