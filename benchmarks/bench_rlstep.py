"""One RL step per arm, timed phase by phase in one process on an otherwise idle device: where the step's time
goes (rollout, TRACE's recording, the trainer's forward+backward and its replay, optimizer, weight sync), what the
record costs in bytes per generated token beside the BF16 KV cache, the rollout's speed against the BF16
arm's, and the trainer's model FLOPs utilization, at a model's layer shapes (the medium flavors: the real models'
layers, few of them; or a small flavor at its profile's RL settings, e.g. --profile experiments/profiles/small-v2.yaml
--model qwen3_moe-small).

    PYTHONPATH=. python benchmarks/bench_rlstep.py --device cuda --profile experiments/profiles/medium.yaml \
        --model qwen3_moe-medium --task reasoning --prompts 32 --group-size 8 --gen 1024 [--steps 3] \
        [--arms bf16 fp4-naive qat-independent trace trace-deep] [--kernels auto off] [--init-ckpt DIR] [--procs N]

Each (arm, kernels) builds the RL trainer (trace/rl/trainer.py) from the profile's run config (seed 0; random
weights unless --init-ckpt; an ablation arm of the profile such as `trace-deep` is its method with its settings),
runs --steps steps and keeps the medians of the steps after the first (warm-up: CUDA graphs, Triton compiles).
With --gen N every sequence generates exactly N tokens: the engine is called without the stop token and the stop
string (the trainer's rollout otherwise unchanged), so every arm trains on the same shape and the prompts, which
derive from (seed, step), are the same in every arm; the row says `forced`. --natural keeps the task's stops
(then --gen is the length limit and `gen_per_seq` says what was generated). An arm with the alignment term takes
rl.align_coef from the profile's calibration file; where that file does not exist yet it takes the trainer's default
and the row's note says so (the step's work does not depend on the coefficient's value, only on its being positive).

Columns (rows APPENDED to --out, default results/rlstep/rlstep.csv; DESIGN.md §6 "RL step"):
  rollout_s     the step's rollout phase: generation with the arm's recording, scoring, the record's finish
  generate_again_s   the step's generate call repeated right after the step (same prompts, seed, weights; its decode
                graphs already captured): steady-state generation; arms without a record only (empty otherwise)
  generate_s    generation alone (the arm's recording excluded); record_s: the arm's own guidance record (storing
                its rows, the engine's feed that exists only for it, its finish), record_frac = record_s / rollout_s
  tok_s         generated tokens / rollout_s; tok_s_vs_bf16 = tok_s / the bf16 arm's in the same run
  record_bytes_per_token   the arm's record per generated token (DESIGN.md §3 accounting); kv_bf16_bytes_per_token:
                the BF16 KV cache of the same model per token (K and V, every layer)
  train_s       the step's train phase = fwd_bwd_s + optimizer_s + sync_s + the rest (batch, advantages, metrics)
  fwd_bwd_s     trainer forward (inside the arm's replay), loss and backward with gradient clipping (with
                --micro-batch: every micro-batch's forward, loss and backward, then the clipping)
  replay_s      the part of fwd_bwd_s that the replay costs: fwd_bwd_s minus the same batch's forward, loss and
                backward without any record, timed right after the step (paired, same process); 0 without a record
  optimizer_s   AdamW's step; sync_s: the engine's weight sync (re-quantization for the FP4 engines)
  peak_gb       the trainer process's GPU peak over the step (allocator statistics; empty off a GPU)
  train_vs_qat_independent, train_vs_bf16   train_s over that arm's with the same kernels setting
  k3_first, k3  rollout/trainer mismatch of the first step (same weights on both sides) and its median
  micro_batch   --micro-batch: sequences per trainer forward/backward (rl.micro_batch; empty: the whole batch)
  procs, steps_per_s   as --procs: N processes of the arm at once (runs sharing a GPU), N / step_s
  experts       the QAT experts' implementation the trainer ran (rl.experts, --experts, resolved on the device: auto
                is grouped on a GPU and the loop on the CPU; trace/qat/experts.py)
  train_tokens  the tokens of a step's trainer forward+backward: per sequence its input tokens, the prompt and the
                generated tokens but the last generated one (a target only), padding excluded
  fwd_bwd_flops the model FLOPs of that forward+backward (benchmarks/flops.py; PaLM's MFU numerator, Chowdhery et al.
                2022, Appendix B): per sequence of T input tokens T x (6 N_active + 12 L H d_head T), N_active the
                parameters of the matrix multiplies a token passes through (attention projections, router, the top-k
                experts' share of the expert weights, a shared expert, LM head), 6 = 2 FLOPs a multiply-add x
                (forward + a backward of twice the forward); the second term the attention scores and their weighted
                sum (QK^T and AV) over the whole T, not the causal half. Not counted: fake quantization, the replay, a
                recomputed expert forward, the KL reference's forward (rl.kl_coef > 0). Medians over the timed steps
  peak_tflops   the card's dense BF16 GEMM rate in TFLOP/s, measured once at the start of the run in this process
                (flops.bf16_gemm_tflops: median of 10 timed 8192^3 matmuls); empty off a GPU
  mfu           fwd_bwd_flops / fwd_bwd_s / (peak_tflops x 1e12); empty off a GPU. fwd_bwd_s holds the arm's FP4
                emulation and replay, which the numerator does not count, so they lower the arm's mfu. With --procs N:
                one process's share of the card
Compared against: the bf16 arm (no FP4 anywhere) and qat-independent (the FP4 trainer without guidance).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.flops import bf16_gemm_tflops, mfu, train_flops  # noqa: E402
from benchmarks.results_table import append, git_commit, read, today  # noqa: E402
from benchmarks.trainer_memory import CalibrationMissing, step_config  # noqa: E402
from trace.arms import ARMS  # noqa: E402
from trace.models.registry import head_dim_of  # noqa: E402
from trace.qat.experts import resolve as resolve_experts  # noqa: E402
from trace.rl.trainer import RLTrainer, token_logprobs  # noqa: E402

FIELDS = ("version", "commit", "gpu", "date", "model", "task", "arm", "method", "rho", "fp4_kernels", "prompts",
          "group_size", "batch", "gen", "gen_per_seq", "forced", "steps", "step_s", "rollout_s", "generate_s",
          "record_s", "record_frac", "tok_s", "tok_s_vs_bf16", "record_bytes_per_token", "kv_bf16_bytes_per_token",
          "train_s", "fwd_bwd_s", "replay_s", "optimizer_s", "sync_s", "train_vs_qat_independent", "train_vs_bf16",
          "peak_gb", "k3_first", "k3", "procs", "steps_per_s", "recompute_experts", "micro_batch", "note",
          "generate_again_s", "experts", "train_tokens", "fwd_bwd_flops", "peak_tflops", "mfu")
# the timed phases, medians over the steps after the first
PHASES = ("step_s", "rollout_s", "generate_s", "record_s", "train_s", "fwd_bwd_s", "replay_s", "optimizer_s",
          "sync_s")


def kv_bf16_bytes_per_token(config) -> int:
    """Bytes of one token's BF16 KV cache: K and V of every layer, num_key_value_heads x head_dim each."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config) * 2


class PhaseClock:
    """Times the trainer's train-phase pieces by wrapping them on the instance (device synchronized at each boundary,
    so asynchronous GPU work is charged to the piece that launched it): the log-probs (`RLTrainer.logprobs`), the
    policy loss, each chunk's backward and the clipped optimizer step (`TrainStep.backward`, `TrainStep.apply`);
    forces the rollout's length, and keeps the last step's train batches for the replay probe. The alignment term's
    diagnostic split backward runs outside these pieces, as it is outside time_train_s."""

    def __init__(self, tr: RLTrainer, force: bool):
        self.tr, self.s = tr, {}
        self.cuda = torch.device(tr.device).type == "cuda"
        self.kept, self.replayed = [], False  # the last step's (train batch, advantages) per forward; a record?
        self._wrap(tr, "logprobs", "fwd_bwd_s")
        self._wrap(tr, "policy_loss", "fwd_bwd_s", keep=True)
        # one backward per chunk (the whole batch, or each micro-batch) and one clipped step
        self._wrap(tr.train, "backward", "fwd_bwd_s")
        self._wrap(tr.train, "apply", "fwd_bwd_s")
        self._wrap(tr.opt, "step", "optimizer_s")  # inside apply: charged here, taken out of fwd_bwd_s
        self._wrap(tr.engine, "sync_weights", "sync_s")
        gen = tr.engine.generate
        self.last_call = None  # the step's generate call (args, kwargs), repeated by `generate_again`

        def generate(*a, **k):
            if force:
                k = {**k, "stop_token_ids": (), "stop_strings": ()}
            self.last_call = (a, k)
            return gen(*a, **k)

        tr.engine.generate = generate
        self._generate = gen

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.tr.device)

    def _wrap(self, obj, name: str, phase: str, keep: bool = False):
        inner = getattr(obj, name, None)
        if inner is None:
            return

        def timed(*a, **k):
            self.sync()
            t0 = time.perf_counter()
            out = inner(*a, **k)
            self.sync()
            dt = time.perf_counter() - t0
            self.s[phase] = self.s.get(phase, 0.0) + dt
            if name == "step":  # the optimizer's step runs inside apply, which fwd_bwd_s already timed
                self.s["fwd_bwd_s"] = self.s.get("fwd_bwd_s", 0.0) - dt
            if keep:
                self.kept.append((a[1], a[2]))
            if name == "logprobs":
                self.replayed = self.replayed or out.stats is not None
            return out

        setattr(obj, name, timed)

    def step(self, i: int) -> dict:
        """RL step i with its phase times and its trainer inputs' lengths (`seq_lens`: each sequence's input tokens,
        padding excluded, over every forward of the step); for a step that replayed a record, replay_s from the
        paired probe."""
        self.s, self.kept, self.replayed = {}, [], False
        m = self.tr.step(i).to_dict()
        seq_lens = [int(n) for tb, _ in self.kept for n in tb.att.sum(1).tolist()]
        replay = self.fwd_bwd_without_record(self.kept) if self.replayed else None
        self.kept = []
        return {**m, **self.s, "replay_s": self.s["fwd_bwd_s"] - replay if replay is not None else 0.0,
                "generate_again_s": self.generate_again(), "seq_lens": seq_lens}

    def generate_again(self) -> float | None:
        """Seconds of the step's generate call made again right after the step: same prompts, seed and weights, the
        engine's decode graphs already captured for them (a weight sync keeps them: it copies into the captured
        tensors), so generate_s minus this is what the step's call spent outside steady-state decoding. Only for calls
        without a recorder (a second call would record again); None otherwise."""
        if self.last_call is None or self.last_call[1].get("recorder") is not None:
            return None
        a, k = self.last_call
        self.sync()
        t0 = time.perf_counter()
        self._generate(*a, **k)
        self.sync()
        return time.perf_counter() - t0

    def fwd_bwd_without_record(self, kept) -> float:
        """Seconds of the step's forwards, losses and backwards on the same batches (the whole batch, or each
        micro-batch in turn) outside any replay (plain RTN in the arm's trainer mode, no alignment term); the
        gradients are dropped, nothing is applied."""
        tr = self.tr
        self.sync()
        t0 = time.perf_counter()
        tr.opt.zero_grad(set_to_none=True)
        for tb, adv in kept:
            lp = token_logprobs(tr.model, tb, tr.rl["autocast"] == "bf16", tr.rl["temperature"])
            loss, _ = type(tr).policy_loss(tr, lp, tb, adv)  # the class's: outside this clock's wrapper
            loss.backward()
            del lp, loss
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), tr.rl["grad_clip"])
        self.sync()
        dt = time.perf_counter() - t0
        tr.opt.zero_grad(set_to_none=True)
        return dt


def time_arm(cfg: dict, steps: int, force: bool) -> dict:
    """Medians over steps 2..steps of the phase times; tokens, record bytes, GPU peak, and the rollout/trainer
    mismatch k3 of the first step (before any update) and its median over all steps; the trainer's tokens and
    model FLOPs of a step (medians over steps 2..steps)."""
    with tempfile.TemporaryDirectory() as out:
        tr = RLTrainer(cfg, out, progress=False)
        clock = PhaseClock(tr, force)
        ms = [clock.step(i) for i in range(1, steps + 1)]
        recompute = tr.model._trace_rt.recompute_experts  # what the trainer ran, not what was asked
        experts = resolve_experts(tr.model._trace_rt.experts, torch.device(tr.device))
        config = tr.model.config
        kv = kv_bf16_bytes_per_token(config)
    k3 = [m["k3"] for m in ms]
    batch = cfg["rl"]["prompts_per_step"] * cfg["rl"]["group_size"]
    ms = ms[1:]
    med = lambda k: statistics.median(m[k] for m in ms)  # noqa: E731
    r = {"rollout_s": med("time_rollout_s"), "generate_s": med("time_generate_s"), "record_s": med("time_record_s"),
         "train_s": med("time_train_s"), **{p: med(p) for p in ("fwd_bwd_s", "replay_s", "optimizer_s", "sync_s")}}
    r["step_s"] = r["rollout_s"] + r["train_s"]
    again = [m["generate_again_s"] for m in ms if m["generate_again_s"] is not None]
    r["generate_again_s"] = statistics.median(again) if again else None
    # generated tokens of a step (the trainer logs their rate over the generation time)
    n_gen = statistics.median(round(m["rollout_gen_tokens_per_s"] * m["time_generate_s"]) for m in ms)
    peaks = [m["gpu_peak_alloc_gb"] for m in ms if m["gpu_peak_alloc_gb"] is not None]
    return {**r, "gen_per_seq": n_gen / batch, "tok_s": n_gen / r["rollout_s"],
            "record_frac": r["record_s"] / r["rollout_s"],
            "record_bytes_per_token": med("guidance_bytes_per_gen_token"), "kv_bf16_bytes_per_token": kv,
            "peak_gb": max(peaks) if peaks else None, "k3_first": k3[0], "k3": statistics.median(k3),
            "recompute_experts": recompute, "experts": experts,
            "train_tokens": statistics.median(sum(m["seq_lens"]) for m in ms),
            "fwd_bwd_flops": statistics.median(train_flops(config, m["seq_lens"]) for m in ms)}


def time_arm_in_procs(argv: list[str], arm: str, kernels: str, procs: int) -> dict:
    """time_arm's fields for one (arm, kernels) run in `procs` processes of this script at once (each --procs 1):
    medians over the processes of their times, the largest peak, the first process's tokens, bytes and k3 (the same
    in all: same config, same seed)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"p{i}.csv") for i in range(procs)]
        jobs = [subprocess.Popen([sys.executable, __file__, *argv, "--arms", arm, "--kernels", kernels, "--procs", "1",
                                  "--out", o], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for o in outs]
        errs = [j.communicate()[1] for j in jobs]
        for j, e in zip(jobs, errs, strict=True):
            if j.returncode != 0:
                raise RuntimeError(f"a process of {arm} ({kernels}) failed:\n{e[-3000:]}")
        rows = [read(o)[0] for o in outs]
    med = lambda k: statistics.median(float(r[k]) for r in rows)  # noqa: E731
    peaks = [float(r["peak_gb"]) for r in rows if r["peak_gb"] not in ("", "None")]
    first = rows[0]
    again = [float(r["generate_again_s"]) for r in rows if r.get("generate_again_s") not in (None, "", "None")]
    return {**{p: med(p) for p in PHASES}, "record_frac": med("record_frac"), "tok_s": med("tok_s"),
            "generate_again_s": statistics.median(again) if again else None,
            "peak_gb": max(peaks) if peaks else None,
            **{k: float(first[k]) for k in ("gen_per_seq", "record_bytes_per_token", "k3_first", "k3", "train_tokens",
                                            "fwd_bwd_flops")},
            "kv_bf16_bytes_per_token": int(first["kv_bf16_bytes_per_token"]), "experts": first["experts"],
            "recompute_experts": all(r["recompute_experts"] == "True" for r in rows)}


SAME_RUN = ("version", "commit", "gpu", "model", "task", "batch", "gen", "forced", "experts")


def add_ratios(rows: list[dict], earlier: list[dict] = ()) -> None:
    """Each row's train time over qat-independent's and bf16's, and its tokens/s over bf16's, taking the reference
    row of the same kernels setting where there is one (bf16 runs once, with the default setting). The references
    are these rows or `earlier` rows of the same run (SAME_RUN: a benchmark split over calls on one machine that
    append to one table, e.g. scripts/gpu/jobs/medium_rlstep.jobs)."""
    key = lambda r: tuple(str(r.get(k, "")) for k in SAME_RUN)  # noqa: E731  (a table's older rows lack experts)
    refs = list(rows) + [{**e, "train_s": float(e["train_s"]), "tok_s": float(e["tok_s"])}
                         for e in earlier if key(e) in {key(r) for r in rows}]
    for r in rows:
        for base, col, k in (("qat-independent", "train_vs_qat_independent", "train_s"),
                              ("bf16", "train_vs_bf16", "train_s"), ("bf16", "tok_s_vs_bf16", "tok_s")):
            ref = [b for b in refs if b["arm"] == base and key(b) == key(r)
                   and b["fp4_kernels"] in (r["fp4_kernels"], "auto")]
            ref = [b for b in ref if b["fp4_kernels"] == r["fp4_kernels"]] or ref
            r[col] = round(r[k] / ref[0][k], 3) if ref else None


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="experiments/profiles/medium.yaml")
    ap.add_argument("--model", default="qwen3_moe-medium")
    ap.add_argument("--task", default="reasoning")
    ap.add_argument("--arms", nargs="+", default=["bf16", "fp4-naive", "qat-independent", "trace", "trace-deep"])
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="TRACE_FP4_KERNELS settings to run the FP4 arms with (bf16 runs once, auto)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the profile's)")
    ap.add_argument("--group-size", type=int, default=None, help="samples per prompt (default: the profile's)")
    ap.add_argument("--gen", type=int, default=None, help="generated tokens per sequence (default: the profile's "
                    "rl.max_new_tokens), forced unless --natural")
    ap.add_argument("--natural", action="store_true", help="keep the task's stop token and string")
    ap.add_argument("--init-ckpt", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--version", default="dev")
    ap.add_argument("--out", default="results/rlstep/rlstep.csv")
    ap.add_argument("--procs", type=int, default=1, help="processes at once per (arm, kernels), as runs share a GPU")
    ap.add_argument("--recompute-experts", action="store_true",
                    help="rl.recompute_experts on: less trainer memory, one more expert forward per step")
    ap.add_argument("--experts", choices=("auto", "loop", "grouped"), default=None,
                    help="rl.experts: the QAT experts' implementation (default auto; loop vs grouped in one run: two calls)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="rl.micro_batch: sequences per trainer forward/backward (default: the whole batch)")
    ap.add_argument("--note", default="", help="appended to every row's note")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the card's BF16 GEMM rate for mfu (default: measured at the start on a GPU; --procs hands "
                         "its processes the rate it measured); ignored off a GPU")
    a = ap.parse_args(argv)
    if a.procs < 1:
        ap.error("--procs must be at least 1")
    if a.steps < 2:
        ap.error("--steps must be at least 2 (the first is warm-up)")
    # the peak before any arm, on an idle card: absolute rates only on a GPU
    on_gpu = a.device.startswith("cuda")
    a.peak_tflops = (a.peak_tflops or bf16_gemm_tflops(device=a.device)) if on_gpu else None
    # what each process of --procs gets: every given argument but the arms, kernels, processes and output
    child = [w for k, v in vars(a).items() if v is not None and v is not False and v != ""
             and k not in ("arms", "kernels", "procs", "out")
             for w in ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v)))]
    rows, before = [], os.environ.get("TRACE_FP4_KERNELS")
    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    try:
        for arm in a.arms:
            rl = {"recompute_experts": a.recompute_experts, "eval_every": 0}
            if a.micro_batch:
                rl["micro_batch"] = a.micro_batch
            if a.experts:
                rl["experts"] = a.experts
            rl.update({k: v for k, v in (("group_size", a.group_size), ("max_new_tokens", a.gen)) if v})
            try:
                cfg, full = step_config(a.profile, a.model, a.task, arm, a.prompts or 1, init_ckpt=a.init_ckpt, **rl)
                calibrated = True
            except CalibrationMissing:
                cfg, full = step_config(a.profile, a.model, a.task, arm, a.prompts or 1, init_ckpt=a.init_ckpt,
                                        calibrated=False, **rl)
                calibrated = False
            if not a.prompts:
                cfg, _ = step_config(a.profile, a.model, a.task, arm, full, init_ckpt=a.init_ckpt,
                                     calibrated=calibrated, **rl)
            cfg["device"] = a.device
            method = cfg["rl"]["method"]
            for k in (a.kernels if ARMS[method].engine_mode != "bf16" else ["auto"]):
                os.environ["TRACE_FP4_KERNELS"] = k
                t0 = time.perf_counter()
                r = (time_arm(cfg, a.steps, not a.natural) if a.procs == 1
                     else time_arm_in_procs(child, arm, k, a.procs))
                rlc = cfg["rl"]
                note = "; ".join(x for x in (
                    "forced: stop token and stop string ignored" if not a.natural else "natural stops",
                    "random init" if not a.init_ckpt else "", f"{time.perf_counter() - t0:.0f} s with setup",
                    f"experts {a.experts}" if a.experts else "",
                    "" if calibrated else f"align_coef {rlc['align_coef']:g}: the trainer's default (no calibration "
                                          "file)",
                    a.note) if x)
                rows.append({"version": a.version, "commit": git_commit(), "gpu": gpu, "date": today(),
                             "model": a.model, "task": a.task, "arm": arm, "method": method,
                             "rho": rlc["rho"] if ARMS[method].record == "guide" else "",
                             "fp4_kernels": k, "prompts": rlc["prompts_per_step"], "group_size": rlc["group_size"],
                             "batch": rlc["prompts_per_step"] * rlc["group_size"], "gen": rlc["max_new_tokens"],
                             "forced": not a.natural, "steps": a.steps, **r, "procs": a.procs,
                             "micro_batch": rlc.get("micro_batch") or "",
                             "steps_per_s": round(a.procs / r["step_s"], 4), "note": note,
                             "peak_tflops": a.peak_tflops,
                             "mfu": mfu(r["fwd_bwd_flops"], r["fwd_bwd_s"], a.peak_tflops)})
                print({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in rows[-1].items()}, flush=True)
    finally:
        if before is None:
            os.environ.pop("TRACE_FP4_KERNELS", None)
        else:
            os.environ["TRACE_FP4_KERNELS"] = before
    add_ratios(rows, read(a.out))
    append(a.out, rows, FIELDS)
    print(f"appended {len(rows)} rows to {a.out}")
    return rows


if __name__ == "__main__":
    main()
