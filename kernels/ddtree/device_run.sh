#!/usr/bin/env bash
# One device call (through the device tool, carry [".whl"]): build the CUDA extension for sm_90,
# run the GPU property tests and the host-side build check, per-op graph timings, then the
# benchmark (SKIP_HOST_BUILD=1, SKIP_E2E=1, SKIP_PROBE=1, SKIP_BENCH=1 skip those). Logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 DDTREE_EXT_DIR=build/ddtree PYTHONPATH=$PWD/kernels:$PWD  # the DDTree package imports as ddtree (kernels/ is its root)
OUT=${OUT:-/tmp/ddtree-out}; mkdir -p "$OUT"
python3 -m ddtree.build --out build/ddtree > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
# The host-side build of build-kernels, as a host runs it (tools/host_build_check.py: the files
# stages/kernels.sources() sends, remote/kernel_build.py build, fingerprint against the host facts',
# sha256 as recorded, the deploy's import check from /), beside the tests (CPU; its draft is tiny).
# The controller code needs pydantic, which the image lacks: carry .whl (README "Host build check").
if [ "${SKIP_HOST_BUILD:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/host-check-site .whl/*.whl \
    > "$OUT/host-build.log" 2>&1
  HOST_CHECK_SITE=/tmp/host-check-site python3 kernels/ddtree/tools/host_build_check.py --json "$OUT/host-build.json" \
    >> "$OUT/host-build.log" 2>&1 &
  host_build=$!
fi
# PYTEST_K narrows the tests (e.g. "cuda or fused": the CPU ones already ran off the device).
python3 -m pytest -q -p no:cacheprovider tests/test_ddtree_*.py ${PYTEST_K:+-k "$PYTEST_K"} \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|Error|error" "$OUT/pytest.log" | tail -12
# The fused launch's two variants forced in turn: clusters with no fall-back (a cluster launch
# that fails is an error, not a silent switch), then the counter variant on 16-bit logits too.
for variant in cluster counter; do
  DDTREE_FUSED=$variant python3 -m pytest -q -p no:cacheprovider tests/test_ddtree_kernels.py tests/test_ddtree_batch_invariance.py \
    -k "fused or graph" > "$OUT/pytest-$variant.log" 2>&1
  echo "pytest (DDTREE_FUSED=$variant) rc=$?"; tail -1 "$OUT/pytest-$variant.log"
done
if [ -n "${host_build:-}" ]; then  # before anything timed
  wait "$host_build"; echo "host build check rc=$?"; grep -E "^(ok|FAIL)|host build check|Error" "$OUT/host-build.log"
fi
# Aligned 16-bit rows past 128 take the streaming top-K at every K <= 256: the chunk kernel forced
# on the many-row tests keeps it tested on such rows too (it still serves fp32 past K = 64 and odd V).
DDTREE_TOPK=chunk python3 -m pytest -q -p no:cacheprovider tests/test_ddtree_kernels.py tests/test_ddtree_batch_invariance.py \
  -k "many_rows or composed or batch" > "$OUT/pytest-chunk.log" 2>&1
echo "pytest (DDTREE_TOPK=chunk) rc=$?"; tail -1 "$OUT/pytest-chunk.log"
# The decode loop with a real model (transformers on the machine): bf16, then fp32 (the strict check).
[ "${SKIP_E2E:-0}" = 1 ] || for dt in bfloat16 float32; do
  python3 -W ignore -m ddtree.e2e --dtype $dt --json "$OUT/e2e-$dt.json" 2>&1 | tee "$OUT/e2e-$dt.log"
done
[ "${SKIP_PROBE:-0}" = 1 ] || python3 -m ddtree.probe 2>&1 | tee "$OUT/probe.log"
[ "${SKIP_BENCH:-0}" = 1 ] || python3 -m ddtree.bench --iters 100 --ref-iters 30 --json "$OUT/bench.json" 2>&1 | tail -12
