#!/usr/bin/env bash
# One device call for the three end-to-end benchmarks (model, serve, spec) on the H200, ~8 minutes at most:
#   device run: carry [".whl"] (optional: fla wheels, so HF's GDN layers use fla), command: bash benchmarks/run_h200_e2e.sh
# Each benchmark stops starting new cases after its --time-budget and is killed by `timeout` after that plus a
# margin; both write their JSON + markdown after every case, so a cut-short run still leaves partial results.
# Writes everything under $OUT; copy it into benchmarks/results/ afterwards.
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:. || exit 1
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)" \
  | sed 's/^/torch, triton, transformers: /' | tee -a "$OUT/gpu.txt"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
# budget = seconds after which no new case starts; timeout = hard stop (budget + the longest case + start-up)
run() {  # name budget timeout
  timeout "$3" python3 -m "benchmarks.bench_$1" --out "$OUT" --time-budget "$2" > "$OUT/bench_$1.log" 2>&1
  echo "bench $1 rc=$? ($(grep -c '^\[bench' "$OUT/bench_$1.log") progress lines)"
}
run model 120 170
run serve 100 150
run spec 130 170
grep -h "^Target" "$OUT"/serve_*.md 2>/dev/null
for f in "$OUT"/model_*.md "$OUT"/serve_*.md "$OUT"/spec_*.md; do
  [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -60; }
done
