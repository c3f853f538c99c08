#!/usr/bin/env bash
# The checks to run, as one command, on an accelerator host (docs/benchmarks.md, "Accelerator"): versions, greedy speculative == plain in bfloat16, also
# with every target pass padded to >= 2 tokens (jaxspec.engine.MIN_PASS_TOKENS: does plain then
# run the verify window's kernels?) (benchmarks/greedy_exactness.py on its 4-layer d-1024 shape;
# tiny shapes are the CPU suite's), and benchmarks/accelerator.py for each Llama shape (its
# e2e part times plain decoding unpadded and padded to 2 tokens). The float32 exactness part of
# 2026-12-04 (every row identical) gave its time to the padded check.
# Each part has its own time limit, so one that fails or runs long leaves the others' results.
# Writes JSON and a log under $OUT (default /tmp/device_checks).
#
#   bash benchmarks/device_checks.sh        # from the repository root; ~7-9 minutes on an H200 (2026-12-04: 409 s before --hlo-summary); part limits sum to 580 s
set -u -o pipefail
OUT=${OUT:-/tmp/device_checks}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices())"
  echo "== greedy exactness, bfloat16"
  timeout 135 $PY -m benchmarks.greedy_exactness --shapes small --dtypes bfloat16 --out "$OUT/greedy_exactness_bf16.json"
  echo "== accelerator.py llama-3.1-8b (rc of the previous part: $?)"
  timeout 270 $PY -m benchmarks.accelerator --shapes llama-3.1-8b --tree-widths 2,9,17,31 --hlo-summary \
    --out "$OUT/accelerator_8b.json"
  echo "== accelerator.py llama-3.2-1b (rc of the previous part: $?)"
  timeout 130 $PY -m benchmarks.accelerator --shapes llama-3.2-1b --out "$OUT/accelerator_1b.json"
  echo "== greedy exactness, bfloat16, passes of >= 2 tokens (rc of the previous part: $?)"
  timeout 45 $PY -m benchmarks.greedy_exactness --dtypes bfloat16 --shapes small --seeds 1 \
    --drafters self_draft --min-pass-tokens 2 --out "$OUT/greedy_exactness_bf16_min_pass2.json"
  echo "== done (rc of the previous part: $?)"
  date -u
} 2>&1 | tee "$OUT/log.txt"
