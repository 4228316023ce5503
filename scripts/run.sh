#!/usr/bin/env bash
# The main job (README): set up .venv on a fresh machine and run the calculator's CLI on the
# default model card (until the web app exists). Arguments, if any, replace the default ones:
# `bash scripts/run.sh --card llama-3.1-8b --task infer --context 8192`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh
ensure_venv ""

if [[ $# -eq 0 ]]; then
    set -- --card qwen2.5-32b
fi
exec python -m calc "$@"
