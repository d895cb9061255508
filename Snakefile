"""TRACE replication pipeline: sft -> rl (model x task x method x seed) -> eval -> bench -> tables -> figures.

Run from the repository root (PYTHONPATH is set to it by every rule):
    snakemake all --cores 2                                   # smoke profile (default), CPU, minutes
    snakemake all --cores 8 --resources gpu=1 --configfile experiments/profiles/small.yaml
    snakemake all --profile experiments/profiles/slurm --configfile experiments/profiles/paper.yaml
    snakemake figures --cores 1                               # tables + figures from results/, no training
    snakemake -n all --configfile experiments/profiles/paper.yaml   # dry run, no GPU needed
A --configfile *replaces* the default smoke profile (it is not merged into it); --config key=value
still overrides single keys. The config is validated against workflow/schemas/config.schema.yaml.
Runs land in results/runs/<profile>/<model>/<task>/<arm>/seed<k>/, tables in results/tables/<profile>/,
figures in figures/<profile>/, logs in logs/<profile>/<rule>/.
"""
import os

from snakemake.utils import min_version, validate

from trace.quiet import quiet_startup

quiet_startup()  # Snakemake is not a `python -m trace.<command>`: the run plan's imports are quieted here

min_version("9.0")

if not workflow.overwrite_configfiles:
    configfile: os.path.join(workflow.basedir, "experiments", "profiles", "smoke.yaml")

validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/report.smk"


localrules: all, figures, run_config, sft_config, manifest, tables, plot


rule all:
    # the runs are targets themselves: with committed tables of a partly run profile, Snakemake would
    # otherwise call the tables up to date and never produce their missing inputs
    input:
        RUN_EVAL,
        BASE_EVAL,
        TABLE_FILES,
        FIGURE_FILES,
