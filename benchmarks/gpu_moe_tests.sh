#!/bin/bash
# MoE GPU tests, one process per file, 6 at a time; logs under $1
out=$1; mkdir -p $out
files="tests/ops/test_moe_experts.py tests/ops/test_moe_grouped_tiles.py tests/ops/test_router.py tests/ops/test_fp8_moe.py tests/layers/test_moe.py tests/engine/test_cuda_graphs_gpu.py tests/models/test_fp8_checkpoint.py tests/models/test_mtp.py"
for f in $files; do
  n=$(basename $f .py)
  ( timeout 150 python -m pytest -q -p no:cacheprovider $f > $out/$n.log 2>&1; echo "rc=$?" >> $out/$n.log ) &
  while [ $(jobs -r | wc -l) -ge 6 ]; do sleep 1; done
done
wait
for f in $files; do n=$(basename $f .py); echo "== $f: $(grep -E 'passed|failed|error' $out/$n.log | tail -1) $(tail -1 $out/$n.log)"; done
