# Tables and figures from the logged runs. `snakemake figures` rebuilds both from whatever is under
# results/ (committed or freshly run) without training anything: a rule with no outputs always runs
# and depends on no training job.
# The tables and figures are committed files, so their rules flag them update(): Snakemake neither
# deletes them before the job nor after a failed one; it backs them up and restores them when the job
# fails (figures/style.py also writes each figure through a temporary file).


def write_manifest(path: str) -> None:
    """The profile's model x task x arm x seed list, rewritten only when it changed (a profile that
    gains an arm must not be tabulated from the old list)."""
    text = json.dumps(PLAN.manifest(), sort_keys=True, indent=1) + "\n"
    if os.path.exists(path) and open(path).read() == text:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


rule manifest:
    """The list of runs the tables must cover (the profile's model x task x arm x seed)."""
    output:
        update(MANIFEST),
    params:
        m=lambda wc: json.dumps(PLAN.manifest(), sort_keys=True),
    run:
        write_manifest(output[0])


def _learning_cmd(strict: bool) -> str:
    if not LEARNING:
        return ""
    return (f" && python -m analysis.learning --runs {RUNS} --out {TABLES} --arm {LEARNING['arm']}"
            f" --min-se {LEARNING.get('min_se', 3)}" + (f" --manifest {MANIFEST} --strict" if strict else ""))


rule tables:
    input:
        manifest=MANIFEST,
        done=RUN_DONE,
        evals=RUN_EVAL,
        base=BASE_EVAL,
    output:
        [update(f) for f in TABLE_FILES],
    log:
        f"{LOGS}/tables.log",
    params:
        # enforced unless the profile says enforce: false: the run fails unless the checked arm's
        # held-out accuracy rises by min_se SEs
        learning=_learning_cmd(strict=bool(LEARNING.get("enforce", True)) if LEARNING else False),
    threads: 1
    shell:
        "(" + ENV + " python -m analysis.tables --runs {RUNS} --manifest {input.manifest} --out {TABLES}"
        " --strict {params.learning} && python -m analysis.gputime --runs {RUNS} --out {TABLES}"
        " && python -m analysis.compare --runs {RUNS} --manifest {input.manifest} --out {TABLES}"
        " && python -m analysis.report --tables {TABLES} --figures {FIGS}) > {log} 2>&1"


# The RL-step figure (figures/gpu/rlstep.png/pdf: benchmarks/bench_rlstep.py's table, step time by phase and arm)
# belongs to no profile; both figure rules redraw it, and it is written only once the table has a GPU row
# (figures/plot_rlstep.py), so it is no declared output and its table no input.
RLSTEP_FIGURE = " && python -m figures.plot_rlstep --csv results/rlstep/rlstep.csv --out figures/gpu"


rule plot:
    input:
        TABLE_FILES,
        BENCH_STATUS,
        manifest=MANIFEST,
    output:
        [update(f) for f in FIGURE_FILES],
    log:
        f"{LOGS}/figures.log",
    threads: 1
    shell:
        "(" + ENV + " python -m figures.plot_all --runs {RUNS} --manifest {input.manifest} --tables {TABLES}"
        " --kernels results/kernels --rollout results/rollout --out {FIGS}" + RLSTEP_FIGURE + ") > {log} 2>&1"


rule figures:
    """Rebuild tables and figures of the loaded profile from results/ (no training, no GPU); the
    manifest first, from the profile as it is now."""
    threads: 1
    run:
        write_manifest(MANIFEST)
        shell(ENV + " python -m analysis.tables --runs {RUNS} --out {TABLES}" + _learning_cmd(strict=False) +
        " && python -m analysis.gputime --runs {RUNS} --out {TABLES}"
        " && python -m analysis.compare --runs {RUNS} --out {TABLES}"
        " && python -m analysis.report --tables {TABLES} --figures {FIGS}"
        " && python -m figures.plot_all --runs {RUNS} --tables {TABLES}"
        " --kernels results/kernels --rollout results/rollout --out {FIGS}" + RLSTEP_FIGURE)
