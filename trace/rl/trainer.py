"""GRPO-style RL trainer with the method arms of DESIGN.md §4 and per-step train-rollout mismatch metrics.

    python -m trace.rl --config experiments/configs/smoke_rl_reasoning.yaml --out runs/rl_trace

One step (`RLTrainer._step`, read top-down):
  episode     `trace.episode.run_episode` (the same step evaluation runs): prompts seeded by (seed, step),
              `RolloutEngine.generate` (bf16 engine for `bf16`; W4A4 + FP4 KV for every FP4 arm), rewards
              from the task verifier (the multi-turn env for long_horizon). It records TRACE guidance for
              `trace*` (deepest `rho` of the layers; mantissa+scales, or full codes for `trace-fullcodes`;
              expert ids of every MoE layer with routing replay) and, for every arm whose trainer
              quantizes activations, a full-codes diagnostic record of all layers used only to count
              flips (never to guide, never in bytes; `rl.diag_flips`)
  batch       `build_train_batch`: inputs, targets, (seq, pos) addressing, rollout log-probs
  advantages  group_norm / rloo / reinforce_baseline (OpenRLHF numerics)
  forward     the patched HF model in the arm's mode (bf16 for bf16 and fp4-naive, w4a16 for
              qat-weight-only, w4a4kv4 for qat-independent and trace*) under BF16 autocast on FP32
              master weights, inside the arm's `Method.replay` whenever a record exists (guided rounding,
              routing replay and alignment term for trace; flip statistics against the diagnostic record)
  exact       the `exact` arm instead of the forward above: the log-probs' values from the engine's batch-invariant
              forward over the rollout's tokens (`RolloutEngine.score` on the kernels the rollout sampled with: the
              rollout's log-probs bit for bit), their gradient the QAT forward's with each layer's input pinned to
              the engine's residual stream (`_exact_logprobs`, `trace.qat.pinned_inputs`)
  micro       with `rl.micro_batch` (sequences per forward/backward) the forward, loss and backward run in
              chunks of the batch with gradients accumulated, normalized over the whole batch
              (trace/rl/microbatch.py): the whole-batch step's loss, gradient and metrics
  loss        PPO-clip vs the rollout log-probs with TIS / ICEPOP, + kl_coef * KL(ref) + the arm's weighted
              alignment term (`Method.alignment`)
  optimizer   AdamW with gradient clipping
  weight sync `engine.sync_weights(model)` (FP4 weights re-quantized by trace.fp4.quantize_weight); the
              engine computes in BF16 on CUDA and FP32 on the CPU (`default_dtype`, DESIGN.md §4).
The arms (what each rolls out, records and trains) are the table in trace/arms.py; the method's wiring
(recorders, replay, weighted alignment term, record bytes) is `trace.guidance.Method`, which the OpenRLHF
actors share.

Log-probs on both sides are those of the sampling distribution, at `rl.temperature` (the engine's
log_softmax(logits / T), the trainer's likewise), so TIS and the mismatch metrics compare the behaviour
policy with the trainer's policy at the same temperature.
Mismatch metrics (k1, k3, |dlp| mean/max, ratio-outside fraction, chi2) compare the trainer forward's
log-probs, in its own quantized mode, with the rollout's, over trainable tokens. For the exact arm those are the
engine's values (k3 = 0 by construction); `k3_grad` is the k3 of the pinned QAT forward's own log-probs against
the rollout's, the function whose gradient the step takes. Per-layer flip rates
(DESIGN.md §3 diagnostics: the trainer's code before guidance vs the rollout's, with the rollout's
routing) cover all layers for every arm whose trainer quantizes activations (qat-independent, trace*);
they are empty dicts for bf16 / fp4-naive / qat-weight-only. Guidance bytes are those of the arm's own
record per generated token, and its bits per guided element (n/a without one).
Speed: `rollout_gen_tokens_per_s` = generated tokens / generation time with all recording excluded;
`record_overhead` = time spent on the arm's own guidance record (storing its rows, the engine's final
feed that exists only for records, `Recorder.finish`) / generation time, 0 for arms without one (the
diagnostic record is never timed into either).

PPO ratio (`rl.ppo_ratio`): "trainer" (default; OpenRLHF's decoupled form: the old policy is the
trainer's own detached log-prob, so the PPO ratio is 1 on the single update and the rollout mismatch
is corrected only by TIS, weight min(pi_train / pi_rollout, tis_cap) with tis_cap 2.0 by default
(FlashRL-style truncated IS, DESIGN.md §4: every arm shares it), or ICEPOP's mask) or "rollout" (the
old policy is the rollout: ratio = exp(lp_train - lp_rollout), so PPO's clip also acts on the mismatch
and TIS applies it a second time; kept for comparison).

Determinism: prompts, rollout seeds and evaluation seeds derive from (seed, step), model and optimizer
state are checkpointed exactly, so a resumed run reproduces an uninterrupted one on the CPU.
Non-finite logits, loss or gradients raise `NonFiniteError` before the optimizer step (nothing applied,
the last checkpoint untouched). Compared against: OpenRLHF 0.11.2 losses (tests/rl/test_openrlhf_crosscheck.py).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from trace import rundir
from trace.config import ConfigError
from trace.episode import build_task, evaluate_policy, run_episode
from trace.guidance import Method, Tee
from trace.models import build_model, build_tokenizer, load_checkpoint
from trace.qat import patch_model, pinned_inputs
from trace.rl.losses import (
    NonFiniteError,
    compute_advantages,
    kl_k3,
    masked_mean,
    mismatch_metrics,
    policy_loss,
)
from trace.rl.microbatch import micro_step, split_grad
from trace.rollout import RolloutEngine


# ----------------------------------------------------------------------------------------------
# Batch construction for the trainer forward
# ----------------------------------------------------------------------------------------------
@dataclass
class TrainBatch:
    ids: torch.Tensor  # [B, T] inputs (right padded)
    att: torch.Tensor  # [B, T] 1 = real token
    tgt: torch.Tensor  # [B, T] next token
    pos: torch.Tensor  # [B, T] absolute position, -1 = padding (record addressing)
    seq: torch.Tensor  # [B] record seq id
    mask: torch.Tensor  # [B, T] bool: target is a trainable (policy) token
    lp_roll: torch.Tensor  # [B, T] rollout log-prob of the target (0 where not trainable)


def build_train_batch(batch, pad_id: int, device="cpu") -> TrainBatch:
    """Inputs are tokens[:j] where j is the index of the sample's last trainable token: every input
    position was fed through the rollout engine (so it is in any record) and every trainable target
    has its logits. Environment tokens after the last action (e.g. "correct\\n") are not needed."""
    B = len(batch.tokens)
    lens = []
    for b in range(B):
        P = batch.prompt_lens[b]
        tr = batch.trainable[b]
        last = max((k for k, t in enumerate(tr) if t), default=None)
        if last is None:
            raise ValueError(f"sample {b} has no trainable token (empty response)")
        lens.append(P + last)  # inputs 0 .. P+last-1 predict targets 1 .. P+last
    T = max(lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    tgt = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    lp = torch.zeros((B, T), dtype=torch.float32)
    for b, n in enumerate(lens):
        toks = torch.as_tensor(batch.tokens[b][: n + 1], dtype=torch.long)
        P = batch.prompt_lens[b]
        ids[b, :n] = toks[:n]
        tgt[b, :n] = toks[1:]
        att[b, :n] = 1
        pos[b, :n] = torch.arange(n)
        k = n + 1 - P  # response tokens covered: indices 0..k-1, target of input position P-1+i
        mask[b, P - 1: n] = torch.as_tensor(batch.trainable[b][:k], dtype=torch.bool)
        lp[b, P - 1: n] = torch.as_tensor(batch.logprobs[b][:k], dtype=torch.float32)
    seq = torch.as_tensor(batch.seq_ids, dtype=torch.long)
    d = torch.device(device)
    return TrainBatch(ids.to(d), att.to(d), tgt.to(d), pos.to(d), seq.to(d), mask.to(d), lp.to(d))


def token_logprobs(model, tb: TrainBatch, autocast: bool, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, T] of the targets under the model's distribution at `temperature` (the rollout's
    sampling temperature: the behaviour policy the engine's log-probs describe)."""
    dev_type = tb.ids.device.type
    with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=tb.ids, attention_mask=tb.att).logits
    logits = logits.float() / temperature
    valid = tb.att.bool()
    if not bool(torch.isfinite(logits[valid]).all()):
        raise NonFiniteError("non-finite logits in the trainer forward")
    return F.log_softmax(logits, dim=-1).gather(-1, tb.tgt[..., None]).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------
class RLTrainer:
    def __init__(self, cfg: dict, out: str | Path, progress: bool = True):
        rundir.set_threads(cfg)
        self.cfg, self.rl = cfg, cfg["rl"]
        self.progress = progress
        self.method = Method.from_config(self.rl)  # the arm's recorders, replay and alignment term
        self.arm = self.method.arm
        if self.method.exact and torch.device(cfg["device"]).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"config key 'device': the {self.rl['method']} arm on a CPU runs the Triton kernels in "
                              "the interpreter; set TRITON_INTERPRET=1 before starting (or run on a GPU)")
        self.out = rundir.prepare_run_dir(out, cfg, kind="rl")
        self.device = cfg["device"]
        self.task = build_task(cfg)
        self.tok = build_tokenizer()
        t = cfg["task"]
        self.train_set = self.task.make_split("train", t["n_train"], t["seed"])

        init = self.rl["init_ckpt"]
        self.init_dir = rundir.resolve_checkpoint(init) if init else None
        latest = rundir.latest_checkpoint(self.out)
        if latest is not None:
            self.model, _ = load_checkpoint(latest, device=self.device, load_tokenizer=False)
            state = rundir.load_trainer_state(latest)
            self.start_step = int(state["step"])
        else:
            if self.init_dir is not None:
                self.model, _ = load_checkpoint(self.init_dir, device=self.device, load_tokenizer=False)
            else:
                self.model = build_model(cfg["model"], seed=cfg["seed"], device=self.device)
            state, self.start_step = None, 0
        self.resumed = latest is not None
        self.model.train()
        self.rt = patch_model(self.model, self.arm.trainer_mode, self.rl["fmt"])
        self.rt.recompute_experts = self.rl["recompute_experts"]
        self.rt.experts = self.rl.get("experts") or "auto"  # the experts' loop or grouped path (trace/qat/experts.py)
        self.ref = None
        if self.rl["kl_coef"] > 0:
            # the reference is the initial policy (SFT checkpoint), unquantized and frozen
            if self.init_dir is not None:
                self.ref, _ = load_checkpoint(self.init_dir, device=self.device, load_tokenizer=False)
            else:
                self.ref = build_model(cfg["model"], seed=cfg["seed"], device=self.device)
            self.ref.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.rl["lr"], betas=(0.9, 0.99),
                                     weight_decay=self.rl["weight_decay"])
        if state is not None:
            self.opt.load_state_dict(state["optimizer"])
        self.engine = RolloutEngine(self.model.config, mode=self.arm.engine_mode, fmt=self.rl["fmt"],
                                    kv_fp4=self.arm.kv_fp4, device=self.device, batch_invariant=self.method.exact)
        self.engine.sync_weights(self.model)
        self.num_layers = self.model.config.num_hidden_layers

    # ------------------------------------------------------------------------------ pieces
    def _prompts_for(self, step: int):
        g = torch.Generator().manual_seed(self.cfg["seed"] * 1_000_003 + 7919 * step + 17)
        idx = torch.randperm(len(self.train_set), generator=g)[: self.rl["prompts_per_step"]].tolist()
        return [self.train_set[i] for i in idx]

    def _replayed_logprobs(self, tb: TrainBatch, record, diag):
        """Trainer forward of the train batch in the arm's mode; inside replay when a record exists
        (the arm's guidance record and/or the diagnostic one). Returns (log-probs [B, T], ReplayStats
        or None)."""
        with self.method.replay(self.rt, record, diag, tb.seq, tb.pos) as stats:
            lp = token_logprobs(self.model, tb, self.rl["autocast"] == "bf16", self.rl["temperature"])
        return lp, stats

    def _exact_logprobs(self, tokens, tb: TrainBatch) -> tuple[torch.Tensor, float, torch.Tensor]:
        """The exact arm's log-probs [B, T], the seconds of the engine's forward and the pinned QAT forward's own
        log-probs g [B, T] (detached: the function whose gradient the step takes, for `k3_grad`). Values: the engine's
        batch-invariant forward over each sample's input tokens and target (`RolloutEngine.score`: one
        full-sequence forward on the kernels and configs the rollout sampled with, log-probs from the same per-row
        kernel), equal to the rollout's log-probs bit for bit. Gradient: the QAT forward's (the trainer mode's
        straight-through FP4 fake quantization) with each decoder layer's input and the final norm's pinned to the
        engine's residual stream there (`trace.qat.pinned_inputs`), so each layer's backward is evaluated at the
        engine's activations (DESIGN.md §4 "Exact on-policy arm"): v + (g - g.detach()) is v exactly (g - g.detach()
        is 0 for a finite g) with g's gradient. tokens: the rollout's token lists of tb's rows."""
        t0 = time.perf_counter()
        n = tb.att.sum(1).tolist()
        streams: list[torch.Tensor] = []
        rows = self.engine.score([list(tokens[b][: n[b] + 1]) for b in range(len(n))],
                                 temperature=self.rl["temperature"] or 1.0,  # greedy rollouts report temperature 1
                                 streams=streams)
        v = torch.zeros(tb.ids.shape, dtype=torch.float32)
        for b, r in enumerate(rows):
            v[b, : len(r)] = torch.tensor(r, dtype=torch.float32)
        t_engine = time.perf_counter() - t0
        T = tb.ids.shape[1]  # the engine also fed each sample's last target: one position more
        with pinned_inputs(self.model, [s[:, :T] for s in streams]):
            lp = token_logprobs(self.model, tb, self.rl["autocast"] == "bf16", self.rl["temperature"])
        g = torch.where(tb.att.bool(), lp - lp.detach(), torch.zeros_like(lp))
        return v.to(lp.device) + g, t_engine, lp.detach()

    # ------------------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        """Run RL step number `step` (1-based) and return its metrics. Non-finite values anywhere
        before the optimizer step (engine logits, FP4 library inputs, trainer logits, loss, gradient
        norm) raise NonFiniteError with nothing applied."""
        try:
            return self._step(step)
        except ValueError as e:
            # the engine and the FP4 library raise ValueError("... non-finite ...") at their boundary
            if "non-finite" in str(e):
                self.opt.zero_grad(set_to_none=True)
                raise NonFiniteError(str(e)) from e
            raise

    def _step(self, step: int) -> dict:
        rl, method = self.rl, self.method
        cuda = torch.device(self.device).type == "cuda"
        if cuda:  # the step's peak (allocator statistics: no device wait)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        rec, diag_rec = method.recorders(self.num_layers)
        both = Tee(rec, diag_rec) if rec is not None or diag_rec is not None else None
        ep = run_episode(self.engine, self.task, self.tok, self._prompts_for(step), n=rl["group_size"],
                         max_new_tokens=rl["max_new_tokens"], temperature=rl["temperature"],
                         seed=self.cfg["seed"] * 1_000_003 + step, max_turns=rl["max_turns"], recorder=both)
        t_fin = time.perf_counter()
        record = rec.finish() if rec is not None else None
        t_fin2 = time.perf_counter()
        diag = diag_rec.finish() if diag_rec is not None else None
        t1 = time.perf_counter()

        tb = build_train_batch(ep.batch, self.tok.pad_token_id, self.device)
        rewards = torch.tensor(ep.scores, dtype=torch.float32, device=tb.ids.device)
        adv = compute_advantages(rewards, tb.mask, rl["group_size"], rl["advantage"])
        # where the alignment term is in the loss, its gradient norm beside the rest's at every step (one more
        # backward of that term alone, left out of the logged times): the clipped update is the sum of both parts
        want_split = method.aligns
        mb = rl.get("micro_batch") or 0  # absent / null / 0: the whole batch in one forward
        if 0 < mb < tb.ids.shape[0]:  # micro-batches: the whole-batch loss and gradient (trace/rl/microbatch.py)
            lp_det, stats, loss, parts, gn, gparts = micro_step(self, tb, adv, record, diag, mb, want_split)
            mm = mismatch_metrics(lp_det, tb.lp_roll, tb.mask)
        else:
            if method.exact:  # no record: values from the engine, gradient from the pinned QAT forward
                (lp_train, t_ex, lp_grad), stats = self._exact_logprobs(ep.batch.tokens, tb), None
            else:
                lp_train, stats = self._replayed_logprobs(tb, record, diag)
            mm = mismatch_metrics(lp_train.detach(), tb.lp_roll, tb.mask)
            if method.exact:  # the mismatch of the function the gradient is taken of (its values are not used)
                mm["k3_grad"] = mismatch_metrics(lp_grad, tb.lp_roll, tb.mask)["k3"]
            loss, parts, align = self._loss(lp_train, tb, adv, stats)
            gn, gparts = self._optimize(loss, align if want_split else None)
        self.engine.sync_weights(self.model)
        t_split = gparts.pop("time_split_s", 0.0)
        t2 = time.perf_counter() - t_split  # the split's extra backward is a diagnostic: out of the step's times

        summ = stats.summary() if stats is not None else {}
        batch = ep.batch
        n_gen = batch.num_generated_tokens
        # the arm's own record only; the diagnostic record's time is neither generation nor overhead
        own_s = rec.seconds + batch.record_feed_s + (t_fin2 - t_fin) if record is not None else 0.0
        return {
            "step": step,
            "method": rl["method"],
            "reward_mean": ep.reward,
            "accuracy": ep.accuracy,
            "response_len": sum(sum(tr) for tr in batch.trainable) / len(batch.tokens),
            **mm,
            "code_flip_rate": summ.get("code_flip_rate", {}),
            "scale_flip_rate": summ.get("scale_flip_rate", {}),
            "unrecoverable_rate": summ.get("unrecoverable_rate", {}),
            "routing_flip_rate": summ.get("routing_flip_rate", {}),
            # DESIGN.md §3 byte accounting of the arm's own record (full codes where it guides with them)
            "guidance_bytes_per_gen_token": method.record_bytes_per_generated_token(record, max(n_gen, 1)),
            "guidance_bits_per_element": method.record_bits_per_element(record),
            "rollout_gen_tokens_per_s": n_gen / max(batch.generate_s, 1e-9),
            "record_overhead": own_s / max(batch.generate_s, 1e-9),
            "time_generate_s": batch.generate_s,
            "time_record_s": own_s,
            "time_score_s": ep.score_s,  # decoding and the task's verifier (the coding sandbox runs on the CPU)
            "time_rollout_s": t1 - t0,
            "time_train_s": t2 - t1,
            **({"time_exact_score_s": t_ex} if method.exact else {}),  # the engine's forward inside time_train_s
            "loss": float(loss.detach()),
            **parts,
            "grad_norm": float(gn),
            **gparts,
            # the alignment term's gradient norm over the rest's (before clipping): its strength, every step
            "align_grad_ratio": (gparts["grad_norm_align"] / gparts["grad_norm_rest"]
                                 if gparts and gparts["grad_norm_rest"] > 0 else None),
            "time_split_s": t_split,
            "n_tokens": int(tb.mask.sum()),
            # what sizes the runs that share a GPU (gpu_slots_per_device): the step's peak of allocated memory
            # (rollout, trainer forward and backward) and of what the allocator held; None off a GPU
            "gpu_peak_alloc_gb": torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None,
            "gpu_peak_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 2**30 if cuda else None,
        }

    def _loss(self, lp_train: torch.Tensor, tb: TrainBatch, adv: torch.Tensor, stats):
        """PPO-clip policy loss with TIS / ICEPOP (+ kl_coef * KL to the reference, + the arm's weighted
        alignment term, `Method.alignment`). Returns (loss, its logged parts, the weighted alignment term
        in it or None)."""
        rl = self.rl
        if rl["ppo_ratio"] == "rollout":
            old, is_old = tb.lp_roll, lp_train.detach()
        else:
            old, is_old = lp_train.detach(), None
        ice = tuple(rl["icepop"]) if rl["icepop"] is not None else None
        pl, info = policy_loss(lp_train, old, adv, tb.mask, tb.lp_roll, clip_eps=rl["clip_eps"],
                               tis_cap=rl["tis_cap"], icepop=ice, is_old_log_probs=is_old)
        loss = pl
        parts = {"policy_loss": float(pl.detach()), "kl_ref": None, "align_loss": None,
                 "clip_frac": info["clip_frac"], "is_filter_frac": info.get("is_filter_frac")}
        if self.ref is not None:
            with torch.no_grad():
                lp_ref = token_logprobs(self.ref, tb, rl["autocast"] == "bf16", rl["temperature"])
            kl = masked_mean(kl_k3(lp_train, lp_ref), tb.mask)
            loss = loss + rl["kl_coef"] * kl
            parts["kl_ref"] = float(kl.detach())
        al = self.method.alignment(stats)
        if al is not None:
            parts["align_loss"] = float(al.term.detach())
            parts.update(al.parts)  # element vs block-scale part of the term
            loss = al.add_to(loss)
        align = al.weighted if al is not None else None
        if not bool(torch.isfinite(loss)):
            raise NonFiniteError(f"non-finite loss ({float(loss)})")
        return loss, parts, align

    def _optimize(self, loss: torch.Tensor, part: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Backward, gradient clipping, AdamW step; returns the gradient norm before clipping and, with
        `part` (a term of `loss`), the norms of that term's gradient and of the rest's, before clipping."""
        self.opt.zero_grad(set_to_none=True)
        norms = {}
        if part is not None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            g_part, t_split = split_grad(part, params)
        loss.backward()
        if part is not None:
            sq = lambda ts: float(sum((t.float() ** 2).sum() for t in ts if t is not None) ** 0.5)  # noqa: E731
            norms = {"grad_norm_align": sq(g_part),
                     "grad_norm_rest": sq([p.grad - g if g is not None else p.grad
                                           for p, g in zip(params, g_part, strict=True) if p.grad is not None]),
                     "time_split_s": t_split}
        return self._apply(), norms

    def _backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward, its gradient added to .grad (trace/rl/microbatch.py)."""
        loss.backward()

    def _apply(self) -> torch.Tensor:
        """Gradient clipping and the AdamW step on the gradient in .grad; returns the norm before clipping."""
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.rl["grad_clip"])
        if not bool(torch.isfinite(gn)):
            self.opt.zero_grad(set_to_none=True)
            raise NonFiniteError(f"non-finite gradient norm ({float(gn)})")
        self.opt.step()
        return gn

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self, mode: str | None = None) -> dict:
        return evaluate_policy(self.model, self.cfg, self.task, self.tok, mode=mode or self.arm.deploy)

    # ------------------------------------------------------------------------------ loop
    def _save(self, step: int) -> None:
        rundir.save_run_checkpoint(self.out, step, self.model, self.tok,
                                   {"optimizer": self.opt.state_dict(), "method": self.rl["method"]})

    def run(self) -> list[dict]:
        """The remaining steps; Ctrl-C raises rundir.Interrupted (the step it stopped in, the resume step)."""
        rl = self.rl
        log = rundir.MetricsLog.open(self.out, upto_step=self.start_step if self.resumed else None,
                                wandb_cfg=self.cfg["wandb"], cfg=self.cfg)
        recs = []
        guard, step = rundir.SigintGuard(), None
        try:
            guard.__enter__()
            if not self.resumed and self.start_step == 0 and rl["eval_every"]:
                # step 0: the initial policy's test accuracy (the SFT base) in this arm's deployment
                log.log({"step": 0, "method": rl["method"], "eval_accuracy": self.evaluate()["accuracy"]})
            bar = rundir.progress_bar(range(self.start_step + 1, rl["steps"] + 1), f"rl[{rl['method']}]",
                                      self.progress)
            for step in bar:
                ts = time.perf_counter()
                try:
                    rec = self.step(step)
                except NonFiniteError as e:
                    last = rundir.latest_checkpoint(self.out)
                    raise NonFiniteError(f"RL step {step} ({rl['method']}): {e}; step not applied, last good "
                                         f"checkpoint kept: {last}") from None
                if rl["eval_every"] and (step % rl["eval_every"] == 0 or step == rl["steps"]):
                    ev = self.evaluate()
                    rec["eval_accuracy"], rec["eval_reward"] = ev["accuracy"], ev["reward"]
                rec["time_step_s"] = time.perf_counter() - ts - rec["time_split_s"]
                log.log(rec)
                recs.append(rec)
                bar.set_postfix(acc=f"{rec['accuracy']:.2f}", k3=f"{rec['k3']:.1e}")
                if step % rl["ckpt_every"] == 0 or step == rl["steps"]:
                    self._save(step)
                guard.check()
            if rl["steps"] == 0 and rundir.latest_checkpoint(self.out) is None:
                self._save(0)
        except KeyboardInterrupt:
            raise rundir.Interrupted(self.out, step) from None
        finally:
            guard.__exit__()
            log.close()
        rundir.mark_done(self.out, {"steps": rl["steps"]})
        return recs


def run_rl(cfg: dict, out, progress: bool = True) -> list[dict]:
    return RLTrainer(cfg, out, progress=progress).run()


__all__ = ["NonFiniteError", "RLTrainer", "TrainBatch", "build_train_batch", "run_rl",
           "token_logprobs"]
