#!/usr/bin/env bash
# One device call for a full H200 pass (fits the 10-minute limit of a call; ~8 min):
#   device run: carry [".whl"], command: bash benchmarks/run_h200.sh
# Writes everything under $OUT; copy it into benchmarks/results/ afterwards.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
# each test file in its own process: an illegal access poisons the CUDA context for everything after it
for f in tests/ops/test_conv.py tests/ops/test_gdn_chunk.py tests/ops/test_gdn_recurrent.py tests/ops/test_gpu_graphs.py \
         tests/layers tests/models/test_hf_parity.py; do
  timeout 150 python3 -m pytest -q -x "$f" 2>&1 | tail -3 | sed "s|^|$f: |" | tee -a "$OUT/gpu_tests.log"
done
timeout 200 python3 -m benchmarks.bench_ops --out "$OUT" > "$OUT/bench_ops.log" 2>&1; echo "bench ops rc=$?"
timeout 200 python3 -m benchmarks.bench_grouped_prefill --out "$OUT" > "$OUT/bench_grouped_prefill.log" 2>&1
echo "bench grouped-prefill rc=$?"
grep -A9 "^## Targets" "$OUT"/ops_*.md "$OUT"/grouped_prefill_*.md 2>/dev/null | head -30
