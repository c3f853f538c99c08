#!/usr/bin/env bash
# SmolLM2-135M on a lent accelerator: Spec-Bench (one question per category + the code
# rewrite, 128 new tokens, greedy, batch 1, every call timed twice) for plain decoding and
# every drafter that ships for it, in the device's default dtype (bfloat16): speedups, tau,
# and output identity with plain decoding on a real model. The model reaches the machine in
# parts over several calls (benchmarks/device_carry.py prepare prints them); this is the last.
# Writes the spec_bench JSON/Markdown/plots and a log under $OUT. Settings by environment:
# METHODS, PER_CATEGORY, MAX_NEW_TOKENS, SPEC_BENCH_TIMEOUT (s), SPEC_BENCH_EXTRA (more flags).
#
#   bash benchmarks/device_smollm2.sh       # from the repository root, on the device machine
set -u -o pipefail
OUT=${OUT:-/tmp/device_smollm2}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  date -u
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/gguf-*.whl || exit 1
  PYTHONPATH=. $PY benchmarks/device_carry.py assemble --site /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:.
  # every prompt (<= 769 tokens with the chat template) in one prompt bucket: one program per method
  timeout ${SPEC_BENCH_TIMEOUT:-420} $PY benchmarks/spec_bench.py --model smollm2-135m \
    --questions .devcarry/question.jsonl --per-category ${PER_CATEGORY:-1} --code-prompt \
    --max-new-tokens ${MAX_NEW_TOKENS:-128} --reps 2 --prompt-bucket 832 --no-compile-cache \
    --methods ${METHODS:-plain,ngram_g4,ngram_g16_s4_b2,eagle_g4,eagle_g4_n8_k2,medusa_g3,lookahead_w5_n4_g5} \
    --out "$OUT/spec_bench_smollm2_device" ${SPEC_BENCH_EXTRA:-}
  echo "== spec_bench rc $?"
  date -u
} 2>&1 | tee "$OUT/log.txt"
