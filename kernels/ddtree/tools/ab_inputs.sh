#!/usr/bin/env bash
# Same-run A/B of two builds on one H200 (through the device tool): the working tree against a
# base ddtree_cuda.cu, built side by side, then `probe --inputs` (bs=1, K=B=64, ten seeded
# inputs, graph replays) on each, interleaved twice, so machine-to-machine differences (~0.5 us
# here) do not pass for a change's effect. Here, before the device call:
#   git show REV:kernels/ddtree/csrc/ddtree_cuda.cu > ab_base.cu     # untracked: it travels
# then on the device: bash kernels/ddtree/tools/ab_inputs.sh ab_base.cu. Logs in $OUT.
# AB_GRAPH=1 also times (c) graph replays at the goal shapes (tools/ab_graph.py) the same way.
set -uo pipefail
BASE_CU=${1:?usage: ab_inputs.sh BASE_ddtree_cuda.cu}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ddtree-out}; mkdir -p "$OUT"
base=$(mktemp -d)
cp -r kernels "$base/" && cp "$BASE_CU" "$base/kernels/ddtree/csrc/ddtree_cuda.cu"
(cd "$base" && PYTHONPATH="$base/kernels" python3 -m ddtree.build --out "$base/build" > "$OUT/build-base.log" 2>&1) &
PYTHONPATH=$PWD/kernels python3 -m ddtree.build --out build/ddtree > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
wait
[ -f "$base/build/metadata.json" ] || { tail -30 "$OUT/build-base.log"; exit 1; }
inputs() { (cd "$2" && DDTREE_EXT_DIR=$3 PYTHONPATH=$2/kernels python3 -m ddtree.probe --inputs > "$OUT/inputs-$1.txt" 2>&1); }
graphs() { (cd "$2" && DDTREE_EXT_DIR=$3 python3 "$PWD/kernels/ddtree/tools/ab_graph.py" > "$OUT/graph-$1.txt" 2>&1); }
for round in 1 2; do
  inputs "base$round" "$base" "$base/build"
  inputs "new$round" "$PWD" "$PWD/build/ddtree"
  if [ "${AB_GRAPH:-0}" = 1 ]; then
    graphs "base$round" "$base" "$base/build"
    graphs "new$round" "$PWD" "$PWD/build/ddtree"
  fi
done
if [ "${AB_GRAPH:-0}" = 1 ]; then
  echo "(c) graph us: base, new, base, new"
  paste "$OUT"/graph-base1.txt "$OUT"/graph-new1.txt "$OUT"/graph-base2.txt "$OUT"/graph-new2.txt
fi
echo "us per call: base, new, base, new"
paste "$OUT"/inputs-base1.txt "$OUT"/inputs-new1.txt "$OUT"/inputs-base2.txt "$OUT"/inputs-new2.txt \
  | sed 's/, 64 nodes//g; s/ deep//g'
