#!/usr/bin/env bash
# Install smoke test on another Python: `scripts/install_smoke.sh python3.12` (or `make smoke PYTHON=python3.13`).
# Creates a fresh virtual environment with that interpreter, `pip install .` (not editable: what a user gets), and
# runs the installed `wapstable-train debug=tiny` from outside the checkout; exits non-zero if either fails.
# The environment lives in .venv-smoke-VERSION and is reused by the next run (pip then installs only the project);
# pip keeps no cache of the wheels (torch and its libraries are gigabytes, and a copy in the cache doubles that).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: scripts/install_smoke.sh PYTHON (e.g. python3.12)}
version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv=".venv-smoke-$version"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-cache-dir --upgrade pip
"$venv/bin/python" -m pip install --quiet --no-cache-dir .
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
(cd "$work" && WAPSTABLE_CACHE="$work/cache" "$OLDPWD/$venv/bin/wapstable-train" debug=tiny trainer.progress=false \
    hydra.run.dir="$work/run" > "$work/train.log" 2>&1) || { tail -30 "$work/train.log"; exit 1; }
test -f "$work/run/metrics.json" || { echo "no metrics.json after the run"; exit 1; }
echo "Python $version: pip install . and wapstable-train debug=tiny ok ($(( $(date +%s) - start )) s for the run;" \
    "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
