"""Start-up guards of the OpenRLHF hooks (guards.py): each fires with one line naming the OpenRLHF
symbol when its patch is absent (an upstream rename simulated on the real OpenRLHF modules), the
version guard refuses an untested OpenRLHF, and the vLLM stand-in's version takes OpenRLHF's
current-vLLM path in OpenRLHF's own comparisons."""
import contextlib
import dataclasses
import inspect
import os
import re
import sys
import types
from types import SimpleNamespace

import pytest

from trace.integrations.openrlhf import stand_ins

stand_ins.install()

import openrlhf.trainer.ppo_utils.experience as orl_exp  # noqa: E402
import openrlhf.trainer.ray as orl_ray  # noqa: E402
import openrlhf.trainer.ray.ppo_actor as orl_pa  # noqa: E402
import openrlhf.trainer.ray.vllm_engine as orl_vllm  # noqa: E402

from trace.integrations.openrlhf import actor, guards, launch  # noqa: E402


def _one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_current_openrlhf_passes_every_check():
    launch.check_hooks()


HOOKS, USES = launch.all_hooks()


def test_every_hook_is_in_the_tables():
    """The tables the start-up check walks hold every name launch, the policy actor and the CPU shim
    patch (a new patch must be added there, and then this file simulates its rename)."""
    symbols = {h.symbol for h in HOOKS}
    for name in ("create_vllm_engines", "ppo_actor.PolicyModelActor", "ppo_actor.Actor", "ppo_actor.ActorPPOTrainer",
                 "get_ds_train_config", "training_step", "init_model_from_pretrained", "PolicyModelActor.forward",
                 "PolicyModelActor.fit", "PolicyModelActor.broadcast_to_vllm", "train_ppo_ray.train", "init_device_mesh", "NaiveReplayBuffer",
                 "__compatible_ops__"):
        assert any(name in s for s in symbols), name
    assert {u.name for u in USES} >= {"create_vllm_engines", "PolicyModelActor", "Actor", "ActorPPOTrainer",
                                      "get_ds_train_config", "checkpoint_states", "actor_loss_fn", "mm_train_inputs",
                                      "mm_train_inputs_list", "init_device_mesh"}


@pytest.mark.parametrize("hook", HOOKS, ids=[h.symbol for h in HOOKS])
def test_rename_of_patched_symbol_fails_in_one_line(monkeypatch, hook):
    """An upstream rename of each name TRACE replaces (the attribute deleted on the real OpenRLHF object; a module's
    attribute made on first access by its `__getattr__`, as DeepSpeed's `ops.__compatible_ops__`, no longer made)."""
    monkeypatch.delattr(hook.owner, hook.attr, raising=not isinstance(hook.owner, types.ModuleType))
    if isinstance(hook.owner, types.ModuleType) and "__getattr__" in vars(hook.owner):
        monkeypatch.setattr(hook.owner, "__getattr__", _no_such_attr)
    with pytest.raises(guards.PatchNotInForce) as e:
        launch.check_hooks()
    _one_line(e, hook.symbol, "0.11.2")


def _no_such_attr(name):
    raise AttributeError(name)


def _no_uses(*_a, **_k):
    return None


@pytest.mark.parametrize("use", USES, ids=[f"{u.where}->{u.name}" for u in USES])
def test_code_no_longer_using_patched_symbol_fails(monkeypatch, use):
    """An upstream refactor of the code that should use a patched name (replaced by code that does not)."""
    monkeypatch.setattr(use.owner, use.attr, _no_uses)
    with pytest.raises(guards.PatchNotInForce) as e:
        launch.check_hooks()
    msg = _one_line(e, "no longer uses")
    assert use.symbol in msg or use.where in msg, msg


def test_init_model_no_longer_using_actor_or_ds_config_fails(monkeypatch):
    base = actor._BASE
    monkeypatch.setattr(base, "init_model_from_pretrained", _no_uses)
    with pytest.raises(guards.PatchNotInForce) as e:
        actor.check_hooks()
    _one_line(e, "openrlhf.trainer.ray.ppo_actor.Actor", "init_model_from_pretrained")


def test_experience_without_record_field_fails(monkeypatch):
    @dataclasses.dataclass
    class Experience:  # OpenRLHF's Experience with mm_train_inputs renamed
        sequences: object = None
        mm_inputs: list = dataclasses.field(default_factory=list)

    monkeypatch.setattr(orl_exp, "Experience", Experience)
    with pytest.raises(guards.PatchNotInForce) as e:
        actor.check_hooks()
    _one_line(e, "Experience.mm_train_inputs")


def test_ray_private_class_attribute_missing_fails():
    class NotRemote:
        pass

    with pytest.raises(guards.PatchNotInForce) as e:
        guards.ray_actor_class(NotRemote, "openrlhf.trainer.ray.ppo_actor.PolicyModelActor")
    _one_line(e, "PolicyModelActor.__ray_metadata__")
    meta = SimpleNamespace(__ray_metadata__=SimpleNamespace(modified_class=None))
    with pytest.raises(guards.PatchNotInForce) as e:
        guards.ray_actor_class(meta, "X")
    _one_line(e, "modified_class")


def test_launch_patches_not_in_place_fail(monkeypatch):
    def engines():
        return None

    policy = object()
    monkeypatch.setattr(orl_ray, "create_vllm_engines", engines)
    monkeypatch.setattr(orl_pa, "PolicyModelActor", policy)
    launch.check_patches(engines, policy)
    with pytest.raises(guards.PatchNotInForce) as e:
        launch.check_patches(lambda: None, policy)
    _one_line(e, "openrlhf.trainer.ray.create_vllm_engines", "not in force")
    with pytest.raises(guards.PatchNotInForce) as e:
        launch.check_patches(None, object())
    _one_line(e, "openrlhf.trainer.ray.ppo_actor.PolicyModelActor", "not in force")


def test_init_model_swaps_never_used_fail(monkeypatch):
    """OpenRLHF's init_model_from_pretrained builds its model without our Actor factory."""
    monkeypatch.setattr(actor.plugin, "run_config", lambda: {"rl": {"fmt": "nvfp4"}})
    monkeypatch.setattr(actor, "TraceReplay", lambda cfg: SimpleNamespace(arm=SimpleNamespace(trainer_mode="bf16")))
    monkeypatch.setattr(actor, "check_hooks", lambda: None)  # the static check would see the stand-in below
    seen = {}

    def init(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        seen["ds"] = strategy.get_ds_train_config()
        self.trainer = None

    monkeypatch.setattr(actor._BASE, "init_model_from_pretrained", init)
    strategy = SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(zero_stage=3)), get_ds_train_config=lambda: {})
    pol = object.__new__(actor.TracePolicyActor)
    with pytest.raises(guards.PatchNotInForce) as e:
        pol.init_model_from_pretrained(strategy, "m")
    _one_line(e, "openrlhf.trainer.ray.ppo_actor.Actor", "never called")
    assert seen["ds"] == {} and strategy.get_ds_train_config() == {}  # the strategy is restored


def test_training_step_without_loss_fn_fails(monkeypatch):
    def step(self, experience, kl_ctl, step, loss_batch_info=None):
        return {"policy_loss": 0.0}  # a training step that computes its loss elsewhere

    monkeypatch.setattr(orl_pa.ActorPPOTrainer, "training_step", step)
    tr = object.__new__(actor.TraceActorPPOTrainer)
    tr.trace = SimpleNamespace(context=lambda *a: contextlib.nullcontext(None))
    tr.actor = SimpleNamespace(model=None)
    tr.actor_loss_fn = lambda *a, **k: None
    exp = SimpleNamespace(mm_train_inputs=None, attention_mask=None, info={})
    with pytest.raises(guards.PatchNotInForce) as e:
        tr.training_step(exp, 0.0, 1)
    _one_line(e, "ActorPPOTrainer.actor_loss_fn", "never called")


def test_one_line_unwraps_a_ray_task_error():
    from ray.exceptions import RayTaskError
    cause = guards.PatchNotInForce("TRACE's patch of `X` is not in force;\n  found Y")
    err = RayTaskError("init_model_from_pretrained", "Traceback ...\nmany lines", cause)
    assert guards.one_line(err) == "TRACE's patch of `X` is not in force; found Y"
    assert guards.one_line(ValueError("x")) is None


# ------------------------------------------------------------------------------------------ version
def test_version_guard(monkeypatch):
    monkeypatch.delenv(guards.UNTESTED_OK_ENV, raising=False)
    assert guards.check_openrlhf_version() == "0.11.2"
    assert guards.check_openrlhf_version("0.11.2") == "0.11.2"
    with pytest.raises(guards.UntestedOpenRLHF) as e:
        guards.check_openrlhf_version("0.12.0")
    _one_line(e, "OpenRLHF 0.12.0 is installed", "tested with OpenRLHF 0.11.2", guards.UNTESTED_OK_ENV)
    monkeypatch.setenv(guards.UNTESTED_OK_ENV, "1")
    with pytest.warns(UserWarning, match="0.12.0"):
        assert guards.check_openrlhf_version("0.12.0") == "0.12.0"


def test_launch_refuses_untested_openrlhf(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(guards.UNTESTED_OK_ENV, raising=False)
    monkeypatch.setattr(guards, "openrlhf_version", lambda: "0.12.0")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nrl: {method: trace}\n")
    assert launch.main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--gpus", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: OpenRLHF 0.12.0 is installed"), err
    assert not (tmp_path / "o").exists()


def test_launch_reports_rename_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.delattr(orl_ray, "create_vllm_engines")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nrl: {method: trace}\n")
    assert launch.main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--gpus", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "openrlhf.trainer.ray.create_vllm_engines" in err[0], err


# ------------------------------------------------------------------------------------------ stand-in version
_CMP = re.compile(r'parse\(vllm\.__version__\)\s*(<|<=|>|>=)\s*\w+\.parse\(\s*"([^"]+)"\s*\)')


def test_stand_in_vllm_version_takes_openrlhfs_current_path(monkeypatch):
    """Every comparison of vllm.__version__ in OpenRLHF's PolicyModelActor and vLLM engine, evaluated
    with OpenRLHF's own operands: `<` (old-vLLM workarounds) false, `>`/`>=` (requirements) true."""
    if not stand_ins.is_stand_in("vllm"):
        pytest.skip("a real vLLM is installed")
    from packaging import version
    mine = version.parse(sys.modules["vllm"].__version__)
    found = []
    for mod in (orl_pa, orl_vllm):
        for op, v in _CMP.findall(inspect.getsource(mod)):
            ok = {"<": mine < version.parse(v), "<=": mine <= version.parse(v),
                  ">": mine > version.parse(v), ">=": mine >= version.parse(v)}[op]
            found.append((op, v))
            assert ok is (op in (">", ">=")), f"stand-in vLLM {mine} {op} {v}"
    assert ("<", "0.16") in found  # ppo_actor: NCCL_CUMEM_ENABLE=0 below vLLM 0.16
    # OpenRLHF's own env setup of its engines runs its asserts (> 0.8.5) and the >= 0.9.0 branch
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "unused")  # else it asks the running Ray worker for its address
    inspect.unwrap(orl_vllm.RolloutRayActor._configure_vllm_env)(None, version, sys.modules["vllm"], False)
    assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1"
