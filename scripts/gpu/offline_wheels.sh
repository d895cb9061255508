#!/usr/bin/env bash
# The OpenRLHF stack for a GPU machine without package-registry access (e.g. a node with torch, triton and
# transformers preinstalled, Python 3.12): download here, copy the folder with the working tree, install
# there into a target directory that goes on PYTHONPATH.
#   bash scripts/gpu/offline_wheels.sh download DIR [SET]   # on a machine with pip access (any OS/arch)
#   bash scripts/gpu/offline_wheels.sh install DIR          # on the GPU machine, into $SITE (default /tmp/site);
#                                                           # a second install of the same DIR there is a no-op
#   export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH   # then run as usual
# SET is `openrlhf` (default: scripts/gpu/openrlhf_small.sh), `pipeline` (Snakemake 9.27.1 and its
# dependencies, 13 MB, for `snakemake --configfile experiments/profiles/small.yaml` there, plus bubblewrap's
# .deb for the coding sandbox, unpacked under $SITE, never into /) or `all` (both,
# 51 MB: one package each). Either drops PuLP's bundled CBC solver binaries (16 MB), which only Snakemake's
# ILP scheduler runs: there, run snakemake with `--scheduler greedy` (scripts/gpu/profile_chunk.sh does); the
# repository's own results had grown past what a 64 MiB carry leaves for the untrimmed 28 MB.
# What travels: Ray 2.55.0 without its Java jars, rllib/tune/train/serve/data/llm and the dashboard's web
# build (73.8 MB -> 35 MB; OpenRLHF and the plugin use ray core, ray.util.collective, placement groups and
# queues only), DeepSpeed 0.19.8 as its sdist (built there without isolation against the local torch),
# OpenRLHF 0.11.2 without dependencies, and the packages OpenRLHF and DeepSpeed import that such an image
# lacks (pydantic, hjson, datasets and its pins, torchdata, jsonlines, pylatexenc, jsonschema for our
# configs). Versions are those of requirements-openrlhf.txt. 41 MB in all; on an H200 node (Python 3.12,
# torch 2.11, pyarrow 25) it installed and every import worked (docs/openrlhf.md).
set -euo pipefail
cmd=${1:?usage: offline_wheels.sh download|install DIR}
dir=${2:?usage: offline_wheels.sh download|install DIR}
set_=${3:-openrlhf}
PY_VER=${PY_VER:-3.12}
case $cmd in
download)
  mkdir -p "$dir"
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
  if [ "$set_" = pipeline ] || [ "$set_" = all ]; then  # versions of requirements.txt's snakemake and its needs
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VER" --implementation cp \
      "${plat[@]}" -d "$dir" annotated-types==0.8.0 argparse-dataclass==2.0.0 attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 conda-inject==1.3.2 configargparse==1.9.0 docutils==0.22.4 dpath==2.2.0 fastjsonschema==2.22.3 gitdb==4.0.12 gitpython==3.2.1 greenlet==3.5.6 humanfriendly==10.0 idna==3.20 immutables==0.21 jinja2==3.1.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 jupyter-core==5.9.1 markupsafe==3.0.4 nbformat==5.11.1 packaging==25.0 platformdirs==4.14.8 psutil==7.2.2 pulp==3.3.2 pydantic==2.14.4 pydantic-core==2.50.5 pyyaml==6.0.3 referencing==0.37.0 requests==2.34.2 rpds-py==2026.9.1 smart-open==7.7.1 smmap==5.0.3 snakemake==9.27.1 snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0 snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0 snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1 sqlalchemy==2.0.58 sqlmodel==0.0.37 tabulate==0.10.0 tenacity==9.2.1 throttler==1.2.3 traitlets==5.16.1 typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 wrapt==2.5.2 yte==1.9.4
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$dir" connection-pool==0.0.3  # sdist only
    python3 - "$dir"/pulp-*.whl <<'PY'
import os, sys, zipfile
path = sys.argv[1]
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
    for item in src.infolist():
        if "/solverdir/" not in item.filename:
            dst.writestr(item, src.read(item.filename))
os.replace(tmp, path)
PY
    # bubblewrap, the coding sandbox's kernel boundary (trace/tasks/sandbox.py refuses to run generated code
    # without it): the image has no apt access, so its .deb travels and `install` unpacks it under $SITE
    if command -v apt-get > /dev/null; then
      (cd "$dir" && apt-get download -q bubblewrap > /dev/null 2>&1) || echo "note: apt-get download bubblewrap failed" >&2
    fi
    if [ "$set_" = pipeline ]; then du -sh "$dir"; exit 0; fi
  fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VER" --implementation cp "${plat[@]}" \
    -d "$dir" ray==2.55.0 openrlhf==0.11.2 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 hjson==3.1.0 jsonlines==4.0.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    torchdata==0.11.0 pylatexenc==2.11 fsspec==2026.9.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$dir" deepspeed==0.19.8
  ray_whl=$(ls "$dir"/ray-2.55.0-*.whl)
  python3 - "$ray_whl" <<'PY'
import os, sys, zipfile
path = sys.argv[1]
drop = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/serve/", "ray/data/", "ray/llm/",
        "ray/dashboard/client/build/")
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
    for item in src.infolist():
        if not item.filename.startswith(drop):
            dst.writestr(item, src.read(item.filename))
os.replace(tmp, path)
PY
  du -sh "$dir";;
install)
  site=${SITE:-/tmp/site}
  # a machine that keeps $site between commands: the same set installed once (~60 s) is not installed again
  stamp="$site/.installed-$(ls "$dir" | sha256sum | cut -c1-16)"
  if [ ! -e "$stamp" ]; then
    # one pip call for wheels and sdists (deepspeed, connection-pool): a second `--target --upgrade` call
    # replaces the target's bin/ with its own, which took the snakemake script away
    shopt -s nullglob
    pkgs=("$dir"/*.whl "$dir"/*.tar.gz)
    mkdir -p "$site"
    if [ ${#pkgs[@]} -gt 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target "$site" "${pkgs[@]}"
    fi
    touch "$stamp"
  fi
  # bubblewrap from its .deb (dpkg -x into $site/deb, never into /), linked into $site/bin, which the callers
  # put on PATH; one line says whether it runs a command in fresh namespaces here
  if compgen -G "$dir/bubblewrap_*.deb" > /dev/null && ! command -v bwrap > /dev/null; then
    mkdir -p "$site/deb" "$site/bin"
    dpkg -x "$(compgen -G "$dir/bubblewrap_*.deb" | head -1)" "$site/deb"
    ln -sf "$site/deb/usr/bin/bwrap" "$site/bin/bwrap"
  fi
  bw=$(PATH=$site/bin:$PATH command -v bwrap || true)
  if [ -n "$bw" ] && "$bw" --unshare-pid --unshare-net --unshare-ipc --unshare-uts --ro-bind / / true 2> /dev/null; then
    echo "bwrap: $bw runs (coding rewards sandboxed)"
  else
    echo "bwrap: ${bw:-missing} does not run here; coding rewards refuse unless TRACE_SANDBOX_ALLOW_NO_BOUNDARY=1"
  fi
  # compgen, not [ -e glob ]: under nullglob an empty glob leaves `[ -e ]`, which is true
  if compgen -G "$dir/snakemake-*.whl" > /dev/null; then
    PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import snakemake, jsonschema; print('snakemake', snakemake.__version__)"
  fi
  if compgen -G "$dir/openrlhf-*.whl" > /dev/null; then
    PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import datasets, deepspeed, openrlhf, ray, jsonschema; print('ray', ray.__version__, 'deepspeed', deepspeed.__version__)"
  fi;;
*) echo "usage: offline_wheels.sh download|install DIR" >&2; exit 2;;
esac
