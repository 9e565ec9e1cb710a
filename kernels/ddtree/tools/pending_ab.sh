#!/usr/bin/env bash
# The pending patches (kernels/ddtree/results/pending-*.patch: built and nvcc-checked, never timed)
# measured in ONE device call, each alone and all together, against the committed kernels.
#
# Here (needs git), from the repository root:
#   bash kernels/ddtree/tools/pending_ab.sh prepare
# makes kernels/ddtree/ab_work/{base,<patch>...} (HEAD's kernels/ and ddtree tests, each with one
# patch applied; untracked, they travel with the working tree: never commit them) and applies
# every patch to the working tree ("all"). Then through the device tool:
#   bash kernels/ddtree/tools/pending_ab.sh device
# builds every tree side by side, times (c) graph replays of each at the goal shapes, two rounds
# interleaved (tools/ab_builds.sh), then runs the GPU tests of the paths the patches touch on
# the working tree's build. In $OUT: ab.txt (the table), pytest.log, ab-logs.tgz (the rest). Keep a patch only if its column beats base in both
# rounds; `git apply -R` the others, and delete ab_work.
set -uo pipefail
root=$(pwd)
work=kernels/ddtree/ab_work
case "${1:-}" in
  prepare)
    patches=(kernels/ddtree/results/pending-*.patch)
    [ -e "${patches[0]}" ] || { echo "no pending patches in kernels/ddtree/results/"; exit 2; }
    rm -rf "$work" && mkdir -p "$work/base"
    git archive HEAD kernels tests/test_ddtree_kernels.py | tar -x -C "$work/base"
    for p in "${patches[@]}"; do
      name=$(basename "$p" .patch); name=${name#pending-}
      mkdir -p "$work/$name" && git archive HEAD kernels tests/test_ddtree_kernels.py | tar -x -C "$work/$name"
      # patch(1), not git apply: inside the repository git apply would patch the real files.
      (cd "$work/$name" && patch -s -p1 --no-backup-if-mismatch < "$root/$p") || { echo "$name does not apply"; exit 1; }
      git apply "$p" || { echo "$name does not apply to the working tree"; exit 1; }
      echo "prepared $name"
    done
    ;;
  device)
    export PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/ddtree-out}; mkdir -p "$OUT"
    args=()
    for d in "$work"/*/; do d=${d%/}; args+=("$(basename "$d")=$d"); done
    AB_SHAPES=${AB_SHAPES:-1x64,1x256,64x64,64x256} bash kernels/ddtree/tools/ab_builds.sh "${args[@]}" all=. |
      tee "$OUT/ab.txt"
    export DDTREE_EXT_DIR=$root/build/ddtree PYTHONPATH=$root/kernels:$root
    python3 -m pytest -q -p no:cacheprovider tests/test_ddtree_kernels.py tests/test_ddtree_batch_invariance.py \
      tests/test_ddtree_sibling_order.py -k "cuda or fused or many_rows or composed or batch or sibling or graph" \
      > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
    # The device tool brings back at most 8 files from $OUT: the per-run logs go as one archive.
    (cd "$OUT" && tar -czf ab-logs.tgz build-*.log graph-*.txt && rm -f build-*.log graph-*.txt)
    ;;
  *) echo "usage: pending_ab.sh prepare|device"; exit 2 ;;
esac
