#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv on a fresh machine (and the Debian chromium
# package the web app's end-to-end test drives), then lint, format-check, type-check calc/, run the quick
# measurement check and the unit tests. Every step runs even when an earlier one
# fails, so one run shows every failure; the exit status is non-zero if any step failed.
# pytest runs last so that its summary line closes the output, on two worker processes
# (pytest-xdist; CI has two cores): VRAMPLAN_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh
source scripts/chromium.sh
ensure_venv "verify,dev,app,e2e"
ensure_chromium || echo "==> chromium install failed: the end-to-end test will fail" >&2

failed=()
step() {
    echo "==> $*" >&2
    "$@" || failed+=("$*")
}

step ruff check .
step ruff format --check .
step mypy
step python -m verify --quick --no-progress --out verify/reports/quick
step pytest -q -n "${VRAMPLAN_TEST_WORKERS:-2}"

if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
