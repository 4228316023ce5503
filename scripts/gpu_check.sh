#!/usr/bin/env bash
# The GPU run (issue 14), one command: on a machine with an NVIDIA GPU,
#   bash scripts/gpu_check.sh            # about 8 minutes at most
#   bash scripts/gpu_check.sh --dry-run  # print the commands only (no GPU needed)
#   bash scripts/gpu_check.sh --set derived  # the second selection: derived architectures and
#                                            # generate, measured only (no prediction there),
#                                            # written as <gpu>-<date>-derived.json
# first reads the memory outside PyTorch (verify/gpu_probe.py: CUDA context, cuBLAS, lazily
# loaded kernels, a one-rank NCCL communicator), then runs the most informative single-process
# verify cases (verify/gpu_check.py: SDPA kernels with and without dropout, eager, every
# precision recipe, 8-bit Adam, NF4, KV cache, inference; then full-size GPT-2 and Qwen2.5-0.5B)
# with the default allocator and with expandable segments, records per case the allocated and
# reserved peaks and torch.cuda.mem_get_info, and writes verify/measurements/<gpu>-<date>.json
# (commit it as it is; tests/verify/test_recorded_measurements.py then checks calc against it).
# Each run has its own time limit and writes its own report, so one slow run loses only itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${GPU_CHECK_OUT:-/tmp/vramplan-gpu-check}"
LIMIT_S="${GPU_CHECK_LIMIT_S:-110}"            # the small cases, per allocator setting
FULL_LIMIT_S="${GPU_CHECK_FULL_LIMIT_S:-130}"  # the full-size cases, per allocator setting
PYPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# torch 2.13 (the pin) shares the cuBLAS workspace with cuBLASLt unless this is set to 0
# (unified_cublas_and_lt_workspaces in CublasHandlePool.cpp); older torch reads the variable
# for the size but not for the pointer, and gives Lt GEMMs (addmm with a bias) their own 1 MiB
# workspace unless it is 1 (measured on torch 2.11: +1 MiB). Set, an older torch on the GPU
# machine measures what 2.13 does by default.
export TORCH_CUBLASLT_UNIFIED_WORKSPACE=1
DRY=0
SET=first
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --set) SET="$2"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--dry-run, --set first|derived)" >&2; exit 2 ;;
  esac
  shift
done
# the first selection predicts on the GPU machine too; the second is measured only (recording
# derived models under that machine's torch would spend its time), calc is compared here
EXTRA=""
SUFFIX=""
if [ "$SET" != first ]; then EXTRA="--measure-only"; SUFFIX="$SET"; fi

run() {
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

# the selection's groups, one per line (the last is the full-size one)
mapfile -t SELECTION < <(PYTHONPATH="$PYPATH" "$PY" -m verify.gpu_check cases --set "$SET" --groups)
mkdir -p "$OUT"
# the probe fails softly: without it the file has no "outside" reading
if [ "$SET" = first ]; then
  run timeout 90 env PYTHONPATH="$PYPATH" "$PY" -m verify.gpu_probe "$OUT/probe.json" || true
fi
DEFAULT_REPORTS=()
EXPANDABLE_REPORTS=()
last=$(( ${#SELECTION[@]} - 1 ))
for i in "${!SELECTION[@]}"; do
  sel="${SELECTION[$i]}" lim="$LIMIT_S"
  [ "$i" = "$last" ] && lim="$FULL_LIMIT_S"
  for alloc in default expandable; do
    # the allocator's setting is in the environment already, so verify measures in this process
    # (no child that a timeout would leave running); it exits 1 when a case misses its
    # tolerance: the measurement is what we want, keep going
    conf=""
    [ "$alloc" = expandable ] && conf="expandable_segments:True"
    run timeout "$lim" env -u PYTORCH_CUDA_ALLOC_CONF ${conf:+PYTORCH_CUDA_ALLOC_CONF=$conf} \
      PYTHONPATH="$PYPATH" "$PY" -m verify --device cuda --cases "$sel" \
      --cuda-alloc "$alloc" --no-progress $EXTRA --out "$OUT/g$i-$alloc" || true
    if [ "$alloc" = default ]; then DEFAULT_REPORTS+=("$OUT/g$i-$alloc/report.json")
    else EXPANDABLE_REPORTS+=("$OUT/g$i-$alloc/report.json"); fi
  done
done
SMI="<nvidia-smi name, driver, total>"
[ "$DRY" = 0 ] && SMI="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
run env PYTHONPATH="$PYPATH" "$PY" -m verify.gpu_check merge "$SMI" verify/measurements \
  --default "${DEFAULT_REPORTS[@]}" --expandable "${EXPANDABLE_REPORTS[@]}" \
  --probe "$OUT/probe.json" ${SUFFIX:+--suffix "$SUFFIX"}
