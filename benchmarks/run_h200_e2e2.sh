#!/usr/bin/env bash
# One device call (<= 10 min): MoE tile sweep, then the model and serving benchmarks on the MoE model with the
# Triton grouped GEMM (and CUDA graphs). Packed in one tar.  device run: carry [".whl"], command: bash benchmarks/run_h200_e2e2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=/tmp/res; mkdir -p $OUT
pack() { tar -C /tmp -cf "$FINAL/res.tar" res; }
python3 -c "import torch, triton, transformers as t, fla; print(torch.__version__, triton.__version__, t.__version__, 'fla', fla.__version__)" | tee -a "$OUT/gpu.txt"
timeout 80 python3 -m benchmarks.bench_moe --sweep --tokens 1,16,256,4096 > "$OUT/moe_sweep.log" 2>&1; echo "sweep rc=$?"
cut -c1-400 $OUT/moe_sweep.log | grep -v Warn
pack
run() {  # name budget timeout
  timeout "$3" python3 -m "benchmarks.bench_$1" --out "$OUT" --time-budget "$2" > "$OUT/bench_$1.log" 2>&1
  echo "bench $1 rc=$?"; pack
}
run model 200 270
run serve 100 140
for f in "$OUT"/model_*.md "$OUT"/serve_*.md; do
  [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -40 | cut -c1-240; }
done
