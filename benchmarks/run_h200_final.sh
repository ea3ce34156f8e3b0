#!/usr/bin/env bash
# One device call (<= 10 min): GPU tests of what changed since run 2 (chunk parents / prep split, layers,
# captured decode/verify graphs), the per-kernel profile, then the three end-to-end benchmarks with shorter
# budgets. Everything comes back in one tar (at most 8 files return).
#   device run: carry [".whl"], command: bash benchmarks/run_h200_final.sh
set -u
source benchmarks/device_env.sh res
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers as t, fla; print(torch.__version__, triton.__version__, t.__version__, 'fla', fla.__version__)" | tee -a "$OUT/gpu.txt"
t() { timeout "$2" python3 -m pytest -q -x "${@:3}" "$1" > "$OUT/gpu_tests_$(basename $1 .py).log" 2>&1; echo "$1 rc=$?: $(tail -1 "$OUT/gpu_tests_$(basename $1 .py).log")"; }
t tests/ops/test_gdn_chunk.py 120 -k "parent or split or varlen_against" &
t tests/engine/test_cuda_graphs_gpu.py 120 &
wait
t tests/layers 100 &
t tests/engine/test_spec_runner.py 100 &
t tests/models/test_mtp.py 100 &
wait
pack
timeout 40 python3 -m benchmarks.profile_kernels --cases "fused 1P512+16C64,fused 1P4096+64C256,plain 1x576,prefill 1x32768" \
  > "$OUT/profile.log" 2>&1; grep -A5 "^##" "$OUT/profile.log"
pack
run() {  # name budget timeout
  timeout "$3" python3 -m "benchmarks.bench_$1" --out "$OUT" --time-budget "$2" > "$OUT/bench_$1.log" 2>&1
  echo "bench $1 rc=$?"; pack
}
run model 85 125
run serve 80 115
run spec 95 135
for f in "$OUT"/model_*.md "$OUT"/serve_*.md "$OUT"/spec_*.md; do
  [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -40 | cut -c1-220; }
done
