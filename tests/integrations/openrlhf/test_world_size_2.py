"""Two actor ranks over gloo (world size 2) on the CPU: what a two-GPU OpenRLHF run of TRACE does, on what the CPUs
allow (world2_rank.py, one process per rank):
- DeepSpeed ZeRO-3 with every parameter partitioned across the two ranks (each holds a shard, about half);
- one training step per rank on its own micro-batch under the arm's replay with its own records: each rank's
  log-probs and alignment term match the unwrapped model's on the same micro-batch, and the gathered gradients match
  the unwrapped model's averaged over both micro-batches (data parallelism's reference) to 2% of their norm;
- the optimizer step, then OpenRLHF's own `ActorPPOTrainer.broadcast_to_vllm`: every parameter gathered by both
  ranks and broadcast by rank 0 over the weight-sync group (gloo) into our rollout engine, which re-quantizes each
  parameter as it arrives (the last one closing the sync) to exactly the FP4 codes of the trainer's updated weights.
Two processes importing DeepSpeed and OpenRLHF: about 10-20 s on 2 cores, hence slow."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
LP_TOL, GRAD_REL_TOL = 1e-3, 2e-2


def _ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
def test_two_ranks_zero3_step_and_broadcast_sync(tmp_path, arm="trace"):
    from trace.models import build_model, build_tokenizer, save_checkpoint

    init = tmp_path / "init"
    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), init)
    port, sync_port = _ports(2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "world2_rank.py"), str(r), str(port), str(sync_port),
                               str(init), str(tmp_path / f"rank{r}.json"), arm], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["world"] == 2
        # every parameter partitioned: each rank holds a shard of about half of it (DeepSpeed pads to the world size)
        assert all(r["shards"][n] == -(-r["full"][n] // 2) for n in r["full"])
        assert r["lp_diff"] < LP_TOL and r["old_diff"] < LP_TOL
        assert r["align"] == pytest.approx(r["ref_align"], rel=1e-3, abs=1e-6) and r["ref_align"] > 0
        assert sorted(r["flips"]) == sorted(r["ref_flips"])
        assert all(abs(r["flips"][i] - r["ref_flips"][i]) < 1e-3 for i in r["flips"])
        assert r["grad_rel"] and max(r["grad_rel"].values()) <= GRAD_REL_TOL, r["grad_rel"]
        assert any(".self_attn." in n for n in r["moved"])
    assert res[0]["moved"] == res[1]["moved"]  # both ranks hold the same updated model
    zero = res[0]
    assert zero["syncs"] == 1  # one sync, closed at the last parameter
    assert zero["engine_codes"] > 0 and len(zero["codes_equal"]) == zero["engine_codes"]
    assert zero["codes_changed"]  # the step moved FP4 codes: the engine holds the updated weights, not its initial ones
    print(f"weight sync over 2 ranks: {zero['sync_s']:.2f} s; max relative gradient difference "
          f"{max(max(r['grad_rel'].values()) for r in res):.2e}")


@pytest.mark.slow
def test_launch_with_two_actor_ranks(tmp_path, tiny_rl_config):
    """`launch --ranks 2` on the CPU: OpenRLHF's actor group of two policy actors (ZeRO-3 over gloo), one engine;
    every step's line says 2 ranks and times the weight sync that fed its rollout. About 30-40 s on 2 cores."""
    from trace import rundir

    cfg = tiny_rl_config(2, n_test=4, method="trace")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "trace.integrations.openrlhf.launch", "--config", str(cfg), "--out",
                        str(out), "--gpus", "0", "--ranks", "2", "--zero-persistence-threshold", "0", "--",
                        "--vllm.num_engines", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "rl-openrlhf" and meta["openrlhf_launch"]["ranks"] == 2
    lines = [r for r in rundir.read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in lines] == [1, 2], lines
    assert all(r["actor_ranks"] == 2 and r["k3"] is not None and r["k3"] >= 0 for r in lines), lines
    assert lines[1]["time_sync_s"] > 0, lines  # step 2's rollout ran on the weights synced after step 1
    assert (out / "done").exists()
