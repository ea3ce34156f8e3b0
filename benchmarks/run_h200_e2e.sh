#!/usr/bin/env bash
# One device call for the three end-to-end benchmarks (model, serve, spec) on the H200, ~8 minutes at most:
#   device run: carry [".whl"] (optional: fla wheels, so HF's GDN layers use fla), command: bash benchmarks/run_h200_e2e.sh
# Each benchmark stops starting new cases after its --time-budget and is killed by `timeout` after that plus a
# margin; both write their JSON + markdown after every case, so a cut-short run still leaves partial results.
# Everything comes back in $OUT/res.tar; copy the files into benchmarks/results/ afterwards.
set -u
source benchmarks/device_env.sh res
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)" \
  | sed 's/^/torch, triton, transformers: /' | tee -a "$OUT/gpu.txt"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
# budget = seconds after which no new case starts; timeout = hard stop (budget + the longest case + start-up)
run() {  # name budget timeout
  timeout "$3" python3 -m "benchmarks.bench_$1" --out "$OUT" --time-budget "$2" > "$OUT/bench_$1.log" 2>&1
  echo "bench $1 rc=$? ($(grep -c '^\[bench' "$OUT/bench_$1.log") progress lines)"; pack
}
run model 200 270
run serve 100 140
run spec 110 150
grep -h "^Target" "$OUT"/serve_*.md 2>/dev/null
for f in "$OUT"/model_*.md "$OUT"/serve_*.md "$OUT"/spec_*.md; do
  [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -60; }
done
