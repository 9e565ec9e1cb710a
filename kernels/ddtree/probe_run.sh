#!/usr/bin/env bash
# Device-side tuning run: build, stage timings, an ncu stall profile of top-K, a backtrace of the
# exception crash. Logs land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 DDTREE_EXT_DIR=build/ddtree
OUT=${OUT:-/tmp/ddtree-out}; mkdir -p "$OUT"
python3 -m kernels.ddtree.build --out build/ddtree > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -m kernels.ddtree.probe 2>&1 | tee "$OUT/probe.log"
cat > /tmp/err.py <<'PY'
import torch
from kernels.ddtree import load
ext = load()
try:
    ext.build_tree(torch.zeros(1, 16, 4, dtype=torch.long), torch.zeros(1, 16, 4), 8)
except RuntimeError as e:
    print("caught:", str(e).splitlines()[0])
PY
python3 /tmp/err.py; echo "err.py rc=$?"
timeout 120 cuda-gdb -q -batch -ex run -ex bt --args python3 /tmp/err.py > "$OUT/gdb.log" 2>&1; grep -E "^#|signal|caught" "$OUT/gdb.log" | head -25
cat > /tmp/one.py <<'PY'
import torch
from kernels.ddtree import load
ext = load()
x = (torch.randn(1, 15, 151936, device="cuda") * 3).to(torch.bfloat16)
for _ in range(3): ext.topk_lse(x, 64)
torch.cuda.synchronize()
PY
timeout 240 ncu --clock-control none -k regex:topk --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section WarpStateStats --section LaunchStats --section Occupancy python3 /tmp/one.py > "$OUT/ncu.log" 2>&1
grep -vE "^==PROF==|^\s*$" "$OUT/ncu.log" | grep -E "Duration|Throughput|Stall|Warp Cycles|Registers|Achieved|Theoretical|Issued|Eligible|One or More|No Eligible" | head -40
