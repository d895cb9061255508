"""SFT warm start: data/mask construction, resume determinism, and a base policy with non-trivial
(but improvable) accuracy on easy arithmetic."""
from __future__ import annotations

import warnings

import pytest
import torch

from trace import config as C
from trace import rundir
from trace.episode import build_task, encode_prompt
from trace.sft import lr_at, pad_batch, run_sft, sft_examples


def _cfg(extra=()):
    return C.load_config(None, ["wandb.mode=disabled", "threads=2", "task.n_train=256", "task.n_test=32",
                                "sft.batch_size=16", "sft.log_every=5", *extra])


def test_examples_and_masks():
    from trace.models import build_tokenizer
    tok = build_tokenizer()
    for name in ("reasoning", "long_horizon", "coding"):
        cfg = _cfg([f"task.name={name}"])
        task = build_task(cfg)
        exs = task.make_split("train", 4, 0)
        for (ids, mask), ex in zip(sft_examples(task, tok, exs), exs, strict=True):
            p = encode_prompt(tok, ex.prompt)
            assert ids[: len(p)] == p and ids[0] == tok.bos_token_id
            assert not any(mask[: len(p)])
            target, cmask = task.sft_target_and_mask(ex)
            assert tok.decode(ids[len(p):]) == target and mask[len(p):] == list(cmask)
            if name == "long_horizon":
                assert not all(cmask)  # environment text is masked
    ids, lm, att = pad_batch([[1, 2, 3], [1, 2]], [[False, True, True], [False, True]], 0)
    assert ids.tolist() == [[1, 2, 3], [1, 2, 0]] and att.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert lm.tolist() == [[False, True, True], [False, True, False]]
    assert lr_at(0, 100, 10, 1.0) == pytest.approx(0.1) and lr_at(100, 100, 10, 1.0) == pytest.approx(0.1)


def test_sft_crash_and_resume_matches_uninterrupted(tmp_path, monkeypatch):
    """A crash during step 7 (checkpoint at 5, steps 1-6 logged); the restarted run drops step 6 from
    the log, resumes from step 5 and ends with exactly the metrics of an uninterrupted run."""
    import trace.sft as S
    cfg = _cfg(["sft.steps=10", "sft.ckpt_every=5", "sft.log_every=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_sft(cfg, tmp_path / "a", progress=False)
        calls = {"n": 0}
        orig = S.sft_loss

        def crashing(*a, **k):
            calls["n"] += 1
            if calls["n"] == 7:
                raise KeyboardInterrupt("simulated crash")
            return orig(*a, **k)

        monkeypatch.setattr(S, "sft_loss", crashing)
        with pytest.raises(rundir.Interrupted) as e:  # Ctrl-C: the step it stopped in, the step a rerun resumes from
            run_sft(cfg, tmp_path / "b", progress=False)
        assert (e.value.step, e.value.resume_step) == (7, 6)  # checkpoint at step 5
        assert str(e.value) == "interrupted at step 7; rerun the same command to resume from step 6"
        assert [r["step"] for r in rundir.read_metrics(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
        assert not (tmp_path / "b" / "done").exists()
        monkeypatch.setattr(S, "sft_loss", orig)
        run_sft(cfg, tmp_path / "b", progress=False)
    a = rundir.read_metrics(tmp_path / "a" / "metrics.jsonl")
    b = rundir.read_metrics(tmp_path / "b" / "metrics.jsonl")
    strip = lambda rs: [{k: v for k, v in r.items() if k != "time_step_s"} for r in rs]  # noqa: E731
    assert [r["step"] for r in b] == list(range(1, 11))
    assert strip(a) == strip(b)
    import json
    assert json.loads((tmp_path / "b" / "meta.json").read_text())["sft_determinism"] == "none"  # the CPU's
    from safetensors.torch import load_file
    wa = load_file(str(rundir.latest_checkpoint(tmp_path / "a") / "model.safetensors"))
    wb = load_file(str(rundir.latest_checkpoint(tmp_path / "b") / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_sft_gives_nontrivial_base_policy(tmp_path):
    """200 steps (~1 min on 2 cores): the base policy solves a fair share of the held-out easy
    arithmetic, and clearly not all of it (room for RL)."""
    from trace.eval import evaluate_checkpoint
    cfg = C.load_config(None, ["wandb.mode=disabled", "threads=2", "task.n_train=512", "task.n_test=64",
                               "sft.steps=200", "sft.ckpt_every=200", "sft.log_every=50",
                               "eval.samples_per_prompt=8", "rl.max_new_tokens=6"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_sft(cfg, tmp_path / "sft", progress=False)
        res = evaluate_checkpoint(cfg, tmp_path / "sft", modes=["bf16"])
    acc = res["bf16"]["accuracy"]
    assert 0.1 < acc < 0.9, acc
    # a random-init model of the same family scores ~0 on the same prompts
    from trace.episode import evaluate_policy
    from trace.models import build_model, build_tokenizer
    base = evaluate_policy(build_model("qwen3_moe-tiny", seed=0), cfg, build_task(cfg), build_tokenizer(), "bf16")
    assert base["accuracy"] < 0.05 and acc > base["accuracy"] + 0.1
    torch.manual_seed(0)


def test_sft_determinism_modes(monkeypatch):
    """The GPU trains in the strict mode unless told to train as an earlier base did; the CPU as every
    committed CPU base; a rebuild reads the mode from the base's meta.json, older keys included; the
    context restores PyTorch's global determinism setting."""
    from trace.sft import determinism, rebuild_determinism, sft_determinism
    monkeypatch.delenv("TRACE_SFT_DETERMINISM", raising=False)
    assert sft_determinism("cpu") == "none" and sft_determinism("cuda") == "strict" and sft_determinism("cuda:1") == "strict"
    monkeypatch.setenv("TRACE_SFT_DETERMINISM", "math")
    assert sft_determinism("cuda") == "math" and sft_determinism("cpu") == "none"
    monkeypatch.setenv("TRACE_SFT_DETERMINISM", "flash")
    with pytest.raises(C.ConfigError, match="TRACE_SFT_DETERMINISM"):
        sft_determinism("cuda")
    assert rebuild_determinism({"sft_determinism": "strict"}) == "strict"
    assert rebuild_determinism({"sft_attention": "math"}) == "math"  # the key before
    assert rebuild_determinism({"sft_attention": "auto"}) == "none" and rebuild_determinism({}) == "none"
    assert not torch.are_deterministic_algorithms_enabled()
    with determinism("strict"):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sft_gpu_step_repeats_bit_for_bit(tmp_path):
    """Two SFT runs of one config, each in a fresh process as a checkpoint rebuild is, log the same losses
    bit for bit on the GPU, and meta.json says the strict mode ran. mixtral-small on long-horizon at the small
    profile's batch: there the "math" mode's two processes parted at step 4 on an H200
    (scripts/gpu/sft_determinism_probe.sh), and a process that has made a cuBLAS handle before would not take the strict mode's workspace."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cfg = _cfg(["device=cuda", "model=mixtral-small", "task.name=long_horizon", "task.difficulty=easy",
                "task.n_train=2048", "sft.batch_size=64", "sft.steps=16", "sft.log_every=1", "sft.eval_every=0"])
    (tmp_path / "cfg.yaml").write_text(C.dump_config(cfg))
    # the root first, then what the caller had (scripts/gpu/offline_wheels.sh installs into /tmp/site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "TQDM_DISABLE": "1"}
    env.pop("TRACE_SFT_DETERMINISM", None)
    for name in ("a", "b"):
        r = subprocess.run([sys.executable, str(root / "trace" / "sft.py"), "--config", str(tmp_path / "cfg.yaml"),
                            "--out", str(tmp_path / name)], cwd=root, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    loss = lambda d: [r["loss"] for r in rundir.read_metrics(tmp_path / d / "metrics.jsonl")]  # noqa: E731
    assert len(loss("a")) == 16 and loss("a") == loss("b")
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["sft_determinism"] == "strict"
