#!/usr/bin/env bash
# One device call (<= 10 min): serving-pass diagnosis, spec bench (MoE model on the grouped GEMM), MTP GPU
# tests, bf16/fp32 parity diagnosis. Packed in one tar.  device run: carry [".whl"], command: bash benchmarks/run_h200_diag.sh
set -u
source benchmarks/device_env.sh res5
timeout 100 python3 -m benchmarks.serve_diag > "$OUT/serve_diag.log" 2>&1; echo "serve_diag rc=$?"
grep "pass" $OUT/serve_diag.log | cut -c1-700
pack
timeout 160 python3 -m benchmarks.bench_spec --out $OUT --time-budget 120 > "$OUT/bench_spec.log" 2>&1; echo "spec rc=$?"
grep "^|" $OUT/spec_*.md | cut -c1-200 | head -60
pack
timeout 100 python3 -m pytest -q tests/models/test_mtp.py tests/engine/test_spec_mtp.py > "$OUT/gpu_tests_mtp.log" 2>&1; echo "mtp tests rc=$?: $(tail -1 $OUT/gpu_tests_mtp.log)"
pack
mkdir -p $OUT/diag
timeout 150 python3 -m benchmarks.bench_model --out $OUT/diag --time-budget 120 --diagnosis only > "$OUT/bench_model_diag.log" 2>&1; echo "diag rc=$?"
grep "^|" $OUT/diag/model_*.md | head -12
pack
