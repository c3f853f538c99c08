#!/usr/bin/env bash
# SmolLM2-135M on an accelerator host: Spec-Bench (one question per category + the code
# rewrite, 128 new tokens, greedy, batch 1, every call timed twice) for plain decoding and
# every drafter that ships for it, in the device's default dtype (bfloat16): speedups, tau,
# and output identity with plain decoding on a real model. The model reaches the offline host in
# verified parts over several transfers (python -m benchmarks.device_carry prepare prints them);
# this runs with the last.
# Writes the spec_bench JSON/Markdown/plots and a log under $OUT. Settings by environment:
# METHODS, PER_CATEGORY, MAX_NEW_TOKENS, SPEC_BENCH_TIMEOUT (s, 0: skip), SPEC_BENCH_EXTRA (more flags).
#
# TRAIN_EAGLE=N (issue 11) first trains an EAGLE-3 head: the target answers N Magpie queries
# (train-eagle --magpie N --answers-only, seed TRAIN_SEED, default 1: not the 1000 queries of
# seed 0 that ship; GEN_BATCH prompts per generate call; within ANSWER_TIMEOUT s), then a head
# trains on those answers (TRAIN_STEPS steps, TRAIN_WARMUP of warmup, TRAIN_BATCH sequences a
# step; within TRAIN_TIMEOUT s). What comes back under $OUT: the answers, gzipped, as soon as
# they exist (eagle_sequences.json.gz: train on them anywhere with --sequences) and the head in
# bfloat16 (eagle_head.tgz, with train.json; 15 MB, under a 16 MiB limit per file sent back; none
# if training ran out of time: the head is written at its last step). Size N and the steps so
# that the whole run ends within the host's time limit (10 minutes at most), compiles included. The target
# runs in the device's default dtype (bfloat16) there: its answers and features are bfloat16 ones.
#
#   bash benchmarks/device_smollm2.sh       # from the repository root, on the device machine
#   TRAIN_EAGLE=8000 SPEC_BENCH_TIMEOUT=0 bash benchmarks/device_smollm2.sh
set -u -o pipefail
OUT=${OUT:-/tmp/device_smollm2}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  date -u
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/gguf-*.whl || exit 1
  $PY -m benchmarks.device_carry assemble --site /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:.
  if [ "${TRAIN_EAGLE:-0}" -gt 0 ]; then
    run=/tmp/eagle_device
    rm -rf "$run" "$run-answers"
    # the answers first, in their own run, so that they come back even if training runs out of time
    timeout ${ANSWER_TIMEOUT:-240} $PY -m checkpoints_tools train-eagle --model smollm2-135m --out "$run-answers" \
      --magpie "$TRAIN_EAGLE" --seed ${TRAIN_SEED:-1} --gen-batch ${GEN_BATCH:-256} --max-new-tokens 128 \
      --answers-only --no-progress
    echo "== answers rc $?"
    [ -f "$run-answers/sequences.json" ] && gzip -c "$run-answers/sequences.json" > "$OUT/eagle_sequences.json.gz"
    date -u
    if [ -f "$run-answers/sequences.json" ]; then
      timeout ${TRAIN_TIMEOUT:-240} $PY -m checkpoints_tools train-eagle --model smollm2-135m --out "$run" \
        --sequences "$run-answers/sequences.json" --seed ${TRAIN_SEED:-1} --gen-batch ${GEN_BATCH:-256} \
        --steps ${TRAIN_STEPS:-3000} --batch ${TRAIN_BATCH:-32} --warmup ${TRAIN_WARMUP:-100} \
        --save-every ${TRAIN_STEPS:-3000} --eval-every 500 --no-progress
      echo "== train-eagle rc $?"
    fi
    if [ -d "$run/head" ]; then
      $PY -m checkpoints_tools convert-head "$run/head" "$run/head-bf16" \
        && tar czf "$OUT/eagle_head.tgz" -C "$run" head-bf16 train.json
    fi
    ls -l "$OUT"
    date -u
  fi
  if [ "${SPEC_BENCH_TIMEOUT:-420}" -gt 0 ]; then
    # every prompt (<= 769 tokens with the chat template) in one prompt bucket: one program per method
    timeout ${SPEC_BENCH_TIMEOUT:-420} $PY -m benchmarks.spec_bench --model smollm2-135m \
      --per-category ${PER_CATEGORY:-1} --code-prompt \
      --max-new-tokens ${MAX_NEW_TOKENS:-128} --reps 2 --prompt-bucket 832 --no-compile-cache \
      --methods ${METHODS:-plain,ngram_g4,ngram_g16_s4_b2,eagle_g4,eagle_g4_n8_k2,medusa_g3,lookahead_w5_n4_g5} \
      --out "$OUT/spec_bench_smollm2_device" ${SPEC_BENCH_EXTRA:-}
    echo "== spec_bench rc $?"
  fi
  date -u
} 2>&1 | tee "$OUT/log.txt"
