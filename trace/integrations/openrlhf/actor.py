"""Trainer side of TRACE in OpenRLHF: the policy actor, patched by our QAT adapter, replaying records.

`TracePolicyActor` is a subclass of OpenRLHF 0.11.2's `PolicyModelActor` (the class under its
`@ray.remote`), which `launch` puts in place of the original before `train_ppo_ray` runs:
- model load: OpenRLHF builds its `Actor` (HF model, BF16, sdpa); we patch it in place with
  `trace.qat.patch_model` in the arm's trainer mode (bf16 / w4a16 / w4a4kv4) before DeepSpeed wraps
  it, and under ZeRO-3 make each module whose projections share one input (attention; shared
  expert, dense MLP) a ZeRO-3 leaf with that input passed positionally (`prepare_for_qat`: DeepSpeed's
  per-module hooks would otherwise re-wrap the shared q/k/v input, so it would be quantized and
  recorded three times, and a leaf called with keyword inputs has its gradients reduced too early);
  `launch --zero-persistence-threshold` sets DeepSpeed's stage3_param_persistence_threshold (0 in CI:
  the tiny models' parameters are all below DeepSpeed's default, so none would be partitioned);
- old log-probs (`forward`, called by the experience maker) and the training step run inside
  `trace.qat.replay` with the micro-batch's records, fetched from their handles in
  `mm_train_inputs` (one `ray.get`) and entered through the arm's `trace.guidance.Method`, the object
  the embedded trainer holds: the arm's guidance record (trace*) guides, the diagnostic full-codes record of all layers (`diag=`, every arm whose
  trainer quantizes activations) gives the flip statistics; the replay context stays open across
  `strategy.backward`, so gradient checkpointing recomputes the guided forward;
- the arm's weighted alignment term (`Method.alignment`) is added to OpenRLHF's policy loss; the mismatch
  metrics (k1, k3, |dlp|, ratio-outside, chi2 over action tokens, against the rollout log-probs)
  and flip rates go into `experience.info`, which OpenRLHF logs, and rank 0 appends one line per
  step to `$TRACE_RUN_DIR/metrics.jsonl`, a `trace.metrics.StepMetrics` as the embedded trainer's;
- resume: launch always passes `--ckpt.load_enable`, so OpenRLHF's `init_model_from_pretrained` loads
  the newest DeepSpeed checkpoint under `--ckpt.path` and keeps its client states; the actor counts
  steps on from their `global_step` and opens the metrics log as the embedded trainer does
  (`rundir.MetricsLog.open(upto_step=global_step)`: lines past the checkpoint, a torn last line, go);
- checkpoints: after OpenRLHF's save, the HF copies (`global_stepN_hf`) are pruned to `--ckpt.max_num` as the
  DeepSpeed checkpoints are (checkpoints.py);
- periodic held-out evaluation (`rl.eval_every`), as `trace.rl.trainer.RLTrainer.run`: step 0 (a fresh
  run) gets its own line with `eval_accuracy`, and every eval_every-th step and the last add
  `eval_accuracy` and `eval_reward` to their line; `trace.episode.evaluate_policy` on the policy in
  the arm's deployment. Under ZeRO-3 only rank 0 ever holds the whole policy (`gathered_weights`): every
  rank gathers the parameters one module at a time (a collective), rank 0 copies each module's into a state
  dict and the others let theirs go at once; rank 0 then evaluates the engine loaded from that state dict
  (the model's own RoPE buffer, which ZeRO-3 does not partition), the same weights the whole-model gather gave.
DeepSpeed's optimizer: its own Adam where its op builds here (`choose_optimizer`: DeepSpeedCPUAdam under
`--ds.adam_offload`, else FusedAdam; a probe per process loads the op, a JIT build where it is not prebuilt,
which DeepSpeed would run anyway), else torch's AdamW (`torch_adam`). All three run the same update rule
(AdamW: decoupled weight decay, bias-corrected moments, the same lr / betas / eps / weight_decay), differing
only in the kernel's rounding. The fallback is for machines where the op cannot be built: no compiler, or
nvcc given a TORCH_CUDA_ARCH_LIST entry that DeepSpeed's builder cannot parse (such as "9.0a",
ops/op_builder/builder.py). One line on rank 0 says which optimizer runs and why.
Compared against: the embedded trainer `trace.rl.trainer.RLTrainer` (same `Method`, same metrics;
tests/integrations/openrlhf/test_equivalence.py).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time

import torch
from torch import nn

from trace.integrations.openrlhf import guards, plugin, stand_ins

stand_ins.install()  # before OpenRLHF's modules import vLLM / flash-attn names (the CPU shim: plugin.setup)

import openrlhf.trainer.ppo_utils.experience as _exp  # noqa: E402
import openrlhf.trainer.ppo_utils.experience_maker as _em  # noqa: E402
import openrlhf.trainer.ppo_utils.samples_generator as _sg  # noqa: E402
import openrlhf.trainer.ppo_trainer as _pt  # noqa: E402
import openrlhf.trainer.ray.ppo_actor as _pa  # noqa: E402

from trace import rundir  # noqa: E402
from trace.episode import build_task, evaluate_policy  # noqa: E402
from trace.guidance import Method  # noqa: E402
from trace.guidance.mismatch import mismatch_metrics  # noqa: E402
from trace.integrations.openrlhf.checkpoints import prune_hf_checkpoints  # noqa: E402
from trace.integrations.openrlhf.records import batch_records, coverages  # noqa: E402
from trace.integrations.openrlhf.rollout import DIAG_KEY, RECORD_KEY  # noqa: E402
from trace.metrics import ALIGN_PART_FIELDS, LAYER_FIELDS, StepMetrics  # noqa: E402
from trace.qat import patch_model, runtime  # noqa: E402

_PA = "openrlhf.trainer.ray.ppo_actor"
_INIT = "PolicyModelActor.init_model_from_pretrained"
_STEP = "ActorPPOTrainer.training_step"
_LOSS = f"{_PA}.ActorPPOTrainer.actor_loss_fn"


def hf_model(actor):
    """The Hugging Face model inside OpenRLHF's Actor (unwrapped from the DeepSpeed engine)."""
    m = actor.model
    return getattr(m, "module", m)


def shared_input_modules(model) -> list[nn.Module]:
    """The modules whose projections share one quantized input (trace.qat.patch `_swap_shared`): every
    attention (q/k/v), every shared expert and dense MLP (gate/up)."""
    mods = []
    for layer in model.model.layers:
        mods.append(layer.self_attn)
        mlp = layer.mlp
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            mods.append(shared)
        elif not hasattr(mlp, "experts"):
            mods.append(mlp)
    return mods


def _input_by_position(module, args, kwargs):
    """Forward pre-hook: a keyword `hidden_states` (how transformers' decoder layers call attention)
    becomes the first positional argument, the only place module hooks look for inputs."""
    if not args and "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        return (kwargs.pop("hidden_states"),), kwargs
    return None


def prepare_for_qat(model, mode: str, fmt: str, zero_stage: int) -> None:
    """Patch an HF model loaded by OpenRLHF for QAT, before DeepSpeed wraps it.

    Under ZeRO-3 every module whose projections share one input (q/k/v; gate/up) becomes a ZeRO-3
    leaf: DeepSpeed's per-submodule hooks would otherwise hand each projection its own wrapped copy
    of the input, and the shared input would be quantized (and recorded) once per projection.
    A leaf's gradients are reduced (and its parameters released) by DeepSpeed from a
    `register_full_backward_hook` on the leaf, which PyTorch fires once the gradients of the leaf's
    positional inputs exist. transformers' decoder layers call attention with keyword arguments
    only (`self_attn(hidden_states=...)`), so that hook would see no input and fire as soon as the
    attention's output gradient arrives, before any of its parameters is gathered for backward and
    before o_proj's backward runs: DeepSpeed gives each leaf parameter a gradient `zeros_like` its
    released 0-element storage, and o_proj's real gradient is then accumulated onto it ("The size
    of tensor a (0) must match the size of tensor b (...)"). Moving `hidden_states` into the
    positional arguments (a pre-hook that runs before DeepSpeed's) makes the hook fire after the
    whole attention backward, as it does for the modules called positionally (the MLPs). This needs
    the input to require grad, as it does whenever the embeddings train."""
    patch_model(model, mode, fmt)
    if zero_stage == 3:
        from deepspeed.utils import set_z3_leaf_modules
        mods = shared_input_modules(model)
        set_z3_leaf_modules(model, sorted({type(m) for m in mods}, key=lambda c: c.__name__))
        for m in mods:
            if not getattr(m, "_trace_input_hook", False):
                m.register_forward_pre_hook(_input_by_position, with_kwargs=True, prepend=True)
                m._trace_input_hook = True


# DeepSpeed's own Adam, by where the optimizer states live: (its op builder, the optimizer DeepSpeed builds)
ADAM_OPS = {True: ("CPUAdamBuilder", "DeepSpeedCPUAdam"), False: ("FusedAdamBuilder", "FusedAdam")}


@functools.cache
def adam_op_builds(builder: str) -> tuple[bool, str]:
    """(whether DeepSpeed's op `builder` of deepspeed.ops.op_builder, the one its Adam loads on this accelerator,
    is compatible and loads here, a one-line reason where not). Loading JIT-builds an op that is not prebuilt, as
    DeepSpeed's optimizer would on its first use; torch's extension cache keeps it for that use. Once per process."""
    try:
        import deepspeed.ops.op_builder as op_builder

        op = getattr(op_builder, builder)()
        if not op.is_compatible(verbose=False):
            return False, f"{builder} is not compatible with this machine"
        op.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - any failure to build or load means: not here
        return False, f"{builder} does not build or load here ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return True, f"{builder} builds here"


def choose_optimizer(conf: dict) -> str | None:
    """Keep DeepSpeed's own Adam in a train config (`conf["optimizer"]`) where its op builds here, else set
    `torch_adam` (torch's AdamW, the same update rule; module docstring). Returns the line that says which runs and
    why (None for a config without an optimizer)."""
    opt = conf.get("optimizer")
    if opt is None:
        return None
    offload = (conf.get("zero_optimization") or {}).get("offload_optimizer") or {}
    builder, own = ADAM_OPS[offload.get("device") in ("cpu", "nvme")]
    ok, why = adam_op_builds(builder)
    if ok:
        return f"[trace] optimizer {opt.get('type')}: DeepSpeed's {own} ({why})"
    opt.setdefault("params", {})["torch_adam"] = True
    return f"[trace] optimizer {opt.get('type')}: torch.optim.AdamW (torch_adam) in place of DeepSpeed's {own}: {why}"


def trace_ds_config(conf: dict) -> dict:
    """OpenRLHF's DeepSpeed train config as the policy actor runs it: the optimizer `choose_optimizer` keeps or
    replaces (its line printed on rank 0), and launch's stage3_param_persistence_threshold."""
    line = choose_optimizer(conf)
    if line is not None and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(line, file=sys.stderr, flush=True)
    thr = plugin.zero_persistence_threshold()
    if thr is not None and "zero_optimization" in conf:
        conf["zero_optimization"]["stage3_param_persistence_threshold"] = thr
    return conf


def gathered_weights(model, rank: int) -> dict[str, torch.Tensor] | None:
    """The ZeRO-3 partitioned model's parameters by name, whole, on rank 0 (None on the others). A collective:
    every rank gathers the parameters of one module at a time (`deepspeed.zero.GatheredParameters`, read-only);
    rank 0 copies each into the state dict (where the parameter lives), the other ranks hold one module's
    parameters at most, released as the next is gathered. A parameter shared by two modules (tied embeddings) is
    gathered once and named under both, as `state_dict()` names it."""
    import deepspeed

    sd: dict[str, torch.Tensor] = {}
    copied: dict[int, torch.Tensor | None] = {}  # every rank the same keys: the same gathers in the same order
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(prefix=prefix, recurse=False, remove_duplicate=False))
        fresh = list({id(p): p for _, p in own if id(p) not in copied}.values())
        if fresh:
            with deepspeed.zero.GatheredParameters(fresh, modifier_rank=None), torch.no_grad():
                copied.update({id(p): p.detach().clone() if rank == 0 else None for p in fresh})
        if rank == 0:
            sd.update({n: copied[id(p)] for n, p in own})
    return sd if rank == 0 else None


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] absolute position of each token (OpenRLHF's position_ids), -1 at padding."""
    att = attention_mask.bool()
    return torch.where(att, att.long().cumsum(-1) - 1, torch.full_like(att, -1, dtype=torch.long))


class TraceReplay:
    """The arm's replay and metrics for one OpenRLHF policy actor."""

    def __init__(self, cfg: dict):
        self.cfg, self.rl = cfg, cfg["rl"]
        self.method = Method.from_config(self.rl)
        self.arm = self.method.arm
        # which records the rollout sends: the choice its recorders are made by
        takes = self.method.records()
        self.keys = tuple(k for k, t in zip((RECORD_KEY, DIAG_KEY), takes, strict=True) if t)

    def records(self, mm_train_inputs) -> dict[str, list] | None:
        """{key: the micro-batch's records of that kind, in row order (as shipped: packed, or
        GuidanceRecords in process)}, all handles fetched in one ray.get; None where the arm's
        rollout records nothing."""
        if not self.keys or not mm_train_inputs:
            return None
        if any(not m or any(k not in m for k in self.keys) for m in mm_train_inputs):
            raise ValueError(f"arm {self.rl['method']!r} needs the records {self.keys} for every sample; "
                             "some carry none")
        import ray
        vals = {k: [m[k] for m in mm_train_inputs] for k in self.keys}
        refs = [v for vs in vals.values() for v in vs if isinstance(v, ray.ObjectRef)]
        got = dict(zip(refs, ray.get(refs), strict=True)) if refs else {}
        return {k: [got[v] if isinstance(v, ray.ObjectRef) else v for v in vs] for k, vs in vals.items()}

    def context(self, model, mm_train_inputs, attention_mask):
        recs = self.records(mm_train_inputs)
        if recs is None:
            return contextlib.nullcontext(None)
        dev = attention_mask.device
        B = attention_mask.shape[0]
        seq = torch.arange(B, device=dev)
        pos = positions(attention_mask)
        rec, diag = (batch_records(recs[k], dev) if k in recs else None for k in (RECORD_KEY, DIAG_KEY))
        # tokens after a sample's records (final env feedback) stay RTN; both records of a sample come
        # from the same forwards and cover the same positions, unless one holds no rows at all (rho 0)
        cov = torch.stack([coverages(r, B).to(dev) for r in (rec, diag) if r is not None]).amax(0)
        pos = pos.masked_fill(pos >= cov[:, None], -1)
        return self.method.replay(runtime(model), rec, diag, seq, pos)

    def step_info(self, log_probs, rollout_log_probs, action_mask, stats) -> dict:
        """0-d tensors for experience.info (OpenRLHF weights them by action tokens)."""
        info = {}
        if rollout_log_probs is not None:
            mm = mismatch_metrics(log_probs.detach().float(), rollout_log_probs.to(log_probs.device).float(),
                                  action_mask)
            info.update({k: torch.tensor(float(v)) for k, v in mm.items() if v is not None})
        if stats is not None:
            for key, per_layer in stats.summary().items():
                for layer, v in per_layer.items():
                    info[f"{key}/{layer}"] = torch.tensor(float(v))
        return info

class TraceActorPPOTrainer(_pa.ActorPPOTrainer):
    """OpenRLHF's actor trainer with the training step run under replay (`self.trace` set by the actor)."""

    trace: TraceReplay

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        tr = self.trace
        orig = guards.require_attr(self, "actor_loss_fn", _LOSS)
        calls = []
        ctx = tr.context(hf_model(self.actor), experience.mm_train_inputs, experience.attention_mask)
        with ctx as stats:
            def loss_fn(log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, **kw):
                calls.append(1)
                out = orig(log_probs, old_log_probs, advantages, action_mask=action_mask,
                           rollout_log_probs=rollout_log_probs, **kw)
                loss = out[0]
                experience.info.update(tr.step_info(log_probs, rollout_log_probs, action_mask, stats))
                experience.info["ppo_loss"] = loss.detach()
                al = tr.method.alignment(stats)
                if al is not None:
                    experience.info["align_loss"] = al.term.detach().to(loss.device)
                    # the term's element and block-scale parts, as the embedded trainer logs them (not per layer)
                    experience.info.update({k: torch.tensor(v) for k, v in al.parts.items() if k in ALIGN_PARTS})
                    loss = al.add_to(loss)
                return (loss, *out[1:])

            self.actor_loss_fn = loss_fn
            try:
                status = super().training_step(experience, kl_ctl, step, loss_batch_info)
            finally:
                self.actor_loss_fn = orig
        guards.require_called(len(calls), _LOSS, _STEP)  # else no alignment term and no metrics
        return status


# the alignment term's parts that OpenRLHF averages over micro-batches into its status (not the per-layer dicts)
ALIGN_PARTS = tuple(k for k in ALIGN_PART_FIELDS if not k.endswith("_flipped"))


def metrics_line(step: int, method: str, status: dict, kl_on: bool) -> StepMetrics:
    """OpenRLHF's per-step status -> the step's metrics record (`trace.metrics.StepMetrics`, the embedded trainer's
    fields); `fit` adds the times, the ranks and the evaluation."""
    g = status.get
    mm = {k: g(k) for k in ("k1", "k3", "dlp_abs_mean", "dlp_abs_max", "ratio_out_frac", "chi2")}
    layers = {key: {int(k.split("/", 1)[1]): v for k, v in status.items() if k.startswith(key + "/")}
              for key in LAYER_FIELDS}
    return StepMetrics(
        step=step, method=method, framework="openrlhf",
        reward_mean=g("reward"), accuracy=g("accuracy"), response_len=g("response_length"), **mm, **layers,
        guidance_bytes_per_gen_token=g("guidance_bytes_per_gen_token", 0.0),
        rollout_gen_tokens_per_s=g("rollout_gen_tokens_per_s"), record_overhead=g("record_overhead"),
        loss=g("policy_loss"), policy_loss=g("ppo_loss", g("policy_loss")),
        kl_ref=g("kl") if kl_on else None, align_loss=g("align_loss"),
        **{k: g(k) for k in ALIGN_PARTS if k in status},
        grad_norm=g("actor_grad_norm"), clip_frac=g("ppo_clip_ratio"), is_filter_frac=g("is_filter_ratio"))


_BASE = guards.ray_actor_class(_pa.PolicyModelActor, f"{_PA}.PolicyModelActor")
# OpenRLHF's own class under Ray's wrapper (which copies its methods): where a method TRACE overrides is defined
_ORIG = next((c for c in _BASE.__mro__ if c.__qualname__ == "PolicyModelActor" and c.__module__ == _pa.__name__), _BASE)
_EXP = "openrlhf.trainer.ppo_utils.experience.Experience.mm_train_inputs"
# what the policy actor replaces or wraps (init_model_from_pretrained swaps the first three for its call;
# the class below overrides the last three), and the OpenRLHF code that must still use each
HOOKS = (
    guards.Hook(_pa, "Actor", f"{_PA}.Actor"),
    guards.Hook(_pa, "ActorPPOTrainer", f"{_PA}.ActorPPOTrainer"),
    guards.Hook(_pa.DeepspeedStrategy, "get_ds_train_config", "DeepspeedStrategy.get_ds_train_config"),
    guards.Hook(_pa.ActorPPOTrainer, "training_step", f"{_PA}.{_STEP}"),
    guards.Hook(_ORIG, "init_model_from_pretrained", f"{_PA}.{_INIT}", own=True),
    guards.Hook(_ORIG, "forward", f"{_PA}.PolicyModelActor.forward", own=True),
    guards.Hook(_ORIG, "fit", f"{_PA}.PolicyModelActor.fit", own=True),
    guards.Hook(_ORIG, "broadcast_to_vllm", f"{_PA}.PolicyModelActor.broadcast_to_vllm", own=True),
    guards.Hook(_ORIG, "save_checkpoint", f"{_PA}.PolicyModelActor.save_checkpoint", own=True),
)
USES = (
    guards.Use(_BASE, "init_model_from_pretrained", "Actor", f"{_PA}.Actor", _INIT),
    guards.Use(_BASE, "init_model_from_pretrained", "ActorPPOTrainer", f"{_PA}.ActorPPOTrainer", _INIT),
    guards.Use(_BASE, "init_model_from_pretrained", "get_ds_train_config", "DeepspeedStrategy.get_ds_train_config",
               _INIT),
    # resume: the DeepSpeed checkpoint's client states (global_step) are kept on the actor
    guards.Use(_BASE, "init_model_from_pretrained", "checkpoint_states",
               f"{_PA}.PolicyModelActor.checkpoint_states", _INIT),
    guards.Use(_pa.ActorPPOTrainer, "training_step", "actor_loss_fn", _LOSS, _STEP),
    # the HF checkpoints are pruned where the trainer asks the actors to save (by method name)
    guards.Use(_pt.BasePPOTrainer, "save_logs_and_checkpoints", "save_checkpoint",
               f"{_PA}.PolicyModelActor.save_checkpoint", "BasePPOTrainer.save_logs_and_checkpoints"),
    # records ride in Experience.mm_train_inputs: the samples generator fills it from the engine's
    # response, the experience maker hands it to the actor's forward as mm_train_inputs_list
    guards.Use(_sg.SamplesGenerator, "_process_response_into_experience", "mm_train_inputs", _EXP,
               "SamplesGenerator._process_response_into_experience"),
    guards.Use(_em.RemoteExperienceMaker, "make_experience", "mm_train_inputs_list",
               f"{_PA}.PolicyModelActor.forward(mm_train_inputs_list=)", "RemoteExperienceMaker.make_experience"),
)


def check_hooks() -> None:
    """Start-up check of the policy actor's hooks (guards.py): the OpenRLHF symbols they replace
    exist and the OpenRLHF code that should use them still refers to them. Raises PatchNotInForce."""
    guards.check_all(HOOKS, USES)
    guards.require_field(_exp.Experience, "mm_train_inputs", _EXP)


class TracePolicyActor(_BASE):
    """OpenRLHF's policy actor with TRACE's QAT patch, replay and metrics (wrap with ray.remote)."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        cfg = plugin.run_config()
        self._trace = TraceReplay(cfg)
        arm, fmt, zero = self._trace.arm, cfg["rl"]["fmt"], strategy.args.ds.zero_stage
        check_hooks()
        orig_actor, orig_trainer, orig_ds_cfg = _pa.Actor, _pa.ActorPPOTrainer, strategy.get_ds_train_config
        calls = {"Actor": 0, "get_ds_train_config": 0}

        def make_actor(*args, **kwargs):
            actor = orig_actor(*args, **kwargs)
            calls["Actor"] += 1
            prepare_for_qat(actor.model, arm.trainer_mode, fmt, zero)
            return actor

        def ds_train_config(*args, **kwargs):
            calls["get_ds_train_config"] += 1
            return trace_ds_config(orig_ds_cfg(*args, **kwargs))

        _pa.Actor, _pa.ActorPPOTrainer = make_actor, TraceActorPPOTrainer
        strategy.get_ds_train_config = ds_train_config
        guards.require_patched(_pa, "Actor", make_actor, f"{_PA}.Actor")
        guards.require_patched(_pa, "ActorPPOTrainer", TraceActorPPOTrainer, f"{_PA}.ActorPPOTrainer")
        guards.require_patched(strategy, "get_ds_train_config", ds_train_config, "DeepspeedStrategy.get_ds_train_config")
        try:
            super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        finally:
            _pa.Actor, _pa.ActorPPOTrainer = orig_actor, orig_trainer
            strategy.get_ds_train_config = orig_ds_cfg
        guards.require_called(calls["Actor"], f"{_PA}.Actor", _INIT)
        guards.require_called(calls["get_ds_train_config"], "DeepspeedStrategy.get_ds_train_config", _INIT)
        if not isinstance(getattr(self, "trainer", None), TraceActorPPOTrainer):
            raise guards.PatchNotInForce(f"TRACE's patch of `{_PA}.ActorPPOTrainer` is not in force: "
                                         f"{_INIT} did not build self.trainer from it")
        guards.require_attr(self.trainer, "actor_loss_fn", _LOSS)
        if getattr(self.actor, "is_vlm", False):
            # OpenRLHF would merge mm_train_inputs (our record handles) into the VLM's forward as pixel inputs
            raise guards.PatchNotInForce(f"{_EXP} carries TRACE's records, which a VLM policy (Actor.is_vlm) "
                                         "would read as its image inputs; TRACE runs text-only policies")
        self.trainer.trace = self._trace
        self._trace_cfg = cfg
        states = guards.require_attr(self, "checkpoint_states", f"{_PA}.PolicyModelActor.checkpoint_states")
        start = int((states or {}).get("global_step", 0))  # > 0: resumed from OpenRLHF's DeepSpeed checkpoint
        self._trace_step = start
        self._trace_log = None
        if torch.distributed.get_rank() == 0:
            # as the embedded trainer: a resumed run keeps the lines up to its checkpoint's step, a fresh one none
            self._trace_log = rundir.MetricsLog.open(plugin.run_dir(), upto_step=start if start else None)
        if not start and cfg["rl"]["eval_every"]:
            # step 0: the initial policy's held-out accuracy in this arm's deployment
            ev = self._trace_evaluate()
            if self._trace_log is not None:
                self._trace_log.log(StepMetrics(step=0, method=cfg["rl"]["method"],
                                                eval_accuracy=ev["accuracy"]).to_dict())
        self._trace_t = time.perf_counter()
        self._trace_sync_s = 0.0  # weight syncs since the last step's metrics line

    def _trace_evaluate(self) -> dict | None:
        """`evaluate_policy` on the current policy in the arm's deployment (rank 0's result; None elsewhere).
        Under ZeRO-3 every rank takes part in gathering the parameters module by module and only rank 0 keeps them
        (`gathered_weights`), then evaluates the engine loaded from them."""
        cfg = self._trace_cfg
        model = hf_model(self.actor)
        rank = torch.distributed.get_rank()
        weights = gathered_weights(model, rank) if self.strategy.args.ds.zero_stage == 3 else None
        ev = None
        if rank == 0:
            was = model.training
            model.eval()
            try:
                ev = evaluate_policy(model, cfg, build_task(cfg), self.tokenizer, mode=self._trace.arm.deploy,
                                     state_dict=weights)
            finally:
                model.train(was)
        del weights
        torch.distributed.barrier()
        return ev

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        """Old log-probs of a micro-batch, under replay of its records."""
        dev = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        ctx = self._trace.context(hf_model(self.actor), mm_train_inputs_list, attention_mask.to(dev))
        with ctx:
            return super().forward(sequences, action_mask, attention_mask, packed_seq_lens, None)

    def broadcast_to_vllm(self):
        """OpenRLHF's weight sync to the rollout engines, timed for the next step's metrics line (time_sync_s)."""
        t = time.perf_counter()
        try:
            return super().broadcast_to_vllm()
        finally:
            self._trace_sync_s += time.perf_counter() - t

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """OpenRLHF's save, then rank 0 prunes the HF copies to --ckpt.max_num (checkpoints.py)."""
        out = super().save_checkpoint(tag, client_states, metric_value, metric_key)
        ckpt = self.strategy.args.ckpt
        if ckpt.save_hf and torch.distributed.get_rank() == 0:
            prune_hf_checkpoints(ckpt.path, ckpt.max_num)
        return out

    def fit(self, kl_ctl: float = 0):
        t0 = time.perf_counter()
        status = super().fit(kl_ctl)
        t1 = time.perf_counter()
        self._trace_step += 1
        rl = self._trace_cfg["rl"]
        every = rl["eval_every"]
        ev = None
        if every and (self._trace_step % every == 0 or self._trace_step == rl["steps"]):
            ev = self._trace_evaluate()
        t2 = time.perf_counter()
        if self._trace_log is not None:
            m = metrics_line(self._trace_step, rl["method"], status, rl["kl_coef"] > 0)
            m.time_train_s = t1 - t0
            # the weight sync after the previous step (the weights this step's rollout used), then the rollout
            m.time_sync_s = self._trace_sync_s
            m.time_rollout_s = max(0.0, t0 - self._trace_t - self._trace_sync_s)
            m.actor_ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            if ev is not None:
                m.eval_accuracy, m.eval_reward = ev["accuracy"], ev["reward"]
                m.time_eval_s = t2 - t1
            m.time_step_s = t2 - self._trace_t  # with the evaluation, as the embedded trainer's
            self._trace_log.log(m.to_dict())
        self._trace_t, self._trace_sync_s = t2, 0.0
        return status


__all__ = ["ADAM_OPS", "HOOKS", "USES", "TraceActorPPOTrainer", "TracePolicyActor", "TraceReplay", "adam_op_builds",
           "check_hooks", "choose_optimizer", "gathered_weights", "hf_model", "metrics_line", "mismatch_metrics",
           "positions", "prepare_for_qat", "shared_input_modules", "trace_ds_config"]
