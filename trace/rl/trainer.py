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
  train step  `TrainStep.run` (trace/rl/trainstep.py): the batch in chunks of `rl.micro_batch` sequences (the whole
              batch as one chunk without it), each chunk's forward, loss and backward, gradients accumulated and
              normalized over the whole batch, then clipping and AdamW; a `StepResult` back
  log-probs   `RLTrainer.logprobs` as the arm's `Method.logprobs` makes them: the patched HF model in the arm's mode
              (bf16 for bf16 and fp4-naive, w4a16 for qat-weight-only, w4a4kv4 for qat-independent, trace* and
              exact) under BF16 autocast on FP32 master weights, inside `Method.replay` whenever a record exists
              (guided rounding, routing replay and alignment term for trace; flip statistics against the
              diagnostic record); for the exact arm the values from the engine's batch-invariant forward over the
              rollout's tokens (`RLTrainer.engine_scores`: `RolloutEngine.score` on the kernels the rollout sampled
              with, the rollout's log-probs bit for bit) with the gradient of the QAT forward whose layer inputs are
              pinned to the engine's residual stream (`trace.qat.pinned_inputs`)
  loss        PPO-clip vs the rollout log-probs with TIS / ICEPOP, + kl_coef * KL(ref) (`RLTrainer.policy_loss`),
              + the arm's weighted alignment term normalized over the step's guided items (`Method.step_alignment`)
  metrics     one `trace.metrics.StepMetrics` per step (the fields both trainers write and analysis/ reads)
  weight sync `engine.sync_weights(model)` (FP4 weights re-quantized by trace.fp4.quantize_weight); the
              engine computes in BF16 on CUDA and FP32 on the CPU (`default_dtype`, DESIGN.md §4).
The arms (what each rolls out, records and trains) are the table in trace/arms.py; the method's wiring
(engine arguments, recorders, log-probs, replay, weighted alignment term, record bytes) is `trace.guidance.Method`,
which the OpenRLHF actors share.

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

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from trace import rundir
from trace.config import ConfigError
from trace.episode import build_task, evaluate_policy, run_episode
from trace.guidance import Method, Tee
from trace.guidance.method import TrainerLogprobs
from trace.metrics import StepMetrics, absent_if_none
from trace.models import build_model, build_tokenizer, load_checkpoint
from trace.qat import patch_model, pinned_inputs
from trace.rl.losses import NonFiniteError, compute_advantages, kl_k3, masked_mean, policy_loss
from trace.rl.trainstep import TrainStep
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
        self.method = Method.from_config(self.rl)  # the arm: engine, records, log-probs, replay, alignment term
        self.arm = self.method.arm
        problem = self.method.device_problem(cfg["device"])
        if problem:
            raise ConfigError(f"config key 'device': {problem}")
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
        self.rt.experts = self.rl["experts"]  # the experts' loop or grouped path (trace/qat/experts.py)
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
        self.engine = RolloutEngine(self.model.config, fmt=self.rl["fmt"], device=self.device,
                                    **self.method.engine_kwargs())
        self.engine.sync_weights(self.model)
        self.num_layers = self.model.config.num_hidden_layers
        # the forwards, losses, backwards and optimizer step of a step (micro_batch absent / null / 0: one chunk)
        self.train = TrainStep(self.model, self.opt, self.method, self.rl["grad_clip"], self.rl["micro_batch"] or 0)

    # ------------------------------------------------------------------------------ pieces
    def _prompts_for(self, step: int):
        g = torch.Generator().manual_seed(self.cfg["seed"] * 1_000_003 + 7919 * step + 17)
        idx = torch.randperm(len(self.train_set), generator=g)[: self.rl["prompts_per_step"]].tolist()
        return [self.train_set[i] for i in idx]

    def logprobs(self, sub: TrainBatch, rows: range, record, diag, tokens) -> TrainerLogprobs:
        """The trainer's log-probs of rows `rows` of the step's train batch (`sub`: those rows), made as the arm's
        Method decides (`Method.logprobs`): the trainer forward in the arm's mode, inside the replay of the step's
        records where there are any, or the exact arm's engine scores with the gradient of a pinned forward.
        tokens: the rollout's token lists of the whole batch."""
        autocast, temperature = self.rl["autocast"] == "bf16", self.rl["temperature"]
        return self.method.logprobs(lambda: token_logprobs(self.model, sub, autocast, temperature), self.rt, record,
                                    diag, sub.seq, sub.pos, sub.att.bool(),
                                    score=lambda: self.engine_scores(sub, [tokens[b] for b in rows]))

    def engine_scores(self, tb: TrainBatch, tokens) -> tuple[torch.Tensor, object]:
        """(log-probs [B, T] of tb's targets from the engine's forward over each row's input tokens and target,
        the context pinning each decoder layer's input and the final norm's to the engine's residual stream there):
        `RolloutEngine.score`, one full-sequence forward per row on the kernels and configs the rollout sampled with
        (in the batch-invariant engine, the rollout's log-probs bit for bit), and `trace.qat.pinned_inputs`.
        tokens: the rollout's token lists of tb's rows."""
        n = tb.att.sum(1).tolist()
        streams: list[torch.Tensor] = []
        rows = self.engine.score([list(tokens[b][: n[b] + 1]) for b in range(len(n))],
                                 temperature=self.rl["temperature"] or 1.0,  # greedy rollouts report temperature 1
                                 streams=streams)
        v = torch.zeros(tb.ids.shape, dtype=torch.float32)
        for b, r in enumerate(rows):
            v[b, : len(r)] = torch.tensor(r, dtype=torch.float32)
        T = tb.ids.shape[1]  # the engine also fed each row's last target: one position more
        return v, pinned_inputs(self.model, [s[:, :T] for s in streams])

    # ------------------------------------------------------------------------------ one step
    def step(self, step: int) -> StepMetrics:
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

    def _step(self, step: int) -> StepMetrics:
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
        res = self.train.run(tb, adv, partial(self.logprobs, record=record, diag=diag, tokens=ep.batch.tokens),
                             self.policy_loss)
        mm = method.mismatch(res.lp, res.grad_lp, tb.lp_roll, tb.mask)
        self.engine.sync_weights(self.model)
        t2 = time.perf_counter() - res.split_s  # the split's extra backward is a diagnostic: out of the step's times

        summ = res.stats.summary() if res.stats is not None else {}
        batch = ep.batch
        n_gen = batch.num_generated_tokens
        # the arm's own record only; the diagnostic record's time is neither generation nor overhead
        own_s = rec.seconds + batch.record_feed_s + (t_fin2 - t_fin) if record is not None else 0.0
        split = res.grad_norm_align is not None
        return StepMetrics(
            step=step,
            method=rl["method"],
            reward_mean=ep.reward,
            accuracy=ep.accuracy,
            response_len=sum(sum(tr) for tr in batch.trainable) / len(batch.tokens),
            **mm,
            code_flip_rate=summ.get("code_flip_rate", {}),
            scale_flip_rate=summ.get("scale_flip_rate", {}),
            unrecoverable_rate=summ.get("unrecoverable_rate", {}),
            routing_flip_rate=summ.get("routing_flip_rate", {}),
            # DESIGN.md §3 byte accounting of the arm's own record (full codes where it guides with them)
            guidance_bytes_per_gen_token=method.record_bytes_per_generated_token(record, max(n_gen, 1)),
            guidance_bits_per_element=method.record_bits_per_element(record),
            rollout_gen_tokens_per_s=n_gen / max(batch.generate_s, 1e-9),
            record_overhead=own_s / max(batch.generate_s, 1e-9),
            time_generate_s=batch.generate_s,
            time_record_s=own_s,
            time_score_s=ep.score_s,  # decoding and the task's verifier (the coding sandbox runs on the CPU)
            time_rollout_s=t1 - t0,
            time_train_s=t2 - t1,
            time_exact_score_s=absent_if_none(res.engine_s),  # the engine's scoring, inside time_train_s
            loss=res.loss,
            **res.parts,
            grad_norm=res.grad_norm,
            grad_norm_align=absent_if_none(res.grad_norm_align),
            grad_norm_rest=absent_if_none(res.grad_norm_rest),
            # the alignment term's gradient norm over the rest's (before clipping): its strength, every step
            align_grad_ratio=(res.grad_norm_align / res.grad_norm_rest
                              if split and res.grad_norm_rest > 0 else None),
            time_split_s=res.split_s,
            n_tokens=int(tb.mask.sum()),
            # what sizes the runs that share a GPU (gpu_slots_per_device): the step's peak of allocated memory
            # (rollout, trainer forward and backward) and of what the allocator held; None off a GPU
            gpu_peak_alloc_gb=torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None,
            gpu_peak_reserved_gb=torch.cuda.max_memory_reserved(self.device) / 2**30 if cuda else None,
        )

    def policy_loss(self, lp_train: torch.Tensor, tb: TrainBatch, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """PPO-clip policy loss with TIS / ICEPOP (+ kl_coef * KL to the reference) of a (micro-)batch, token means
        over its trainable tokens; returns (loss, its logged parts). The arm's alignment term is added by the
        train step (trace/rl/trainstep.py)."""
        rl = self.rl
        if rl["ppo_ratio"] == "rollout":
            old, is_old = tb.lp_roll, lp_train.detach()
        else:
            old, is_old = lp_train.detach(), None
        ice = tuple(rl["icepop"]) if rl["icepop"] is not None else None
        pl, info = policy_loss(lp_train, old, adv, tb.mask, tb.lp_roll, clip_eps=rl["clip_eps"],
                               tis_cap=rl["tis_cap"], icepop=ice, is_old_log_probs=is_old)
        loss = pl
        parts = {"policy_loss": float(pl.detach()), "kl_ref": None,
                 "clip_frac": info["clip_frac"], "is_filter_frac": info.get("is_filter_frac")}
        if self.ref is not None:
            with torch.no_grad():
                lp_ref = token_logprobs(self.ref, tb, rl["autocast"] == "bf16", rl["temperature"])
            kl = masked_mean(kl_k3(lp_train, lp_ref), tb.mask)
            loss = loss + rl["kl_coef"] * kl
            parts["kl_ref"] = float(kl.detach())
        return loss, parts

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
                log.log(StepMetrics(step=0, method=rl["method"], eval_accuracy=self.evaluate()["accuracy"]).to_dict())
            bar = rundir.progress_bar(range(self.start_step + 1, rl["steps"] + 1), f"rl[{rl['method']}]",
                                      self.progress)
            for step in bar:
                ts = time.perf_counter()
                try:
                    m = self.step(step)
                except NonFiniteError as e:
                    last = rundir.latest_checkpoint(self.out)
                    raise NonFiniteError(f"RL step {step} ({rl['method']}): {e}; step not applied, last good "
                                         f"checkpoint kept: {last}") from None
                if rl["eval_every"] and (step % rl["eval_every"] == 0 or step == rl["steps"]):
                    ev = self.evaluate()
                    m.eval_accuracy, m.eval_reward = ev["accuracy"], ev["reward"]
                m.time_step_s = time.perf_counter() - ts - m.time_split_s
                rec = m.to_dict()
                log.log(rec)
                recs.append(rec)
                bar.set_postfix(acc=f"{m.accuracy:.2f}", k3=f"{m.k3:.1e}")
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
