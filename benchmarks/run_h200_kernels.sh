#!/usr/bin/env bash
# One device call (<= 10 min) after kernel changes: GPU tests of the ops and layers (in parallel, one process
# per file), compute-sanitizer on the small-tile prep, per-kernel and host profiles, then the grouped-prefill
# and op benchmarks.   device run: carry [".whl"], command: bash benchmarks/run_h200_kernels.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FINAL=$OUT; OUT=/tmp/res; mkdir -p $OUT   # at most 8 files come back: everything travels in one tar
pack() { tar -C /tmp -cf "$FINAL/res.tar" res; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(timeout 90 compute-sanitizer --tool memcheck --print-limit 3 python3 -m benchmarks.sanitize_prep > "$OUT/sanitizer.log" 2>&1; echo "sanitizer rc=$?" >> "$OUT/sanitizer.log") &
for f in tests/ops/test_conv.py tests/ops/test_gdn_chunk.py tests/ops/test_gdn_recurrent.py tests/ops/test_gpu_graphs.py tests/layers; do
  (timeout 200 python3 -m pytest -q -x "$f" 2>&1 | tail -4 | sed "s|^|$f: |" > "$OUT/t_$(basename $f).log") &
done
wait
cat "$OUT"/t_*.log > "$OUT/gpu_tests.log"; rm "$OUT"/t_*.log; cat "$OUT/gpu_tests.log"; tail -3 "$OUT/sanitizer.log"
timeout 60 python3 -m benchmarks.profile_kernels > "$OUT/profile.log" 2>&1; grep -A5 "^##" "$OUT/profile.log" | head -60
pack
timeout 30 python3 -m benchmarks.host_profile > "$OUT/host_profile.log" 2>&1; grep "^##" "$OUT/host_profile.log"
timeout 215 python3 -m benchmarks.bench_grouped_prefill --out "$OUT" > "$OUT/bench_grouped_prefill.log" 2>&1
echo "grouped rc=$?"; grep -A8 "^## Targets" "$OUT"/grouped_prefill_*.md
pack
timeout 200 python3 -m benchmarks.bench_ops --out "$OUT" > "$OUT/bench_ops.log" 2>&1
echo "ops rc=$?"; grep -A7 "^## Targets" "$OUT"/ops_*.md
pack
