"""The run config's wandb section, the HF checkpoints and the user's reward file on the OpenRLHF path.

- wandb: `wandb: {mode: offline}` reaches OpenRLHF's parsed args as its --logger.wandb.* flags (a dry run), and
  OpenRLHF's own WandbLogger, built from those args in the environment launch gives its trainer actor, writes an
  offline run under the run dir; a key after `--` is refused (wandb reads it from the environment), and so is
  online mode without credentials;
- checkpoints: `prune_hf_checkpoints` keeps the newest --ckpt.max_num `global_stepN_hf` directories;
- reward: `-- --reward.remote_url FILE.py` reaches OpenRLHF's args as an absolute path and meta.json as its path and
  sha256 (a resumed run with other bytes refused), and OpenRLHF's single-turn executor in our engine then rewards
  with the user's function instead of the verifier; a missing file, a file without reward_func, a non-URL and a
  multi-turn task are refused in one line;
- (slow) one 4-step CPU run with all three: an offline wandb run, one HF checkpoint left, the user's reward logged.
"""
import asyncio
import contextlib
import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from trace.integrations.openrlhf import flags as F
from trace.integrations.openrlhf import launch
from trace.integrations.openrlhf.checkpoints import hf_checkpoints, prune_hf_checkpoints

ROOT = Path(__file__).resolve().parents[3]
CFG = ("model: qwen3_moe-tiny\ntask: {name: reasoning, n_train: 32}\n"
       "rl: {method: bf16, steps: 2, prompts_per_step: 2, group_size: 2, init_ckpt: null}\n")
CONST = 0.7  # a mean of four 0/1 verifier rewards is never 0.7
REWARD_SRC = f'''import torch


def reward_func(queries, prompts, labels):
    r = torch.full((len(queries),), {CONST})
    return {{"rewards": r, "scores": r, "extra_logs": {{}}}}
'''


def _dry(tmp_path, cfg_text, *args):
    """(exit status, OpenRLHF's parsed args, the command, stderr) of a dry run."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(cfg_text)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = launch.main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--gpus", "0", "--dry-run",
                          *map(str, args)])
    assert not (tmp_path / "o").exists()
    if rc:
        err = stderr.getvalue().strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), stderr.getvalue()
        return rc, None, None, err[0]
    printed = json.loads(stdout.getvalue())
    return rc, printed["args"], printed["command"], ""


# ---------------------------------------------------------------------------------------------------- wandb
def test_wandb_section_reaches_openrlhfs_logger_args(tmp_path):
    _, args, _, _ = _dry(tmp_path / "a", CFG)
    assert args["logger.wandb.key"] is None  # wandb.mode disabled (the config default): no logger
    _, args, _, _ = _dry(tmp_path / "b", CFG + "wandb: {mode: offline, project: proj, name: arm-seed0}\n")
    assert args["logger.wandb.key"] == F.WANDB_KEY_SWITCH
    assert args["logger.wandb.project"] == "proj" and args["logger.wandb.run_name"] == "arm-seed0"
    _, args, _, _ = _dry(tmp_path / "c", CFG + "wandb: {mode: offline}\n")
    assert args["logger.wandb.run_name"] == "o"  # the run dir's name, as the embedded trainer's
    rc, _, _, err = _dry(tmp_path / "d", CFG + "wandb: {mode: offline}\n", "--", "--logger.wandb.key", "abc")
    assert rc == 2 and "--logger.wandb.key is fixed by TRACE" in err and "WANDB_API_KEY" in err
    rc, _, _, err = _dry(tmp_path / "f", CFG, "--", "--logger.wandb.key", "abc")  # wandb off: refused too
    assert rc == 2 and "--logger.wandb.key is fixed by TRACE" in err
    rc, _, _, err = _dry(tmp_path / "e", CFG + "wandb: {mode: offline}\n", "--", "--logger.wandb.project", "x")
    assert rc == 2 and "from wandb.project" in err


def test_online_wandb_needs_credentials(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    rc, _, _, err = _dry(tmp_path / "a", CFG + "wandb: {mode: online}\n")
    assert rc == 2 and "wandb.mode online needs W&B credentials" in err
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    rc, args, _, _ = _dry(tmp_path / "b", CFG + "wandb: {mode: online}\n")
    assert rc == 0 and args["logger.wandb.key"] == F.WANDB_KEY_SWITCH  # the key itself never enters the command


def test_openrlhfs_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    """OpenRLHF's WandbLogger (what its PPOTrainer actor builds when --logger.wandb.key is set) with the parsed
    args of a dry run and the environment launch gives the Ray workers (flags.wandb_env): no network, no key."""
    pytest.importorskip("wandb")
    from trace import config as C

    cfg = C.load_config(None, ["model=qwen3_moe-tiny", "wandb.mode=offline"])
    out = tmp_path / "run"
    out.mkdir()
    argv = F.ppo_flags(cfg, model_path="m", prompts="p.jsonl", out=str(out), reward_file="reward.py")
    args = launch.parse_with_openrlhf(argv)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    env = F.wandb_env(cfg, str(out))
    assert env["WANDB_MODE"] == "offline" and env["WANDB_DIR"] == str(out.resolve())
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # a fresh process, as a Ray worker is: wandb keeps its settings from the first setup in a process
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    code = ("import pickle, sys\nfrom openrlhf.utils.logging_utils import WandbLogger\n"
            "logger = WandbLogger(pickle.loads(open(sys.argv[1], 'rb').read()))\n"
            "logger.log_train(1, {'reward': 0.5})\nlogger.close()\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "args.pkl")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(env["WANDB_RUN_ID"]), runs


# ------------------------------------------------------------------------------------------------ checkpoints
def test_prune_keeps_the_newest_hf_checkpoints(tmp_path):
    for step in (1, 2, 3, 10):
        (tmp_path / f"global_step{step}_hf").mkdir()
    (tmp_path / "_actor").mkdir()
    (tmp_path / "best_global_step2_hf").mkdir()
    assert prune_hf_checkpoints(tmp_path, 2) == [tmp_path / "global_step1_hf", tmp_path / "global_step2_hf"]
    assert [p.name for p in hf_checkpoints(tmp_path)] == ["global_step3_hf", "global_step10_hf"]  # by step number
    prune_hf_checkpoints(tmp_path, 0)  # OpenRLHF keeps the checkpoint it just saved even then
    assert [p.name for p in hf_checkpoints(tmp_path)] == ["global_step10_hf"]
    assert (tmp_path / "_actor").is_dir() and (tmp_path / "best_global_step2_hf").is_dir()
    assert prune_hf_checkpoints(tmp_path / "none", 1) == []


# ----------------------------------------------------------------------------------------------------- reward
def test_user_reward_file_reaches_openrlhf(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text(REWARD_SRC)
    _, args, _, _ = _dry(tmp_path / "a", CFG)
    assert args["reward.remote_url"] == [str(launch.REWARD_FILE)]  # the default: the task's verifier
    monkeypatch.chdir(tmp_path)
    _, args, cmd, _ = _dry(tmp_path / "b", CFG, "--", "--reward.remote_url", "r.py")
    assert args["reward.remote_url"] == [str(tmp_path / "r.py")] and cmd.count("--reward.remote_url") == 1
    _, args, _, _ = _dry(tmp_path / "c", CFG, "--", "--reward.remote_url=http://rm:5000/get_reward,http://rm2:5000/x")
    assert args["reward.remote_url"] == ["http://rm:5000/get_reward", "http://rm2:5000/x"]


def test_user_reward_file_recorded_in_meta(tmp_path, monkeypatch, capsys):
    """A run with the user's reward file records its path and sha256 in meta.json; a resumed run whose file changed
    is refused in one line; a run on the verifier (or a reward server) records none. OpenRLHF is not run: a stub
    leaves the metrics log a run would."""
    monkeypatch.setattr(launch, "run_openrlhf", lambda cfg, argv, out, *a, **k: (out / "metrics.jsonl").write_text(""))
    monkeypatch.setattr(launch, "finish", lambda cfg, out: None)
    (tmp_path / "c.yaml").write_text(CFG)
    (tmp_path / "r.py").write_text(REWARD_SRC)
    monkeypatch.chdir(tmp_path)

    def run(out, *flags):
        with contextlib.redirect_stdout(io.StringIO()):
            return launch.main(["--config", "c.yaml", "--out", str(out), "--gpus", "0", "--", *flags])

    assert run(tmp_path / "a", "--reward.remote_url", "r.py") == 0
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["reward_file"] == {"path": str(tmp_path / "r.py"),
                                   "sha256": hashlib.sha256(REWARD_SRC.encode()).hexdigest()}
    assert run(tmp_path / "a", "--reward.remote_url", "r.py") == 0  # resumed with the same file
    capsys.readouterr()
    (tmp_path / "r.py").write_text(REWARD_SRC.replace(str(CONST), "0.5"))
    assert run(tmp_path / "a", "--reward.remote_url", "r.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "reward_file" in err[-1], err
    for out, flags in ((tmp_path / "b", ()), (tmp_path / "c", ("--reward.remote_url", "http://rm:5000/get_reward"))):
        assert run(out, *flags) == 0
        assert "reward_file" not in json.loads((out / "meta.json").read_text())


@pytest.mark.parametrize("value,src,needle", [
    ("missing.py", None, "missing.py: no such file"),
    ("r.py", "def score(queries):\n    return 0\n", "defines no reward_func(queries, prompts, labels)"),
    ("r.py", "def reward_func(:\n", "not valid Python"),
    ("rm.example:5000", None, "neither a Python reward file (*.py) nor an http(s) URL"),
    ("r.py,http://rm:5000", "def reward_func(q, p, l):\n    pass\n", "one reward file (*.py) or reward server URLs"),
])
def test_bad_reward_refused(tmp_path, monkeypatch, value, src, needle):
    if src is not None:
        (tmp_path / "r.py").write_text(src)
    monkeypatch.chdir(tmp_path)
    rc, _, _, err = _dry(tmp_path / "a", CFG, "--", "--reward.remote_url", value)
    assert rc == 2 and needle in err, err


def test_multi_turn_task_refuses_a_reward_file(tmp_path):
    (tmp_path / "r.py").write_text(REWARD_SRC)
    rc, _, _, err = _dry(tmp_path, CFG.replace("name: reasoning", "name: long_horizon"),
                         "--", "--reward.remote_url", tmp_path / "r.py")
    assert rc == 2 and "multi-turn task is rewarded by its environment" in err


def test_user_reward_replaces_the_verifier_in_the_engine(tmp_path):
    """Our engine runs OpenRLHF's single-turn executor: with the user's file it rewards every sample CONST."""
    from trace import config as C
    from trace.integrations.openrlhf import stand_ins
    from trace.integrations.openrlhf.rollout import TraceRolloutEngine
    from trace.models import build_model, build_tokenizer, save_checkpoint
    from trace.tasks import get_task

    stand_ins.install()
    from vllm import SamplingParams  # the stand-in without vLLM

    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), tmp_path / "m")
    (tmp_path / "r.py").write_text(REWARD_SRC)
    cfg = C.load_config(None, ["model=qwen3_moe-tiny", "task.name=reasoning", "rl.method=bf16", "rl.max_new_tokens=4"])
    ex = get_task("reasoning", difficulty="easy").make_split("train", 1, 0)[0]
    for url, want in ((str(tmp_path / "r.py"), CONST), (str(launch.REWARD_FILE), None)):
        eng = TraceRolloutEngine(str(tmp_path / "m"), cfg, seed=1, remote_rm_url=[url])
        out = asyncio.run(eng.generate_responses(ex.prompt, ex.label, SamplingParams(max_tokens=4, logprobs=1), 64,
                                                 eng.tok, num_samples=2))
        rewards = [float(r["reward"]) for r in out]
        assert all(r == pytest.approx(CONST) for r in rewards) if want else all(r in (0.0, 1.0) for r in rewards)


# --------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_cpu_run_with_wandb_hf_pruning_and_user_reward(tmp_path, tiny_rl_config):
    """train_ppo_ray on the CPU, 4 steps with a checkpoint each and --ckpt.max_num 1, wandb offline, the user's
    reward file: one HF checkpoint is left (the last), every step's logged reward is the file's, and OpenRLHF's
    logger wrote an offline wandb run into the run dir. About 3 minutes on 2 shared cores."""
    cfg = tiny_rl_config(4, ckpt_every=1, method="bf16")
    cfg.write_text(cfg.read_text() + "wandb: {mode: offline}\n")
    (tmp_path / "r.py").write_text(REWARD_SRC)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("WANDB_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "trace.integrations.openrlhf.launch", "--config", str(cfg),
                        "--out", str(out), "--gpus", "0", "--", "--ckpt.max_num", "1",
                        "--reward.remote_url", str(tmp_path / "r.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["reward_mean"] == pytest.approx(CONST) for x in lines), [x["reward_mean"] for x in lines]
    root = out / "ckpt" / "deepspeed"
    assert [p.name for p in hf_checkpoints(root)] == ["global_step4_hf"]
    assert len([p for p in (root / "_actor").iterdir() if p.is_dir()]) == 1  # OpenRLHF's own rotation
    assert (out / "done").exists() and (out / "ckpt" / "latest").read_text().strip() == "step_000004"
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    assert json.loads((out / "meta.json").read_text())["reward_file"]["path"] == str(tmp_path / "r.py")
