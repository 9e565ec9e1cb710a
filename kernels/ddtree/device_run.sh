#!/usr/bin/env bash
# One device call: build the CUDA extension for sm_90, run the property tests on the GPU, benchmark.
# Usage (through the device tool): bash kernels/ddtree/device_run.sh   (logs land in $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ddtree-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
start=$(date +%s)
python3 -m kernels.ddtree.build --out build/ddtree > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"; tail -14 "$OUT/build.log"
DDTREE_EXT_DIR=build/ddtree python3 -m pytest -q -p no:cacheprovider -x tests/test_ddtree_kernels.py ${PYTEST_K:-} \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"; tail -25 "$OUT/pytest.log"
[ "${SKIP_BENCH:-0}" = 1 ] || DDTREE_EXT_DIR=build/ddtree python3 -m kernels.ddtree.bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
