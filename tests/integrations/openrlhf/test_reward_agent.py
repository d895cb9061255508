"""Our reward function and multi-turn environment, run by OpenRLHF's own executors.

Single turn: `SingleTurnAgentExecutor` loads trace/integrations/openrlhf/reward.py by path (as
`--reward.remote_url` does) and drives our engine (`TraceRolloutEngine.generate_responses`, in
process); each response's reward is the task verifier's score of its text, and it carries its
guidance record and the diagnostic record of all layers, each covering every token (the bytes column
counts the guidance record alone); each arm ships exactly the records its trainer-side replay expects,
and that replay yields per-layer flip rates for every arm with a diagnostic record (qat-independent,
trace), none for bf16. Multi turn: agent.py's `AgentExecutor` plays the number
guessing game, first against a scripted engine replaying the gold (binary search) policy, then
against our engine with per-turn records merged into one per sample. The engine batches the
requests of all samples in flight into one engine call.
"""
import asyncio
from types import SimpleNamespace

import pytest
import torch

from trace import config as C
from trace.arms import ARMS
from trace.integrations.openrlhf import stand_ins
from trace.integrations.openrlhf.actor import TraceReplay, positions
from trace.integrations.openrlhf.launch import AGENT_FILE, REWARD_FILE
from trace.integrations.openrlhf.rollout import DIAG_KEY, RECORD_KEY, TraceRolloutEngine
from trace.models import build_model, build_tokenizer, load_checkpoint, save_checkpoint
from trace.qat import patch_model
from trace.tasks import get_task
from trace.tasks.long_horizon import binary_search_policy

stand_ins.install()
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from vllm import SamplingParams  # noqa: E402  (the stand-in without vLLM)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), d)
    return str(d)


def _cfg(task, method="trace", *extra):
    return C.load_config(None, ["model=qwen3_moe-tiny", f"task.name={task}", f"rl.method={method}",
                                "rl.max_new_tokens=6", *extra])


def test_single_turn_reward_and_records(model_dir):
    cfg = _cfg("reasoning")
    eng = TraceRolloutEngine(model_dir, cfg, seed=1, remote_rm_url=[str(REWARD_FILE)])
    task = get_task("reasoning", difficulty="easy")
    ex = task.make_split("train", 2, 0)[0]
    sp = SamplingParams(max_tokens=6, logprobs=1)
    out = asyncio.run(eng.generate_responses(ex.prompt, ex.label, sp, 64, eng.tok, num_samples=3))
    assert len(out) == 3 and eng._calls == 1  # the three executor requests ran as one engine call
    for r in out:
        (start, end), = r["action_ranges"]
        text = eng.tok.decode(r["observation_tokens"][start:end])
        assert r["reward"] == pytest.approx(task.score(ex, text))
        assert len(r["rollout_log_probs"]) == end
        rec, diag = r["mm_train_inputs"][RECORD_KEY], r["mm_train_inputs"][DIAG_KEY]
        # guided layers (rho 0.5 of 4) record every position the trainer will see
        assert rec.layers == [2, 3] and not rec.full_codes
        assert rec.sites[(3, "attn_in")].keys.tolist() == list(range(end))
        # the diagnostic record: all layers, full codes, the same positions
        assert diag.layers == [0, 1, 2, 3] and diag.full_codes
        assert all(s.keys.tolist() == list(range(end)) for s in diag.sites.values())
        n_gen = r["extra_logs"]["rollout_tokens"]
        assert r["extra_logs"]["guidance_bytes_per_gen_token"] == pytest.approx(
            rec.bytes_per_generated_token(int(n_gen), compact_only=True))
    # the gold answer is rewarded 1 through the same file
    good = task.sft_target(ex)
    assert eng.executor.reward_func([ex.prompt + good], [ex.prompt], [ex.label])["rewards"].item() == 1.0


def test_a_wave_of_prompts_runs_as_one_engine_call(model_dir):
    """OpenRLHF sends one generate_responses per prompt; prompts that arrive apart (a busy host) still
    run as one engine call once the engine's share of the rollout batch has arrived."""
    eng = TraceRolloutEngine(model_dir, _cfg("reasoning", "bf16"), seed=1, remote_rm_url=[str(REWARD_FILE)],
                             wave_prompts=2)
    exs = get_task("reasoning", difficulty="easy").make_split("train", 2, 0)
    sp = SamplingParams(max_tokens=6, logprobs=1)

    async def wave():
        first = asyncio.ensure_future(eng.generate_responses(exs[0].prompt, exs[0].label, sp, 64, eng.tok, 2))
        await asyncio.sleep(0.1)  # longer than the quiet time alone would wait
        second = await eng.generate_responses(exs[1].prompt, exs[1].label, sp, 64, eng.tok, 2)
        return await first + second

    out = asyncio.run(wave())
    assert len(out) == 4 and eng._calls == 1


@pytest.mark.parametrize("method,extra,keys", [
    ("bf16", (), ()),
    ("qat-independent", (), (DIAG_KEY,)),
    ("trace", (), (RECORD_KEY, DIAG_KEY)),
    ("trace", ("rl.diag_flips=false",), (RECORD_KEY,)),
])
def test_records_shipped_per_arm(model_dir, method, extra, keys):
    cfg = _cfg("reasoning", method, "rl.max_new_tokens=2", *extra)
    eng = TraceRolloutEngine(model_dir, cfg, seed=1, remote_rm_url=[str(REWARD_FILE)])
    ex = get_task("reasoning", difficulty="easy").make_split("train", 1, 0)[0]
    out = asyncio.run(eng.generate_responses(ex.prompt, ex.label, SamplingParams(max_tokens=2, logprobs=1), 64,
                                             eng.tok, num_samples=2))
    for r in out:
        assert tuple(sorted(r["mm_train_inputs"] or ())) == tuple(sorted(keys))
        guide = RECORD_KEY in keys  # bytes and recording time: the guidance record's alone
        assert (r["extra_logs"]["guidance_bytes_per_gen_token"] > 0) == guide
        assert (r["extra_logs"]["record_overhead"] > 0) == guide
    tr = TraceReplay(cfg)
    assert tr.keys == keys  # what the trainer side asks every sample for
    # the trainer side's replay of the micro-batch: flip statistics exactly where a diagnostic record came
    exps = [SamplesGenerator._process_response_into_experience(None, r, max_len=64) for r in out]
    b = Experience.concat_experiences(exps, eng.tok.pad_token_id)
    model, _ = load_checkpoint(model_dir, dtype=torch.bfloat16, load_tokenizer=False)
    patch_model(model, ARMS[method].trainer_mode, cfg["rl"]["fmt"])
    with torch.no_grad(), tr.context(model, b.mm_train_inputs, b.attention_mask) as stats:
        model(input_ids=b.sequences, attention_mask=b.attention_mask,
              position_ids=positions(b.attention_mask).clamp(min=0))
    flips = stats.summary()["code_flip_rate"] if stats is not None else {}
    assert sorted(flips) == ([0, 1, 2, 3] if DIAG_KEY in keys else [])


class _Scripted:
    """An llm_engine whose 'generation' is the gold policy's next action (vLLM-shaped output)."""

    def __init__(self, tok, example):
        self.tok, self.policy, self.prompt_len = tok, binary_search_policy(example), None

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        context = self.tok.decode(prompt_token_ids)
        action = self.policy(context)
        ids = self.tok(action, add_special_tokens=False)["input_ids"]
        lps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=action, finish_reason="stop",
                                                        logprobs=lps)])


def _load_agent():
    import importlib.util
    spec = importlib.util.spec_from_file_location("agent_under_test", AGENT_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.AgentExecutor()


def test_multi_turn_agent_gold_policy():
    task = get_task("long_horizon", difficulty="easy")
    tok = build_tokenizer()
    agent = _load_agent()
    for ex in task.make_split("train", 3, 0):
        r = asyncio.run(agent.execute(ex.prompt, ex.label, SamplingParams(max_tokens=None, logprobs=1), 256, tok,
                                      _Scripted(tok, ex)))
        transcript = tok.decode(r["observation_tokens"])[len(ex.prompt):]
        assert r["reward"] == 1.0 and task.score(ex, transcript) == 1.0
        assert len(r["action_ranges"]) >= 1 and len(r["rollout_log_probs"]) == len(r["observation_tokens"])


def test_multi_turn_engine_records(model_dir):
    cfg = _cfg("long_horizon")
    eng = TraceRolloutEngine(model_dir, cfg, seed=2, agent_func_path=str(AGENT_FILE))
    task = get_task("long_horizon", difficulty="easy")
    ex = task.make_split("train", 1, 0)[0]
    out = asyncio.run(eng.generate_responses(ex.prompt, ex.label, SamplingParams(max_tokens=None, logprobs=1),
                                             160, eng.tok, num_samples=2))
    assert eng._calls <= max(len(r["action_ranges"]) for r in out)  # one batched call per turn
    for r in out:
        transcript = eng.tok.decode(r["observation_tokens"], skip_special_tokens=True)[len(ex.prompt):]
        assert r["reward"] == pytest.approx(task.score(ex, transcript))
        n = len(r["observation_tokens"])
        last_action_end = r["action_ranges"][-1][1]
        for rec in (r["mm_train_inputs"][RECORD_KEY], r["mm_train_inputs"][DIAG_KEY]):
            keys = rec.sites[(3, "attn_in")].keys
            # every token the trainer forwards is in the merged records, once (the last env feedback
            # is never fed to the engine: it follows the last action and is not trained on)
            assert keys.tolist()[:last_action_end] == list(range(last_action_end)) and len(keys) <= n
            assert bool((keys[1:] > keys[:-1]).all())


@pytest.mark.parametrize("task_name", ["reasoning", "long_horizon"])
def test_prompts_encoded_as_in_sft(model_dir, task_name, monkeypatch):
    """OpenRLHF's executors tokenize the prompt themselves, without special tokens; through our engine a
    sample's sequence starts with SFT's encoding (`encode_prompt`: <bos> + prompt), environment feedback
    gets none, and an executor that bypasses the tokenizer it is handed is refused in one line."""
    from trace.episode import encode_prompt
    from trace.integrations.openrlhf import guards, rollout
    kw = {"agent_func_path": str(AGENT_FILE)} if task_name == "long_horizon" else {"remote_rm_url": [str(REWARD_FILE)]}
    eng = TraceRolloutEngine(model_dir, _cfg(task_name, "bf16"), seed=3, **kw)
    ex = get_task(task_name, difficulty="easy").make_split("train", 1, 0)[0]
    sp = SamplingParams(max_tokens=None if task_name == "long_horizon" else 6, logprobs=1)
    out = asyncio.run(eng.generate_responses(ex.prompt, ex.label, sp, 160, eng.tok, num_samples=2))
    head = encode_prompt(eng.tok, ex.prompt)
    for r in out:
        assert r["observation_tokens"][:len(head)] == head and r["action_ranges"][0][0] == len(head)
        assert r["observation_tokens"].count(eng.tok.bos_token_id) == 1  # the prompt's, none before feedback
        assert len(r["rollout_log_probs"]) == len(r["observation_tokens"])
    monkeypatch.setattr(rollout, "PromptTokenizer", lambda tok: tok)  # an executor tokenizing on its own
    with pytest.raises(guards.PatchNotInForce, match="without <bos>"):
        asyncio.run(eng.generate_responses(ex.prompt, ex.label, sp, 160, eng.tok, num_samples=1))
