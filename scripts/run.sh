#!/usr/bin/env bash
# The main job (README): set up .venv on a fresh machine and start the web calculator
# (`streamlit run app.py`, http://localhost:8501; PORT=... to change the port).
# With arguments, run the command-line calculator instead: `bash scripts/run.sh ARGS...` is
# `python -m calc ARGS...`, e.g. `bash scripts/run.sh --card llama-3.1-8b --task infer`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh

if [[ $# -gt 0 ]]; then
    ensure_venv ""
    exec python -m calc "$@"
fi
ensure_venv "app"
echo "==> vramplan web calculator on http://localhost:${PORT:-8501} (Ctrl-C stops it)" >&2
exec python -m streamlit run app.py --server.port "${PORT:-8501}"
