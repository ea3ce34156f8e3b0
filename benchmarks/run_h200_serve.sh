#!/usr/bin/env bash
# One device call: serving diagnosis (launch-cache growth per step must stop after warm-up), the serving
# benchmark, the MTP GPU tests. Packed in one tar.  device run: carry [".whl"], command: bash benchmarks/run_h200_serve.sh
set -u
source benchmarks/device_env.sh res6
timeout 90 python3 -m benchmarks.serve_diag --modes fused,two_phase > "$OUT/serve_diag.log" 2>&1; echo "serve_diag rc=$?"
grep "pass" $OUT/serve_diag.log | cut -c1-400
pack
timeout 150 python3 -m benchmarks.bench_serve --out $OUT --time-budget 110 > "$OUT/bench_serve.log" 2>&1; echo "serve rc=$?"
grep "^|\|Target" $OUT/serve_*.md | cut -c1-260
pack
timeout 90 python3 -m pytest -q tests/models/test_mtp.py tests/engine/test_spec_mtp.py > "$OUT/gpu_tests_mtp.log" 2>&1; echo "mtp tests rc=$?: $(tail -1 $OUT/gpu_tests_mtp.log)"
grep -E "^FAILED|Error:" $OUT/gpu_tests_mtp.log | head
pack
