#!/usr/bin/env bash
# CI's install smoke (called by .ci/run, in the checkout's root): `make smoke` on each other supported Python.
# It cannot be skipped by accident: a Python that is missing, or a disk without the room for its environment, FAILS
# the run (exit 1, one line saying what is missing and what to do), so a green CI run has run the smoke. A machine
# that cannot run it says so with the environment variable WAPSTABLE_CI_NO_SMOKE=1 (set where its CI job is
# defined); the smoke is then skipped, loudly.
set -euo pipefail
NEED_GB=12 # a fresh environment holds torch and its CUDA libraries: about 6 GB, more while pip unpacks

if [[ "${WAPSTABLE_CI_NO_SMOKE:-}" == 1 ]]; then
    echo "SKIPPED: WAPSTABLE_CI_NO_SMOKE=1 marks this machine as unable to run the install smoke (Python 3.12, 3.13)" >&2
    exit 0
fi
mark="or mark this machine with WAPSTABLE_CI_NO_SMOKE=1 if it cannot run the smoke"
for version in 3.12 3.13; do
    (
        # pyenv's shims need the version named; elsewhere python3.12 / python3.13 are on PATH as they are
        if command -v pyenv > /dev/null; then
            PYENV_VERSION=$(pyenv versions --bare | grep -E "^${version//./\\.}(\.[0-9]+)?$" | tail -1 || true)
            export PYENV_VERSION
        fi
        if ! "python$version" -c pass 2> /dev/null; then
            echo "error: no python$version on this machine for the install smoke; install it (pyenv install $version), $mark" >&2
            exit 1
        fi
        free_gb=$(( $(df -Pk . | awk 'NR == 2 {print $4}') / 1048576 ))
        if (( free_gb < NEED_GB )); then
            echo "error: only ${free_gb} GB free on this disk, the install smoke of python$version needs about $NEED_GB; free some, $mark" >&2
            exit 1
        fi
        make smoke PYTHON="python$version"
        # the next Python's environment needs the same room: this one is not kept on a CI machine
        rm -rf ".venv-smoke-$version"
    )
done
