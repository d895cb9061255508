# Speed benchmarks (kernels, rollout engine). They run only on a CUDA machine (bench.mode auto|force);
# on a CPU-only machine they print a clear skip message and the committed CSVs under results/kernels/
# and results/rollout/ are used by the tables and figures. The status JSON records which happened.


rule bench:
    output:
        f"results/bench/{PROFILE}/{{what}}.json",
    wildcard_constraints:
        what="kernels|rollout",
    log:
        f"{LOGS}/bench/{{what}}.log",
    params:
        mode=BENCH.get("mode", "auto"),
        cmd=lambda wc: BENCH.get(f"{wc.what}_cmd", f"python benchmarks/bench_{wc.what}.py"),
    threads: 1
    resources:
        # holds the GPU alone when there is one, so RL jobs do not disturb the timings
        gpu=0 if BENCH.get("mode", "auto") == "skip" else 1,
    shell:
        ENV + " python -m workflow.scripts.bench --what {wildcards.what} --mode {params.mode}"
        " --cmd '{params.cmd}' --csv-dir results/{wildcards.what} --status {output} 2>&1 | tee {log}"
