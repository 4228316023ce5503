#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv on a fresh machine, then lint, format-check,
# run the quick measurement check and the unit tests. Every step runs even when an earlier one
# fails, so one run shows every failure; the exit status is non-zero if any step failed.
# pytest runs last so that its summary line closes the output.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh
ensure_venv "verify,dev"

failed=()
step() {
    echo "==> $*" >&2
    "$@" || failed+=("$*")
}

step ruff check .
step ruff format --check .
step python -m verify --quick --no-progress --out verify/reports/quick
step pytest -q

if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
