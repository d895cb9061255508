# Sourced by the GPU scripts (`. scripts/gpu/env.sh || exit 1`, from the repository root): installs the wheel folder
# WHEELS (default .whl-pipe: `bash scripts/gpu/offline_wheels.sh download .whl-pipe pipeline` here, carried there)
# into SITE (default /tmp/site; a second install of the same folder is a no-op), prints its bwrap line, and puts the
# repository root and SITE on PYTHONPATH, SITE/bin on PATH. Without the folder only the paths are set (REQUIRE_WHEELS=1
# makes that an error). The install log goes to $OUT/install.log (or /tmp/install.log).
_wheels=${WHEELS:-.whl-pipe}
SITE=${SITE:-/tmp/site}
_log=${OUT:-/tmp}/install.log
if [ -d "$_wheels" ]; then
  SITE=$SITE bash scripts/gpu/offline_wheels.sh install "$_wheels" > "$_log" 2>&1 || { tail -20 "$_log"; return 1; }
  grep '^bwrap' "$_log"
elif [ "${REQUIRE_WHEELS:-0}" = 1 ]; then
  echo "no wheel folder $_wheels" >&2; return 1
fi
export SITE PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1
unset _wheels _log
