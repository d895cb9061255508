"""The policy actor at scale, on the CPU:
- evaluation under ZeRO-3 gathers one module at a time (`gathered_weights`): with a stand-in of DeepSpeed's
  GatheredParameters that tracks what is gathered, no rank ever holds more than one module's parameters gathered,
  every parameter is gathered exactly once (tied embeddings too, and in the same order on every rank: the
  gathers are collectives), rank 0's state dict equals the model's own `state_dict()` parameters and the other
  ranks keep nothing; with real DeepSpeed ZeRO-3 (gloo, world size 1, every parameter partitioned) the actor's
  evaluation equals what the whole-model gather and `evaluate_policy(model)` give, and deploys the same weights, bit
  for bit;
- DeepSpeed's own Adam is kept where its op builds (`choose_optimizer`, the probe monkeypatched), torch's AdamW
  (`torch_adam`) set where it does not, and the probe reports a builder that fails to load as "not here"."""
from types import SimpleNamespace

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from zero3_steps import ds_config  # noqa: E402

from trace import config as C  # noqa: E402
from trace.episode import build_task, evaluate_policy  # noqa: E402
from trace.integrations.openrlhf import actor  # noqa: E402
from trace.models import build_model, build_tokenizer  # noqa: E402


class StandInGather:
    """deepspeed.zero.GatheredParameters, tracking the parameters gathered at each moment: `peak` is the largest
    number of modules' parameters held at once, `order` the gathered parameter lists in order."""

    live: list = []
    order: list = []
    peak = 0

    def __init__(self, params, modifier_rank=None):
        assert modifier_rank is None  # read-only: no rank's changes are broadcast back
        self.params = list(params)

    def __enter__(self):
        StandInGather.live.append(self.params)
        StandInGather.order.append([id(p) for p in self.params])
        StandInGather.peak = max(StandInGather.peak, len(StandInGather.live))

    def __exit__(self, *exc):
        StandInGather.live.remove(self.params)


@pytest.fixture
def stand_in_gather(monkeypatch):
    StandInGather.live, StandInGather.order, StandInGather.peak = [], [], 0
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", StandInGather)
    return StandInGather


@pytest.mark.parametrize("tied", [False, True])
def test_gathered_weights_one_module_at_a_time(stand_in_gather, tied):
    model = build_model("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16, tie_word_embeddings=tied)
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    assert actor.gathered_weights(model, rank=1) is None
    order_rank1 = stand_in_gather.order
    stand_in_gather.order = []
    sd = actor.gathered_weights(model, rank=0)
    assert stand_in_gather.order == order_rank1  # the same collectives in the same order on every rank
    assert stand_in_gather.peak == 1 and stand_in_gather.live == []
    gathered = [i for ids in order_rank1 for i in ids]
    assert sorted(gathered) == sorted(id(p) for p in model.parameters())  # each parameter once
    assert all(len({id(owners[i]) for i in ids}) == 1 for ids in order_rank1)  # one module's at a time
    want = {n: t for n, t in model.state_dict().items() if n in dict(model.named_parameters(remove_duplicate=False))}
    assert sd.keys() == want.keys() and ("lm_head.weight" in sd)
    assert all(torch.equal(sd[n], want[n]) and sd[n].data_ptr() != want[n].data_ptr() for n in sd)
    if tied:
        assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]


def _eval_cfg():
    return C.load_config(None, ["model=qwen3_moe-tiny", "rl.method=trace", "task.n_test=6",
                                "eval.samples_per_prompt=2", "rl.max_new_tokens=6"])


def _deployed(w) -> dict:
    """Every tensor an evaluation engine loaded (trace.rollout.weights.EngineWeights), cloned."""
    out = {"embed": w.embed, "norm": w.norm, "lm_head": w.lm_head, "inv_freq": w.inv_freq}
    out.update({f"{i}.{k}": t for i, lw in enumerate(w.layers) for k, t in lw.items()})
    out.update({f"{n}.codes": q.codes for n, q in w.fp4.items()})
    return {k: t.clone() for k, t in out.items()}


def test_zero3_evaluation_equals_the_whole_model_gather(gloo, monkeypatch):
    from trace import episode

    loaded = []
    sync = episode.RolloutEngine.sync_weights

    def spy(self, *a, **k):  # what each evaluation deploys
        sync(self, *a, **k)
        loaded.append(_deployed(self.weights))

    monkeypatch.setattr(episode.RolloutEngine, "sync_weights", spy)
    cfg = _eval_cfg()
    tr = actor.TraceReplay(cfg)
    model = build_model("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    actor.prepare_for_qat(model, tr.arm.trainer_mode, cfg["rl"]["fmt"], zero_stage=3)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    assert all(p.numel() == 0 for p in model.parameters())  # every parameter partitioned and released
    tok = build_tokenizer()
    pol = object.__new__(actor.TracePolicyActor)
    pol._trace_cfg, pol._trace, pol.tokenizer = cfg, tr, tok
    pol.actor = SimpleNamespace(model=eng)
    pol.strategy = SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(zero_stage=3)))
    got = pol._trace_evaluate()
    assert all(p.numel() == 0 for p in model.parameters())  # released again
    # the path it replaces: every parameter gathered at once on every rank, evaluate_policy on the model
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None), torch.no_grad():
        model.eval()
        want = evaluate_policy(model, cfg, build_task(cfg), tok, mode=tr.arm.deploy)
    assert got.pop("tokens_per_s") > 0 and want.pop("tokens_per_s") > 0  # timing, not a result
    assert got == want and got["n"] == 12
    # the same weights deployed, bit for bit (FP4 codes of the trace arm's deployment included)
    new, old = loaded
    assert new.keys() == old.keys() and any(k.endswith(".codes") for k in new)
    assert [k for k in new if not torch.equal(new[k], old[k])] == []


@pytest.mark.parametrize("offload,builder,own", [(False, "FusedAdamBuilder", "FusedAdam"),
                                                 (True, "CPUAdamBuilder", "DeepSpeedCPUAdam")])
@pytest.mark.parametrize("builds", [True, False])
def test_torch_adam_only_where_deepspeeds_adam_cannot_build(monkeypatch, offload, builder, own, builds):
    asked = []
    monkeypatch.setattr(actor, "adam_op_builds", lambda b: asked.append(b) or (builds, "probe says so"))
    conf = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu" if offload else "none"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.95], "eps": 1e-8}}}
    line = actor.choose_optimizer(conf)
    assert asked == [builder] and own in line and "probe says so" in line
    params = conf["optimizer"]["params"]
    assert params.get("torch_adam", False) is (not builds)
    assert {k: v for k, v in params.items() if k != "torch_adam"} == {"lr": 1e-6, "betas": [0.9, 0.95], "eps": 1e-8}
    assert actor.choose_optimizer({"zero_optimization": {"stage": 3}}) is None  # a model-loading config: no optimizer


def test_probe_says_not_here_for_an_op_that_fails_to_load(monkeypatch):
    import deepspeed.ops.op_builder as op_builder

    class Broken:
        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            raise RuntimeError("Error building extension 'fused_adam'")

    monkeypatch.setattr(op_builder, "BrokenAdamBuilder", Broken, raising=False)
    ok, why = actor.adam_op_builds("BrokenAdamBuilder")
    assert not ok and "Error building extension" in why
    conf = {"optimizer": {"type": "AdamW", "params": {}}}
    monkeypatch.setattr(actor, "ADAM_OPS", {False: ("BrokenAdamBuilder", "FusedAdam"),
                                            True: ("BrokenAdamBuilder", "DeepSpeedCPUAdam")})
    assert "torch_adam" in actor.choose_optimizer(conf) and conf["optimizer"]["params"]["torch_adam"] is True
