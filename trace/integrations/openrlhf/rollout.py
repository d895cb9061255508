"""Our rollout engine as a Ray actor that OpenRLHF drives in place of its vLLM engines.

OpenRLHF's samples generator calls `generate_responses(prompt, label, sampling_params, max_length,
hf_tokenizer, num_samples)` on each engine; that runs OpenRLHF's own executor (single turn with the
`--reward.remote_url` reward function, or the `--train.agent_func_path` AgentExecutor), which calls
back `generate(prompt_token_ids, sampling_params)` once per sample and turn and reads a vLLM-shaped
RequestOutput. The requests of all executor tasks in flight (every sample of every prompt this actor
is serving) are queued until each task has asked or finished and the wave of prompts has arrived
(SETTLE_S), then run as one batched `RolloutEngine.generate` call (the samples of a prompt as its n
samples, prefilled once; BF16, or W4A4 + FP4 KV for the FP4 arms) recording through the
embedded trainer's recorders (the arm's `trace.guidance.Method.recorders`, both fed by one forward through `Tee`):
the arm's guidance record (trace*: the deepest rho of the layers) and the diagnostic record (every arm
whose trainer quantizes activations, with `rl.diag_flips`: all layers, full codes, for flip statistics
only). Each batch record is split per sample into one packed buffer each (`records.pack_split`);
each sample's records (turns merged, earliest row wins) are `ray.put` into the object store; their
handles (ObjectRefs, never the bytes) ride in the response's `mm_train_inputs` = {"trace_record":
ref, "trace_diag": ref} (a key only where that record exists); the trainer fetches them per
micro-batch. Recording time and bytes count the guidance record alone, as in the embedded trainer.

Prompts are encoded as in SFT and the embedded trainer (`trace.episode.encode_prompt`: `<bos>` + the
prompt's tokens). OpenRLHF's executors tokenize the prompt themselves with the tokenizer they are handed
and no special tokens; `generate_responses` hands each sample's executor a `PromptTokenizer`, which
encodes the first text that executor tokenizes (the prompt; the initial observation of a multi-turn
agent, ours being the prompt) with `encode_prompt` and everything after (environment feedback) as
given. `generate` checks that a sample's first request starts with `<bos>` (else the executor no longer
tokenizes through the tokenizer it is given: one line, guards.PatchNotInForce).

Weight sync, both of OpenRLHF's protocols: `init_process_group` + `update_weight` (a broadcast from
trainer rank 0 over vLLM's stateless group, or its stand-in on torch c10d: NCCL on a GPU, gloo on the
CPU; or over ray.util.collective with --vllm.sync_with_ray) and `update_weight_cuda_ipc` (colocated GPU). Each
BF16 tensor, exactly as the trainer broadcasts it, is re-quantized as it arrives into the engine's FP4
weights (`RolloutEngine.sync_tensor`: the trainer's own quantizer, `trace.fp4.quantize_weight`,
computing in BF16 like the trainer) and dropped, so the engine never holds more than one received
tensor (`pending`) beside its own weights; the parameter flagged `empty_cache=True` (the last one)
closes the sync (`RolloutEngine.finish_sync`: a tied lm_head, the kernels' layouts, a check that every
parameter came). The FP4 weights are bit-identical to a re-quantization of the whole state dict at once.
Generation refuses to run while a sync is open (the engine holds old and new weights mixed).

    engines = create_engines(1, model_path, cfg)        # what launch puts in place of create_vllm_engines
    ray.get(engines[0].generate_responses.remote(prompt, label, sp, 512, tok, 4))

Compared against: the embedded trainer's engine use (trace/rl/trainer.py) and OpenRLHF 0.11.2's
`vllm_engine.RolloutRayActor` (same method names and response keys).
"""
from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from trace.integrations.openrlhf import guards, stand_ins

stand_ins.install()  # before OpenRLHF's modules import vLLM / flash-attn names
# (the weight-sync group classes below are vLLM's where it is installed, else the stand-ins)

import ray  # noqa: E402
import ray.util.collective as collective  # noqa: E402
from openrlhf.trainer.ray.utils import get_physical_gpu_id  # noqa: E402
from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: E402
from vllm.distributed.utils import StatelessProcessGroup  # noqa: E402

from trace.episode import build_task, encode_prompt  # noqa: E402
from trace.guidance import Method  # noqa: E402
from trace.guidance.record import Tee  # noqa: E402
from trace.integrations.openrlhf.plugin import run_config  # noqa: E402
from trace.integrations.openrlhf.records import merge_turns, pack, pack_split, unpack  # noqa: E402
from trace.rollout import RolloutEngine  # noqa: E402

RECORD_KEY = "trace_record"  # the arm's guidance record
DIAG_KEY = "trace_diag"  # the diagnostic full-codes record of all layers (flip statistics only)
_SLOT: contextvars.ContextVar = contextvars.ContextVar("trace_sample_slot", default=None)
# OpenRLHF submits one generate_responses per prompt; Ray hands them to the event loop one by one,
# milliseconds apart (more on a busy host). A flush of newly arrived prompts waits until none has
# arrived for SETTLE_S and, until SETTLE_MAX_S has passed without one, until the wave is complete
# (`wave_prompts`: the rollout batch's share of this engine), so that the wave runs as one engine
# call rather than its first prompts alone and then the rest.
SETTLE_S, SETTLE_MAX_S = 0.02, 0.5


class PromptTokenizer:
    """OpenRLHF's tokenizer for one sample's executor: its first call (the prompt) encodes the text as SFT
    does (`encode_prompt`: `<bos>` first), later calls (environment feedback) pass through; attributes
    (decode, eos_token_id, ...) are the tokenizer's."""

    def __init__(self, tok):
        self._tok, self.first = tok, True

    def __call__(self, *args, **kwargs):
        if not self.first or self._tok.bos_token_id is None:
            return self._tok(*args, **kwargs)
        self.first = False
        text = kwargs.get("text", args[0] if args else None)
        if not isinstance(text, str):
            raise TypeError("PromptTokenizer encodes one prompt string")
        ids = encode_prompt(self._tok, text)
        return {"input_ids": torch.tensor([ids]) if kwargs.get("return_tensors") == "pt" else ids}

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _load_agent(path: str):
    spec = importlib.util.spec_from_file_location("trace_agent_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not issubclass(mod.AgentExecutor, AgentExecutorBase):
        raise TypeError(f"{path}: AgentExecutor must subclass openrlhf's AgentExecutorBase")
    return mod.AgentExecutor()


def _merged(recs: list):
    """One sample's packed records of one kind over its turns -> one packed record (None where none
    was taken)."""
    recs = [r for r in recs if r is not None]
    if len(recs) > 1:
        return pack(merge_turns([unpack(r) for r in recs]))
    return recs[0] if recs else None


class TraceRolloutEngine:
    """The actor body (also usable in-process, which the tests do)."""

    def __init__(self, model_path: str, cfg: dict, *, seed: int = 0, agent_func_path: str | None = None,
                 remote_rm_url=None, device: str | None = None, stop_strings=None, wave_prompts: int | None = None,
                 **_ignored):
        self.cfg, self.rl = cfg, cfg["rl"]
        self.method = Method.from_config(self.rl)
        self.arm = self.method.arm
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # the trainer holds and broadcasts BF16 weights and computes in BF16: the engine does the same
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, local_files_only=True)
        self.tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.engine = RolloutEngine(model.config, mode=self.arm.engine_mode, fmt=self.rl["fmt"],
                                    kv_fp4=self.arm.kv_fp4, dtype=torch.bfloat16, device=self.device)
        # the model's own RoPE buffer stays the engine's: a sync carries parameters only
        self.engine.sync_weights(model)
        self.num_layers = model.config.num_hidden_layers
        del model
        if stop_strings is None:
            stop_strings = (build_task(cfg).stop,)
        self.stop_strings = tuple(stop_strings)
        self.executor = (_load_agent(agent_func_path) if agent_func_path
                         else SingleTurnAgentExecutor(remote_rm_url))
        self.seed = int(seed)
        self._calls = 0
        self._queue: list = []  # pending generate requests: (sampling key, ids, slot, future)
        self._active = 0  # executor tasks in flight
        self._flush_pending = False
        self._last_arrival = float("-inf")
        self._fresh = 0  # prompts arrived since the last flush
        self.wave_prompts = wave_prompts
        self._slots: dict[int, list] = {}
        self._next_slot = 0
        self.pending: dict[str, torch.Tensor] = {}  # the received tensor being re-quantized (at most one)
        self._group = None
        self.syncs = 0
        self.last_sync = {}
        self._sync_s = 0.0  # re-quantization seconds of the sync in progress

    # ------------------------------------------------------------------ generation
    def get_num_unfinished_requests(self) -> int:
        return self._active

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """One sample from token ids; returns a vLLM-shaped RequestOutput. Requests wait until every
        executor task in flight has asked (or finished), then run as one batched engine call."""
        if multi_modal_data:
            raise NotImplementedError("the TRACE engine is text-only")
        sp = sampling_params
        ids = [int(t) for t in prompt_token_ids]
        # per call (= per turn) at most rl.max_new_tokens, as the embedded trainer; OpenRLHF's
        # multi-turn executor passes the whole remaining context budget as max_tokens
        max_new = min(int(sp.max_tokens or self.rl["max_new_tokens"]), self.rl["max_new_tokens"],
                      self.engine.max_seq_len - len(ids))
        stop_ids = {int(self.tok.eos_token_id)} | {int(t) for t in (getattr(sp, "stop_token_ids", None) or [])}
        slot = _SLOT.get()
        bos = self.tok.bos_token_id
        if slot is not None and bos is not None and not self._slots[slot]["records"] and ids[:1] != [bos]:
            raise guards.PatchNotInForce("a prompt reached the TRACE engine without <bos>: either it is longer than "
                                         "--data.max_len minus rl.max_new_tokens and OpenRLHF cut its start (pass a "
                                         "larger --data.max_len), or OpenRLHF's executor no longer tokenizes it with "
                                         "the hf_tokenizer it is given (PromptTokenizer)")
        fut = asyncio.get_running_loop().create_future()
        key = (max(1, max_new), float(sp.temperature), float(sp.top_p), tuple(sorted(stop_ids)))
        self._queue.append((key, ids, slot, fut))
        self._schedule_flush()
        return await fut

    def _schedule_flush(self):
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self):
        """Run the queued requests once no task in flight can still add one (batched per sampling key)."""
        self._flush_pending = False
        if not self._queue or len(self._queue) < self._active:
            return
        if self._fresh:  # more prompts of this wave may be on their way
            quiet = time.perf_counter() - self._last_arrival
            settle = SETTLE_S if self._fresh >= (self.wave_prompts or 0) else SETTLE_MAX_S
            if quiet < settle:
                self._flush_pending = True
                asyncio.get_running_loop().call_later(settle - quiet, self._flush)
                return
        self._fresh = 0
        queue, self._queue = self._queue, []
        groups: dict[tuple, list] = {}
        for item in queue:
            groups.setdefault(item[0], []).append(item)
        for (max_new, temperature, top_p, stop_ids), items in groups.items():
            try:
                outs = self._run_batch([it[1] for it in items], max_new, temperature, top_p, stop_ids)
            except Exception as e:  # noqa: BLE001 - the executors' awaits re-raise it
                for it in items:
                    it[3].set_exception(e)
                continue
            for it, (request_output, record, diag, tokens, gen_s, rec_s) in zip(items, outs, strict=True):
                if it[2] is not None:
                    entry = self._slots[it[2]]
                    entry["records"].append(record)
                    entry["diags"].append(diag)
                    entry["tokens"] += tokens
                    entry["gen_s"] += gen_s
                    entry["rec_s"] += rec_s
                it[3].set_result(request_output)

    def _run_batch(self, prompts, max_new, temperature, top_p, stop_ids):
        """One engine call for several samples: per sample (RequestOutput, guidance record,
        diagnostic record, generated tokens, its share of the generation seconds, its share of the
        recording seconds). Requests with the same prompt (OpenRLHF sends each sample of a prompt
        alone) run as the n samples of that prompt, prefilled and recorded once, when every prompt
        has the same number of them; `pack_split` copies the shared prompt rows into each
        sample's (packed) record. Generation time excludes all recording (`RolloutBatch.generate_s`); the
        recording seconds are the guidance record's own (`Recorder.seconds`, the final feed, its finish
        and split into packed per-sample records), as the embedded trainer counts them: the diagnostic record's time never counts."""
        same: dict[tuple, list[int]] = {}
        for i, ids in enumerate(prompts):
            same.setdefault(tuple(ids), []).append(i)
        n = len(next(iter(same.values())))
        if n > 1 and all(len(v) == n for v in same.values()):
            uniq, order = [list(k) for k in same], [i for v in same.values() for i in v]
        else:
            n, uniq, order = 1, prompts, list(range(len(prompts)))
        guide, diag = self.method.recorders(self.num_layers)
        both = Tee(guide, diag) if guide is not None or diag is not None else None
        self._calls += 1
        out = self.engine.generate(uniq, n=n, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                                   seed=self.seed * 1_000_003 + self._calls, stop_token_ids=stop_ids,
                                   stop_strings=self.stop_strings, tokenizer=self.tok, recorder=both)
        B = len(prompts)
        t_fin = time.perf_counter()
        # records travel to the trainer through Ray as host bytes
        records = pack_split(guide.finish().on("cpu"), B) if guide is not None else [None] * B
        t_fin2 = time.perf_counter()
        diags = pack_split(diag.finish().on("cpu"), B) if diag is not None else [None] * B
        rec_s = guide.seconds + out.record_feed_s + (t_fin2 - t_fin) if guide is not None else 0.0
        res = [None] * B
        for b, i in enumerate(order):  # engine sample b answers request i
            resp, lps = out.response_tokens(b), out.logprobs[b]
            n_tok = sum(out.trainable[b])
            finish = "length" if out.stop_reason[b] in ("length", "context") else "stop"
            logprobs = [{t: SimpleNamespace(logprob=float(lp))} for t, lp in zip(resp, lps, strict=True)]
            ro = SimpleNamespace(prompt_token_ids=prompts[i], outputs=[SimpleNamespace(
                token_ids=list(resp), text=self.tok.decode(resp, skip_special_tokens=False), finish_reason=finish,
                logprobs=logprobs)])
            share = n_tok / max(out.num_generated_tokens, 1)
            res[i] = (ro, records[b], diags[b], n_tok, out.generate_s * share, rec_s * share)
        return res

    def _task_done(self, _task):
        self._active -= 1
        self._schedule_flush()  # the others may all be waiting already

    async def generate_responses(self, prompt: str, label: str, sampling_params, max_length: int, hf_tokenizer,
                                 num_samples: int = 1, images=None):
        """N samples of one prompt through OpenRLHF's executor; each response carries its record handle."""
        self._last_arrival = time.perf_counter()
        self._fresh += 1
        tasks, slots = [], []
        for _ in range(num_samples):
            slot = self._next_slot
            self._next_slot += 1
            self._slots[slot] = {"records": [], "diags": [], "tokens": 0, "gen_s": 0.0, "rec_s": 0.0}
            ctx = contextvars.copy_context()
            ctx.run(_SLOT.set, slot)
            task = asyncio.get_running_loop().create_task(
                self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                      max_length=max_length, hf_tokenizer=PromptTokenizer(hf_tokenizer),
                                      llm_engine=self,
                                      images=images), context=ctx)
            self._active += 1
            task.add_done_callback(self._task_done)
            tasks.append(task)
            slots.append(slot)
        responses = await asyncio.gather(*tasks)
        for resp, slot in zip(responses, slots, strict=True):
            entry = self._slots.pop(slot)
            record, diag = (_merged(entry[k]) for k in ("records", "diags"))
            n_gen = max(entry["tokens"], 1)
            # the same keys on every response: OpenRLHF stacks extra_logs across samples. Bytes: the
            # arm's own record per generated token (DESIGN.md §3); a sample's record holds its prompt
            # rows itself (OpenRLHF asks for one sample per request), so this is above the embedded
            # trainer's figure, where a prompt's samples share its rows
            extra = dict(resp.get("extra_logs") or {})
            extra["guidance_bytes_per_gen_token"] = self.method.record_bytes_per_generated_token(record, n_gen)
            extra["rollout_tokens"] = float(entry["tokens"])
            extra["rollout_gen_tokens_per_s"] = entry["tokens"] / max(entry["gen_s"], 1e-9)
            extra["record_overhead"] = entry["rec_s"] / max(entry["gen_s"], 1e-9)
            resp["extra_logs"] = extra
            # handles in the object store, fetched by the trainer per micro-batch; in-process use
            # (no Ray) keeps the records themselves
            mm = {key: ray.put(r) if ray.is_initialized() else unpack(r)
                  for key, r in ((RECORD_KEY, record), (DIAG_KEY, diag)) if r is not None}
            resp["mm_train_inputs"] = mm or None
        return responses

    # ------------------------------------------------------------------ weight sync
    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                           backend="nccl", use_ray=False):
        """Join the weight-sync group of trainer rank 0 (rank 0) and the engines."""
        if use_ray:
            collective.init_collective_group(world_size=world_size, rank=rank_offset, backend=backend,
                                             group_name=group_name)
            self._group = ("ray", group_name)
            return
        pg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank_offset,
                                          world_size=world_size)
        dev = self.device.index if self.device.type == "cuda" else self.device
        self._group = ("pg", PyNcclCommunicator(pg, device=dev if dev is not None else 0))

    def _receive(self, name, tensor, empty_cache):
        """One received parameter: re-quantized into the engine at once and dropped; the last one closes the sync."""
        t0 = time.perf_counter()
        self.pending[name] = tensor
        try:
            self.engine.sync_tensor(name, tensor)
        finally:
            self.pending.clear()
        if empty_cache:
            synced = self.engine.finish_sync()
            self.syncs += 1
            self.last_sync = {"params": len(synced), "seconds": self._sync_s + time.perf_counter() - t0}
            self._sync_s = 0.0
        else:
            self._sync_s += time.perf_counter() - t0

    def update_weight(self, name, dtype, shape, empty_cache=False):
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        kind, group = self._group
        if kind == "ray":
            collective.broadcast(buf, 0, group_name=group)
        else:
            group.broadcast(buf, src=0)
        self._receive(name, buf, empty_cache)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles, empty_cache=False):
        func, args = ipc_handles[get_physical_gpu_id()]
        args = list(args)
        args[6] = self.device.index  # rebuild on this process's device (CUDA_VISIBLE_DEVICES may differ)
        weight = func(*args).clone()
        torch.cuda.synchronize()
        self._receive(name, weight, empty_cache)

    def sync_info(self) -> dict:
        """Syncs done, and of the last one: parameters loaded (a tied lm_head counted) and re-quantization seconds
        (the engine's work, without the waits for the broadcast)."""
        return {"syncs": self.syncs, **self.last_sync}

    def fp4_weights(self) -> dict:
        """HF name -> FP4 codes of the engine's current weights (tests compare them with the trainer's)."""
        return {k: v.codes.cpu() for k, v in self.engine.weights.fp4.items()}

    # features OpenRLHF calls only with options we do not pass (sleep, prefix caching, async partial rollout)
    def reset_prefix_cache(self):
        return None


def create_engines(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, full_determinism=False,
                   enable_prefix_caching=False, enforce_eager=False, max_model_len=None, shared_pg=None, *args,
                   agent_func_path=None, remote_rm_url=None, cfg: dict | None = None, num_gpus: float | None = None,
                   **kwargs):
    """Drop-in for `openrlhf.trainer.ray.create_vllm_engines` (same positional arguments). With
    `shared_pg` (colocated training) engine i takes bundle i of OpenRLHF's placement group, so it
    shares the GPU of trainer rank i (the CUDA-IPC sync needs that)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    if tensor_parallel_size != 1:
        raise ValueError("the TRACE engine runs one engine per GPU (--vllm.tensor_parallel_size 1)")
    if enable_prefix_caching:
        raise ValueError("the TRACE engine has no prefix cache (drop --vllm.enable_prefix_caching)")
    if cfg is None:
        cfg = run_config()
    if num_gpus is None:
        num_gpus = 0.2 if torch.cuda.is_available() else 0
    actor = ray.remote(TraceRolloutEngine)
    # OpenRLHF's rollout batch (--rollout.batch_size = rl.prompts_per_step) spread evenly over the engines
    wave = max(1, cfg["rl"]["prompts_per_step"] // num_engines)
    engines = []
    for i in range(num_engines):
        opts = {"num_cpus": 0, "num_gpus": num_gpus}
        if shared_pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=shared_pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=i)
        engines.append(actor.options(**opts).remote(str(Path(pretrain)), cfg, seed=seed + i,
                                                    agent_func_path=agent_func_path, remote_rm_url=remote_rm_url,
                                                    wave_prompts=wave))
    return engines


__all__ = ["DIAG_KEY", "RECORD_KEY", "PromptTokenizer", "TraceRolloutEngine", "create_engines"]
