#!/usr/bin/env bash
# The kernels issue 50 moved onto one text per op (decode attention, the label read-out, Qwen3.5's conv + gated delta
# rule) against the files they replaced, at each x86 tier this CPU runs (forced below its own), in one run per tier:
#
#   bash bench/kernel_texts_ab.sh BEFORE_TREE [OUT_DIR]
#
# OPS (default "decode labels linear": bench.kernels' --only), TIERS (default avx2, avx512 and this CPU's own tier)
# and NAME (default kernel_texts_ab) choose what runs and the files' names; ARGS adds bench.kernels options (its
# tiers section, the linear op per tier, is timed at the run's tier alone); PYSCORE_BF16_DOT=widen|dpbf16 passes to
# both trees (at tier avx512bf16: the other bf16 product than this CPU's own).
#
# BEFORE_TREE: a built checkout of the commit before the move (git worktree add ... 2e75d8d; make build there).
# Writes OUT_DIR/kernel_texts_ab_<tier>.txt (default bench/results/tiers/kernels/), each opening with this command,
# the commit and the CPU (bench.ab's header); bench.ab's closing table is the comparison.
set -euo pipefail
before=${1:?usage: bench/kernel_texts_ab.sh BEFORE_TREE [OUT_DIR]}
out=${2:-bench/results/tiers/kernels}
py=${PYTHON:-.venv/bin/python}
hardware=$($py -c "from pyscore import _C; print(_C.cpu_features()['hardware_tier'])")
ops=${OPS:-decode labels linear}
name=${NAME:-kernel_texts_ab}
for tier in ${TIERS:-avx2 avx512 $hardware}; do
  case $tier in avx2|avx512|avx512bf16|amx) ;; *) continue ;; esac
  file=$out/${name}_$tier.txt
  {
    echo "# OPS='$ops' TIERS='${TIERS:-}' NAME=$name ARGS='${ARGS:-}' PYSCORE_BF16_DOT=${PYSCORE_BF16_DOT:-}" \
      "bash bench/kernel_texts_ab.sh" \
      "$before $out   (commit $(git rev-parse --short HEAD))"
    # shellcheck disable=SC2086  # $ops, $ARGS: one word each
    $py -m bench.ab --before "$before" --rounds 3 -- -m bench.kernels --only $ops --tier "$tier" --tiers "$tier" \
      --dtypes fp32 bf16 --rounds 2 --reps 5 ${ARGS:-} --out build/kernel_texts_ab_scratch.txt
  } >"$file"
  echo "wrote $file"
done
