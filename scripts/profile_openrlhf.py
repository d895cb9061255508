"""Where the OpenRLHF path's rollout and replay time goes, against the embedded trainer, on one config.

Rollout: our engine as a local Ray actor, driven the way OpenRLHF's samples generator drives it (one
`generate_responses.remote` per prompt, all in flight at once, `ray.get` of the response lists, each
turned into an Experience by OpenRLHF's `_process_response_into_experience`); reported: engine calls
and their batch sizes, the actor's CPU seconds per rollout, split into the engine call, the rest of
`_run_batch` (record finish and split) and everything else (executor, reward, record packing,
`ray.put`). Trainer: the old-log-prob forward of the batch in micro-batches under
`TraceReplay.context` (record fetch, batching, replay) against the same forward without replay.
Embedded: one `RolloutEngine.generate` of all prompts with n = group size and the same recorders
(what `trace.rl.trainer.RLTrainer._step` calls). Times are CPU seconds of the process concerned
(steadier than wall time on a shared machine); the second of two repetitions is reported.

    PYTHONPATH=$PWD python scripts/profile_openrlhf.py --model qwen3_moe-tiny --prompts 32 --group 8 \
        --method qat-independent [--set rl.diag_flips=false]

Compared against: the step times of scripts/gpu/openrlhf_small.sh and `python -m trace.rl` (results/openrlhf/).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from trace.integrations.openrlhf import stand_ins

stand_ins.install()  # before OpenRLHF imports vLLM names

import ray  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from trace import config as C  # noqa: E402
from trace.arms import ARMS  # noqa: E402
from trace.guidance import Tee  # noqa: E402
from trace.integrations.openrlhf import records as R  # noqa: E402
from trace.integrations.openrlhf.actor import TraceReplay, prepare_for_qat  # noqa: E402
from trace.integrations.openrlhf.launch import REWARD_FILE  # noqa: E402
from trace.integrations.openrlhf.rollout import TraceRolloutEngine  # noqa: E402
from trace.models import build_model, build_tokenizer, save_checkpoint  # noqa: E402
from trace.tasks import get_task  # noqa: E402

clock = time.process_time


class Probe(TraceRolloutEngine):
    """The actor with CPU timers around its engine calls and the rest of `_run_batch`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prof = {"batches": [], "engine_s": 0.0, "run_batch_s": 0.0}
        gen = self.engine.generate

        def timed(*ga, **gkw):
            t = clock()
            out = gen(*ga, **gkw)
            self.prof["engine_s"] += clock() - t
            return out

        self.engine.generate = timed

    def _run_batch(self, prompts, *a, **kw):
        t0 = clock()
        res = super()._run_batch(prompts, *a, **kw)
        self.prof["batches"].append(len(prompts))
        self.prof["run_batch_s"] += clock() - t0
        return res

    def take_stats(self):
        p, self.prof = self.prof, {"batches": [], "engine_s": 0.0, "run_batch_s": 0.0}
        return {**p, "cpu_s": clock()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_moe-tiny")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--method", default="qat-independent")
    ap.add_argument("--micro", type=int, default=16, help="micro-batch size of the trainer's forward")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = tempfile.mkdtemp()
    save_checkpoint(build_model(args.model, seed=0), build_tokenizer(), d)
    cfg = C.load_config(None, [f"model={args.model}", f"rl.method={args.method}", "rl.max_new_tokens=16",
                               f"rl.group_size={args.group}", *args.set])
    rl = cfg["rl"]
    exs = get_task("reasoning-short", difficulty="easy").make_split("train", args.prompts, 0)
    out = {"method": args.method, "model": args.model, "prompts": args.prompts, "group": args.group,
           "diag_flips": rl["diag_flips"]}

    # ---- embedded: one engine call for all prompts, n = group
    eng = TraceRolloutEngine(d, cfg, seed=1, remote_rm_url=[str(REWARD_FILE)])
    ids = [eng.tok.encode(ex.prompt) for ex in exs]
    for rep in range(2):
        guide, diag = eng.method.recorders(eng.num_layers)
        both = Tee(guide, diag) if guide is not None or diag is not None else None
        t0 = clock()
        b = eng.engine.generate(ids, n=args.group, max_new_tokens=16, seed=rep, stop_token_ids={eng.tok.eos_token_id},
                                stop_strings=eng.stop_strings, tokenizer=eng.tok, recorder=both)
        t1 = clock()
        for r in (guide, diag):
            if r is not None:
                r.finish()
        t2 = clock()
    out["embedded"] = {"generate_cpu_s": t1 - t0, "finish_cpu_s": t2 - t1, "gen_tokens": b.num_generated_tokens}
    del eng

    # ---- OpenRLHF: the actor in Ray, one generate_responses per prompt, all in flight
    ray.init(num_cpus=2, include_dashboard=False)
    actor = ray.remote(Probe).options(num_cpus=0).remote(d, cfg, seed=1, remote_rm_url=[str(REWARD_FILE)],
                                                         wave_prompts=args.prompts)  # as create_engines, one engine
    sp = SamplingParams(max_tokens=16, logprobs=1)
    tok = build_tokenizer()
    for _ in range(2):
        a0 = ray.get(actor.take_stats.remote())["cpu_s"]
        w0, t0 = time.perf_counter(), clock()
        refs = [actor.generate_responses.remote(prompt=ex.prompt, label=ex.label, sampling_params=sp, max_length=256,
                                                hf_tokenizer=tok, num_samples=args.group) for ex in exs]
        resp = [r for lst in ray.get(refs) for r in lst]
        w1, t1 = time.perf_counter(), clock()
        st = ray.get(actor.take_stats.remote())
        exps = [SamplesGenerator._process_response_into_experience(None, r, max_len=256) for r in resp]
        t2 = clock()
    out["openrlhf_rollout"] = {
        "wall_s": w1 - w0, "actor_cpu_s": st["cpu_s"] - a0, "engine_cpu_s": st["engine_s"],
        "run_batch_rest_cpu_s": st["run_batch_s"] - st["engine_s"],
        "actor_other_cpu_s": st["cpu_s"] - a0 - st["run_batch_s"], "engine_batches": st["batches"],
        "driver_get_cpu_s": t1 - t0, "to_experience_cpu_s": t2 - t1}

    # ---- trainer side: old-log-prob forward in micro-batches, with and without replay
    tr = TraceReplay(cfg)
    act = Actor(d, attn_implementation="sdpa", param_dtype="bf16")
    prepare_for_qat(act.model, ARMS[rl["method"]].trainer_mode, rl["fmt"], zero_stage=0)
    mbs = [Experience.concat_experiences(exps[i:i + args.micro], tok.pad_token_id)
           for i in range(0, len(exps), args.micro)]
    times = {"fetch_cpu_s": 0.0, "batch_records_cpu_s": 0.0, "fwd_replay_cpu_s": 0.0, "fwd_plain_cpu_s": 0.0}
    with torch.no_grad():
        for mb in mbs:
            t0 = clock()
            recs = tr.records(mb.mm_train_inputs)
            t1 = clock()
            for v in (recs or {}).values():
                R.batch_records(v, "cpu")
            t2 = clock()
            with tr.context(act.model, mb.mm_train_inputs, mb.attention_mask):  # fetches and batches again
                act(mb.sequences, mb.action_mask.bool(), attention_mask=mb.attention_mask)
            t3 = clock()
            act(mb.sequences, mb.action_mask.bool(), attention_mask=mb.attention_mask)
            t4 = clock()
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[k] += dt
    out["trainer_old_logprobs"] = times
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
