#!/usr/bin/env bash
# The main job (README): set up .venv on a fresh machine and start the web calculator
# (`streamlit run app.py`, http://localhost:8501; PORT=... to change the port).
# With arguments, run the command-line calculator instead: `bash scripts/run.sh ARGS...` is
# `python -m calc ARGS...`, e.g. `bash scripts/run.sh --card llama-3.1-8b --task infer`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh

# torch and transformers too ("verify"): every model that is not llama, mistral, qwen2, qwen3 or
# gpt2 (Gemma, Phi, Mixtral, DeepSeek, ...), and sampling, beams or torch.compile on any, are
# estimated by recording transformers' own code; without them those say what to install.
if [[ $# -gt 0 ]]; then
    ensure_venv "verify"
    exec python -m calc "$@"
fi
ensure_venv "verify,app"
echo "==> vramplan web calculator on http://localhost:${PORT:-8501} (Ctrl-C stops it)" >&2
exec python -m streamlit run app.py --server.port "${PORT:-8501}"
