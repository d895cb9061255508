"""Supervised warm start (SFT): teach a tiny MoE model the task format and some of the skill.

    python -m trace.sft --config experiments/configs/smoke_sft_reasoning.yaml --out runs/sft_reasoning

Data: `task.make_split("train", n_train, seed)`; each example is `<bos> prompt` followed by the task's
gold response (`sft_target_and_mask`; for the multi-turn task the environment text is in the input but
masked out of the loss). Loss: token-mean cross-entropy over the trainable response tokens (optionally label-smoothed,
`sft.label_smoothing`, which leaves the base policy some entropy for RL to remove). FP32 on the
CPU (the tiny models are small enough; BF16 autocast is used in RL where the FP4 arms need it).
AdamW, linear warmup then cosine decay to 10 %, gradient clipping. Batches are drawn from a generator
seeded by (seed, step), so a resumed run sees exactly the batches an uninterrupted run would.

On a GPU a base must train again to the same losses where its checkpoint stayed on another machine
(scripts/gpu/profile_chunk.sh). Its determinism mode, `sft_determinism` in meta.json, says how it trained:
- "strict", the GPU default: attention on the math SDPA backend, `torch.use_deterministic_algorithms(True,
  warn_only=True)` (ops with a deterministic variant take it; any without one warns in the run's log),
  `CUBLAS_WORKSPACE_CONFIG=:4096:8`.
- "math": the math SDPA backend only. Not enough to repeat a run: bases trained this way beside other jobs
  failed to reproduce their logged losses, and two processes of mixtral-small's long-horizon SFT on one H200
  parted at step 4 of 100 in this mode, while two in the strict mode logged the same 100 losses bit for bit,
  with no op warning that it lacks a deterministic variant (scripts/gpu/sft_determinism_probe.sh).
- "none": PyTorch's own choices. Every CPU base, and GPU bases from before meta.json recorded any of this
  (`rebuild_determinism` maps a run's meta.json to its mode).
`sft.determinism` (trace/settings.py; $TRACE_SFT_DETERMINISM overrides it) picks another mode, for a rebuild to train a base as it was trained. Two GPU runs in
fresh processes log the same losses (tests/test_sft.py).

Writes a run directory (see trace/rundir.py): checkpoints in ckpt/ are what `rl.init_ckpt` points at
(the run dir itself is accepted). Prompts are encoded by `trace.episode.encode_prompt`, as in RL and eval.
Compared against: nothing upstream; tests/test_sft.py checks the base policy is non-trivial.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trace import config as C
from trace import rundir
from trace.episode import build_task, encode_prompt, evaluate_policy
from trace.settings import SFTSettings, switch


def encode_text(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sft_examples(task, tok, examples) -> list[tuple[list[int], list[bool]]]:
    """(ids, loss mask) per example; mask[i] says whether token i is a trained target."""
    out = []
    for ex in examples:
        p = encode_prompt(tok, ex.prompt)
        target, cmask = task.sft_target_and_mask(ex)
        t = encode_text(tok, target)
        if len(t) != len(cmask):
            raise ValueError("character tokenizer expected: one token per character of the target")
        out.append((p + t, [False] * len(p) + list(cmask)))
    return out


def pad_batch(seqs: list[list[int]], masks: list[list[bool]], pad_id: int):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    lm = torch.zeros((len(seqs), T), dtype=torch.bool)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        lm[i, : len(m)] = torch.tensor(m)
        att[i, : len(s)] = 1
    return ids, lm, att


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def sft_loss(model, ids, lm, att, label_smoothing: float = SFTSettings.label_smoothing):
    """Token-mean cross-entropy over trained targets; with label smoothing eps the target is
    (1 - eps) one-hot + eps uniform over the vocabulary (so the base policy keeps some entropy that
    sampling at temperature 1 exposes, headroom that RL can remove)."""
    logits = model(input_ids=ids, attention_mask=att).logits.float()
    if not torch.isfinite(logits).all():
        raise FloatingPointError("SFT: non-finite logits")
    logp = F.log_softmax(logits[:, :-1], -1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    if label_smoothing > 0:
        nll = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    m = lm[:, 1:].float()
    return (nll * m).sum() / m.sum().clamp(min=1)




def sft_determinism(device) -> str:
    """The determinism mode of an SFT run on `device`: the switch `sft.determinism` ('strict' unless the run's
    config or $TRACE_SFT_DETERMINISM says otherwise) on a GPU; the CPU always 'none' (deterministic as it is;
    every CPU base trained so)."""
    if not str(device).startswith("cuda"):
        return "none"
    try:
        return switch("sft.determinism")
    except ValueError as e:
        raise C.ConfigError(str(e)) from None


def rebuild_determinism(meta: dict) -> str:
    """The mode a base recorded in `meta` (its meta.json) trained with; bases from before the key said their
    attention backend ('math') or nothing ('none')."""
    return meta.get("sft_determinism") or ("math" if meta.get("sft_attention") == "math" else "none")


@contextlib.contextmanager
def determinism(mode: str):
    """Run an SFT step (forward and backward) in `mode`; restores PyTorch's global settings afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if mode == "none":
        yield
        return
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        if mode == "strict":
            torch.use_deterministic_algorithms(True, warn_only=True)
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def run_sft(cfg: dict, out: str | Path, progress: bool = True) -> Path:
    """Train (or resume) an SFT run into `out`; returns the final checkpoint directory. Ctrl-C raises
    rundir.Interrupted (the step it stopped in, the step a rerun resumes from)."""
    from trace.models import build_model, build_tokenizer, load_checkpoint

    rundir.set_threads(cfg)
    out = rundir.prepare_run_dir(out, cfg, kind="sft")
    mode = sft_determinism(cfg["device"])
    if mode == "strict":  # cuBLAS's deterministic workspace; read when the process first creates a handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rundir.note_meta(out, "sft_determinism", mode)
    s = cfg["sft"]
    task = build_task(cfg)
    tok = build_tokenizer()
    train = task.make_split("train", cfg["task"]["n_train"], cfg["task"]["seed"])
    data = sft_examples(task, tok, train)

    latest = rundir.latest_checkpoint(out)
    if latest is not None:
        model, _ = load_checkpoint(latest, device=cfg["device"], load_tokenizer=False)
        state = rundir.load_trainer_state(latest)
        start = state["step"]
    else:
        model = build_model(cfg["model"], seed=s["init_seed"], device=cfg["device"])
        state, start = None, 0
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=s["weight_decay"], betas=(0.9, 0.95))
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    log = rundir.MetricsLog.open(out, upto_step=start if latest is not None else None, wandb_cfg=cfg["wandb"], cfg=cfg)
    total = s["steps"]
    bar = rundir.progress_bar(range(start, total), "sft", progress)
    at = {"step": None}  # the step in progress (1-based), for an interrupt's message
    try:
        with rundir.SigintGuard() as guard:
            _sft_loop(bar, at, cfg, s, data, tok, model, opt, log, task, mode, out, total, guard.check)
    except KeyboardInterrupt:
        log.close()
        raise rundir.Interrupted(out, at["step"]) from None
    log.close()
    if total == 0 and rundir.latest_checkpoint(out) is None:  # steps: 0 -> the untrained init as checkpoint
        rundir.save_run_checkpoint(out, 0, model, tok, {"optimizer": opt.state_dict()})
    rundir.mark_done(out, {"steps": total})
    return rundir.latest_checkpoint(out)


def _sft_loop(bar, at, cfg, s, data, tok, model, opt, log, task, mode, out, total, check_interrupt) -> None:
    """The SFT steps of `bar`, each checkpointed every `ckpt_every`; at["step"]: the step in progress;
    `check_interrupt()` after each step raises a Ctrl-C that a finalizer swallowed (rundir.SigintGuard)."""
    for step in bar:
        at["step"] = step + 1
        t0 = time.time()
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
        idx = torch.randint(len(data), (s["batch_size"],), generator=g).tolist()
        ids, lm, att = pad_batch([data[i][0] for i in idx], [data[i][1] for i in idx], tok.pad_token_id)
        ids, lm, att = ids.to(cfg["device"]), lm.to(cfg["device"]), att.to(cfg["device"])
        lr = lr_at(step, total, s["warmup"], s["lr"])
        for gr in opt.param_groups:
            gr["lr"] = lr
        with determinism(mode):
            loss = sft_loss(model, ids, lm, att, s["label_smoothing"])
            if not torch.isfinite(loss):
                raise FloatingPointError(f"SFT step {step + 1}: non-finite loss; step not applied")
            opt.zero_grad(set_to_none=True)
            loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        if not torch.isfinite(gn):
            raise FloatingPointError(f"SFT step {step + 1}: non-finite gradient norm; step not applied")
        opt.step()
        done_steps = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if done_steps % s["log_every"] == 0 or done_steps == total:
            rec = {"step": done_steps, "loss": loss.item(), "lr": lr, "grad_norm": gn.item(),
                   "time_step_s": time.time() - t0}
            if s["eval_every"] and (done_steps % s["eval_every"] == 0 or done_steps == total):
                model.eval()
                rec["eval_accuracy"] = evaluate_policy(model, cfg, task, tok, mode="bf16")["accuracy"]
                model.train()
            log.log(rec)
        if done_steps % s["ckpt_every"] == 0 or done_steps == total:
            rundir.save_run_checkpoint(out, done_steps, model, tok, {"optimizer": opt.state_dict()})
        check_interrupt()



def main(argv=None) -> int:
    p = C.base_parser("python -m trace.sft", "Supervised warm start of a tiny MoE policy on a task.")
    p.add_argument("--out", required=True, help="run directory (created; resumed if it holds a checkpoint)")
    p.add_argument("--no-progress", action="store_true")
    a, cfg = C.parse_cli(p, argv)
    try:
        run_sft(cfg, a.out, progress=not a.no_progress)
    except C.ConfigError as e:  # start-up: model, JSONL files, a different run in --out; nothing written
        C.fail(e)
    except rundir.Interrupted as e:
        return rundir.report_interrupt(e)
    except KeyboardInterrupt:  # before the loop (building the model, reading the data)
        return rundir.report_interrupt(rundir.Interrupted(a.out, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
