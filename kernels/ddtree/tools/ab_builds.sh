#!/usr/bin/env bash
# Same-run A/B of several whole kernels/ trees on one H200 (through the device tool): each
# NAME=DIR (DIR holds a kernels/ tree; "." is the working tree) is built side by side, then
# tools/ab_graph.py ((c) graph replays at the goal shapes) runs on each in turn, ROUNDS times
# (2 unless set), interleaved, so machine-to-machine differences do not pass for a change's
# effect. Unlike ab_inputs.sh (which swaps ddtree_cuda.cu alone), the trees may differ in their
# bindings and headers too. Here, before the device call:
#   mkdir -p kernels/ddtree/ab_work/base && git archive REV kernels | tar -x -C kernels/ddtree/ab_work/base
# (untracked: it travels; do not commit it), then on the device:
#   bash kernels/ddtree/tools/ab_builds.sh base=kernels/ddtree/ab_work/base new=.
# AB_SHAPES passes --shapes to ab_graph.py. Logs in $OUT; the table is printed last.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: ab_builds.sh NAME=DIR NAME=DIR [...]"; exit 2; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ddtree-out}; mkdir -p "$OUT"
root=$PWD
names=(); dirs=()
for arg in "$@"; do
  name=${arg%%=*}; dir=${arg#*=}
  [ "$dir" = . ] && dir=$root || dir=$(cd "$dir" && pwd)
  names+=("$name"); dirs+=("$dir")
done
pids=()
for i in "${!names[@]}"; do
  (cd "${dirs[$i]}" && PYTHONPATH="${dirs[$i]}/kernels" python3 -m ddtree.build --out "${dirs[$i]}/build/ddtree" \
    > "$OUT/build-${names[$i]}.log" 2>&1) &
  pids+=($!)
done
for i in "${!names[@]}"; do
  wait "${pids[$i]}" || { echo "build ${names[$i]} failed"; tail -30 "$OUT/build-${names[$i]}.log"; exit 1; }
done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!names[@]}"; do
    (cd "${dirs[$i]}" && DDTREE_EXT_DIR="${dirs[$i]}/build/ddtree" python3 "${dirs[$i]}/kernels/ddtree/tools/ab_graph.py" \
      ${AB_SHAPES:+--shapes "$AB_SHAPES"} > "$OUT/graph-${names[$i]}-$round.txt" 2>&1)
  done
done
echo "(c) graph us, round by round: ${names[*]}"
files=()
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!names[@]}"; do files+=("$OUT/graph-${names[$i]}-$round.txt"); done
done
paste "${files[@]}"
