#!/usr/bin/env bash
# The first GPU run (issue 14), one command: on a machine with an NVIDIA GPU,
#   bash scripts/gpu_check.sh            # about 8 minutes at most
#   bash scripts/gpu_check.sh --dry-run  # print the commands only (no GPU needed)
# runs the most informative single-process verify cases (verify/gpu_check.py: SDPA kernels with
# and without dropout, eager, every precision recipe, 8-bit Adam, NF4, KV cache, inference)
# with the default allocator and with expandable segments, records per case the allocated and
# reserved peaks and torch.cuda.mem_get_info, and writes verify/measurements/<gpu>-<date>.json
# (commit it as it is; tests/verify/test_recorded_measurements.py then checks calc against it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${GPU_CHECK_OUT:-/tmp/vramplan-gpu-check}"
LIMIT_S="${GPU_CHECK_LIMIT_S:-230}"  # per allocator setting: two runs stay within 8 minutes
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

run() {
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

CASES="$(PYTHONPATH="$PWD" "$PY" -m verify.gpu_check cases)"
for alloc in default expandable; do
  # verify exits 1 when a case misses its tolerance: the measurement is what we want, keep going
  run timeout "$LIMIT_S" env PYTHONPATH="$PWD" "$PY" -m verify --device cuda --cases "$CASES" \
    --cuda-alloc "$alloc" --no-progress --out "$OUT/$alloc" || true
done
if [ "$DRY" = 1 ]; then
  echo "+ $PY -m verify.gpu_check merge $OUT/default/report.json $OUT/expandable/report.json \"<nvidia-smi name, driver, total>\" verify/measurements"
  exit 0
fi
SMI="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
PYTHONPATH="$PWD" "$PY" -m verify.gpu_check merge "$OUT/default/report.json" \
  "$OUT/expandable/report.json" "$SMI" verify/measurements
