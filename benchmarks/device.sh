#!/usr/bin/env bash
# The one device script: GPU tests and benchmarks on the H200, in one call of the device tool.
#
#   device run: carry [".whl"], command: GDNSERVE_CODE_COMMIT=<sha> bash benchmarks/device.sh SUITE[:SECONDS] ...
#
# GDNSERVE_CODE_COMMIT: the commit of the code sent (`git rev-parse --short HEAD` here, committed first); the results'
# `git` field reads it (the device's own checkout is the session's first commit, so git there says "<that> dirty").
#
# Suites (run in the order given; SECONDS = the suite's budget, a default otherwise):
#   tests[:s]    every test file in its own process (a CUDA fault stays in its file), JOBS (4) at a time, each
#                under a timeout of s (<= 420; a file is meant to stay under 120 s there: its time is mostly Triton
#                compiling one kernel per specialisation, which tests/kernel_specs.py counts on the CPU);
#                TESTS="tests/ops tests/layers" narrows it. One summary line per file in gpu_tests.log (a full run
#                is committed as benchmarks/results/gpu_tests_h200.log; a narrowed one is cited by its commit and
#                command, not committed).
#   chunkvar[:s] python -m benchmarks.bench_chunk_variants (the chunked prefill: our row, the fused_main variant at V
#                tiles 16/32/64 and with CP, fla, FlashQLA with and without auto-CP, at issue 28's nine shapes; CHUNKVAR_ARGS narrows
#                it, e.g. "--shapes 1x32768,8x4096 --no-fla"; default budget 170 s; FlashQLA needs its wheels in .whl/
#                or $QLA_WHL: flash-qla 0.1.3, tilelang 0.1.15, apache-tvm-ffi, torch-c-dlpack-ext, z3-solver,
#                cloudpickle, ml-dtypes)
#   ops[:s]      python -m benchmarks.bench_ops            (kernels vs fla, one run; OPS_ARGS="--quick
#                --only decode:1,256 --only verify:256" narrows it)
#   attention[:s] python -m benchmarks.bench_attention (paged attention kernels and tile variants; ATTN_ARGS, e.g.
#                --long-decode: decode B = 1, 16 at context 8,192, the flash-decoding split sizes)
#   grouped[:s]  python -m benchmarks.bench_grouped_prefill (four executors vs fla two-phase)
#   profile[:s]  python -m benchmarks.profile_kernels       (per-kernel GPU time of the grouped step;
#                PROFILE_ARGS=--host adds the host-time profile of one eager call per case)
#   tune[:s]     python -m benchmarks.tune_chunk            (per-stage launch configs; TUNE_ARGS=--accuracy: only
#                the state error against length, fla beside)
#   fused[:s]    python -m benchmarks.bench_decode_fused (decode B = 1, 16, bf16 and FP8, fused decode paths off vs
#                on in one process: ms, % of floor, kernels per layer; FUSED_ARGS adds flags, e.g. --steps 20)
#   skinny[:s]   python -m benchmarks.bench_skinny_m4 (the CUDA-core skinny GEMV at M = 1..4 vs cuBLAS at the decode
#                projection shapes, a pruned config sweep; skinny_m4_<device>.{json,md} and a TABLE fragment for
#                ops/gemv; default budget 120 s: the sweep stops starting configs 10 s before it; SKINNY_ARGS adds
#                flags, e.g. "--shapes 2048x4096,9216x2048 --ms 1,4")
#   layers[:s]   python -m benchmarks.profile_layers        (kernels per decoder layer, fused kernels off vs on)
#   fp8[:s]      python -m benchmarks.bench_fp8             (FP8 block GEMMs/experts/model vs bf16; FP8_ARGS=--sweep)
#   model[:s] serve[:s] spec[:s] moe[:s]   the end-to-end benchmarks (--time-budget s)
#   http[:s]     python -m benchmarks.bench_serve_http --random full --device cuda --time-budget s (default 540): the
#                full-size random model served over HTTP (benchmarks/serve_random.py), random / prefix / chat workloads
#                at C = 1, 16, 64, 256, max; HTTP_ARGS replaces "--max-num-seqs 256 --model-json
#                benchmarks/results/model_h200.json" (e.g. add --fp8, --gpu-memory-utilization 0.85)
#   http_fp8[:s] http_mtp[:s]   the same benchmark again in the same call (its files carry --tag, so the runs do not
#                overwrite each other): issue 27's peers' workload in FP8 at C = 1, 16, 256, max (HTTP_FP8_ARGS
#                replaces it), and MTP k = 3 at a 60 % oracle acceptance at C = 1, 16 (HTTP_MTP_ARGS replaces it)
#   moeshared[:s] python -m benchmarks.bench_moe_shared, bf16 then --fp8 (the shared expert folded vs unfolded at
#                MOESHARED_TOKENS, default 1,2,4,8,16,24,32,64: where layers/moe.py's FOLD_MAX_TOKENS comes from;
#                each under a timeout of s, default 120)
#   engine[:s]   python -m benchmarks.bench_engine_overhead --device cuda (engine decode step vs the bare step at
#                B = 1, 64, 256 on the full-size random model; ENGINE_ARGS adds flags)
#   pserve[:s]   python -m benchmarks.profile_serve (the RFC throughput pass per mode, PSERVE_MODES (none,fused): step
#                times, per-kernel GPU time, busy_share = kernels / wall: issue 26's GPU busy share)
#   solo[:s]     python -m benchmarks.solo_probe --shape full (batched vs alone under engine variants that switch one
#                mechanism off each: overlap, graphs, mixed graphs, automatic checkpoints, chunking; SOLO_ARGS adds flags)
#   tiers[:s]    python -m benchmarks.bench_checkpoint_tiers --device cuda --random full --time-budget s (default 540):
#                N conversations x 4 turns beyond the GPU's checkpoint capacity (~10x), the host tier off and on; hit
#                rate and TTFT per turn, restore vs recompute per checkpoint; writes checkpoint_tier_<device>.{json,md};
#                TIERS_ARGS adds flags (e.g. --num-slots 64 --system-tokens 2048)
#   tp[:s]       tensor parallelism on 2 GPUs (nvidia-h200-x2), NCCL_NVLS_ENABLE=0: python -m benchmarks.bench_tp
#                --tp 1,2 ${TP_ARGS:---quick} (TP=2 vs TP=1: equality, decode/prefill, all-reduce, serve, Qwen3-Next)
#                with s/2 - 10 (s default 500) as its --time-budget (killed with SIGINT 60 s past it), then the GPU
#                tests at TP=2 (tests/engine/test_tp_gpu.py) under a timeout of what is left of s (170 s of 500)
#
# .whl/ (git-ignored; make it once on the workstation:
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   pip download --no-deps $P -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0
#   pip download $P -d .whl fastapi uvicorn openai httpx pytest hypothesis prometheus-client tqdm einops)
# holds py3.12 wheels of what the device image may lack (fla-core, flash-linear-attention, pytest,
# hypothesis, fastapi, openai, ...); pip takes from it only what is not installed. Everything a suite writes
# lands in /tmp/res and comes back as $OUT/res.tar (at most 8 files return from a call), re-packed every 20 s
# (give every suite to ONE invocation: a second `device.sh` in the same call starts by clearing /tmp/res, so
# the first one's files are gone unless copied out first),
# so a call cut short by its time limit still returns what was written (bench ops rewrites its tables after
# every case); unpack it into benchmarks/results/ under the stable names (newest result per benchmark, no run
# numbers; git keeps the history): its .md and .json only, not the <suite>.log run logs, pip.log or env.txt
# (tests/test_docs_results.py).
set -u
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=/tmp/res; rm -rf "$OUT"; mkdir -p "$OUT"
pack() { tar -C /tmp -cf "$FINAL/res.tar.part" res 2>/dev/null && mv -f "$FINAL/res.tar.part" "$FINAL/res.tar"; }
( while sleep 20; do pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links .whl --no-compile --no-cache-dir \
    fla-core==0.6.0 flash-linear-attention==0.6.0 pytest hypothesis fastapi uvicorn openai httpx \
    prometheus-client tqdm einops > "$OUT/pip.log" 2>&1 || { echo "wheel install failed:"; tail -5 "$OUT/pip.log"; }
fi
# FlashQLA (issue 28's anchor) only where its wheels are (~83 MB, over the 64 MiB a call carries: QLA_WHL names
# another folder, e.g. under shared/); its absence only drops its rows
# (benchmarks/pack_qla.py packs them into .qla/qla.tar.xz, ~41 MB, which travels: carry [".whl", ".qla"])
if [ -z "${QLA_WHL:-}" ] && [ -f .qla/qla.tar.xz ]; then
  python3 benchmarks/pack_qla.py unpack .qla/qla.tar.xz /tmp/qla_whl >> "$OUT/pip.log" 2>&1 && QLA_WHL=/tmp/qla_whl
fi
QLA_WHL=${QLA_WHL:-.whl}
if ls "$QLA_WHL"/flash_qla-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links "$QLA_WHL" --find-links .whl --no-compile --no-cache-dir flash-qla tilelang \
    >> "$OUT/pip.log" 2>&1 || { echo "flash-qla install failed:"; tail -3 "$OUT/pip.log"; }
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers, fla; print('transformers', transformers.__version__, 'fla', fla.__version__)" 2>&1 | tail -1
} | tee "$OUT/env.txt"

run_tests() {  # budget
  mkdir -p "$OUT/tests"
  # longest first (by the committed log's times; files it lacks count as long): the slow kernel files no longer
  # start last and set the wall time alone
  local files; files=$(find ${TESTS:-tests} -name 'test_*.py' | sort | while read -r f; do
    t=$(grep -h "^$f rc=" benchmarks/results/gpu_tests_h200.log 2>/dev/null | grep -o "in [0-9.]*s" | tr -dc 0-9. | head -c 12)
    echo "${t:-999} $f"; done | sort -k1,1 -g -r | cut -d" " -f2)
  local per=$(( $1 < 420 ? $1 : 420 ))
  # torch's CPU threads split between the parallel files: 8 files x 16 default threads on 16 cores thrashed
  # (a run at commit 3c1ba7b got through half the suite in 450 s)
  export OMP_NUM_THREADS=$(( $(nproc) / ${JOBS:-4} > 0 ? $(nproc) / ${JOBS:-4} : 1 ))
  echo "$files" | xargs -P "${JOBS:-4}" -I{} bash -c '
    f={}; log='"$OUT"'/tests/$(echo "$f" | tr / _ | sed "s/.py$//").log
    timeout '"$per"' python3 -m pytest -q -p no:cacheprovider "$f" > "$log" 2>&1; rc=$?
    echo "$f rc=$rc: $(tail -1 "$log")"' | sort | tee "$OUT/gpu_tests.log"
  grep -h "^FAILED\|^ERROR" "$OUT"/tests/*.log | cut -c1-220 | head -40
}
bench() {  # module budget [args...]
  local m=$1 b=$2; shift 2
  timeout $(( b + 60 )) python3 -m "benchmarks.$m" --out "$OUT" "$@" > "$OUT/$m.log" 2>&1
  echo "$m rc=$?"; grep -h "^|\|^## Targets\|^Target" "$OUT"/*.md 2>/dev/null | tail -40 | cut -c1-240
}

for arg in "$@"; do
  suite=${arg%%:*}; b=${arg#*:}; [ "$b" = "$arg" ] && b=""
  echo "== $suite ${b:+(budget ${b}s)}"
  case $suite in
    tests)   run_tests "${b:-480}" ;;
    ops)     bench bench_ops "${b:-200}" ${OPS_ARGS:-} ;;
    chunkvar) bench bench_chunk_variants "${b:-170}" --time-budget "${b:-170}" ${CHUNKVAR_ARGS:-} ;;
    grouped) bench bench_grouped_prefill "${b:-200}" ;;
    attention) timeout "${b:-120}" python3 -m benchmarks.bench_attention --out "$OUT" ${ATTN_ARGS:-} \
               > "$OUT/bench_attention.log" 2>&1; echo "bench_attention rc=$?"; tail -24 "$OUT/bench_attention.log" ;;
    profile) timeout "${b:-60}" python3 -m benchmarks.profile_kernels ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
             grep -A5 "^##" "$OUT/profile.log" | head -60 ;;
    tune)    timeout "${b:-200}" python3 -m benchmarks.tune_chunk --out "$OUT" ${TUNE_ARGS:-} > "$OUT/tune_chunk.log" 2>&1
             tail -30 "$OUT/tune_chunk.log" ;;
    skinny)  bench bench_skinny_m4 "${b:-120}" --time-budget $(( ${b:-120} - 10 )) ${SKINNY_ARGS:-} ;;
    layers)  timeout "${b:-100}" python3 -m benchmarks.profile_layers --out "$OUT/kernels_per_layer_h200.md" \
               > "$OUT/profile_layers.log" 2>&1; echo "profile_layers rc=$?"; tail -30 "$OUT/profile_layers.log" ;;
    fp8)     timeout $(( ${b:-120} + 60 )) python3 -m benchmarks.bench_fp8 --out "$OUT" --time-budget "${b:-120}" \
               ${FP8_ARGS:-} > "$OUT/bench_fp8.log" 2>&1; echo "bench_fp8 rc=$?"; tail -40 "$OUT/bench_fp8.log" ;;
    model|serve|spec|moe) bench "bench_$suite" "${b:-120}" --time-budget "${b:-120}" ;;
    http)    http_default="--max-num-seqs 256 --model-json benchmarks/results/model_h200.json"
             bench bench_serve_http "${b:-540}" --random full --device cuda --time-budget "${b:-540}" \
               ${HTTP_ARGS:-$http_default} ;;
    http_fp8|http_mtp)
             peers="--max-num-seqs 256 --max-model-len 9216 --model-json benchmarks/results/model_h200.json
               --input-len 8192 --output-len 1024 --per-level 1 --min-requests 2"
             if [ "$suite" = http_fp8 ]; then args=${HTTP_FP8_ARGS:-"$peers --fp8 --tag h200_fp8 --concurrency 1,16,256,max
               --model-json benchmarks/results/fp8_h200.json"}
             else args=${HTTP_MTP_ARGS:-"$peers --workloads random --concurrency 1,16 --spec-k 3 --spec-draft mtp
               --spec-oracle 0.6 --tag h200_mtp60"}; fi
             timeout $(( ${b:-300} + 60 )) python3 -m benchmarks.bench_serve_http --out "$OUT" --random full \
               --device cuda --time-budget "${b:-300}" $args > "$OUT/bench_serve_http_${suite#http_}.log" 2>&1
             echo "bench_serve_http ($suite) rc=$?"; grep -h "^|" "$OUT"/serve_http_*"${suite#http_}"*.md 2>/dev/null \
               | tail -12 | cut -c1-240 ;;
    fused)   timeout $(( ${b:-180} + 30 )) python3 -m benchmarks.bench_decode_fused --out "$OUT" \
               --time-budget $(( ${b:-180} - 20 )) ${FUSED_ARGS:-} \
               > "$OUT/bench_decode_fused.log" 2>&1; echo "bench_decode_fused rc=$?"
             tail -14 "$OUT/bench_decode_fused.log" ;;
    moeshared) for f in "" --fp8; do
               n=moe_shared${f:+_fp8}_h200      # the results' names (bench_moe_shared writes .md and .json)
               timeout "${b:-120}" python3 -m benchmarks.bench_moe_shared $f --commit "${GDNSERVE_CODE_COMMIT:-unknown}" \
                 --tokens "${MOESHARED_TOKENS:-1,2,4,8,16,24,32,64}" --out "$OUT/$n.md" \
                 > "$OUT/bench_$n.log" 2>&1; echo "bench_moe_shared $f rc=$?"
               grep -h "^| [0-9]" "$OUT/$n.md" | cut -c1-200; done ;;
    engine)  timeout "${b:-240}" python3 -m benchmarks.bench_engine_overhead --device cuda --out "$OUT" ${ENGINE_ARGS:-} \
               > "$OUT/bench_engine_overhead.log" 2>&1; echo "bench_engine_overhead rc=$?"
             tail -12 "$OUT/bench_engine_overhead.log" ;;
    pserve)  timeout "${b:-300}" python3 -m benchmarks.profile_serve --out "$OUT/profile_serve_h200.json" \
               --modes ${PSERVE_MODES:-none,fused} > "$OUT/profile_serve.log" 2>&1; echo "profile_serve rc=$?"
             grep '^{' "$OUT/profile_serve.log" | cut -c1-400 ;;
    solo)    timeout "${b:-420}" python3 -m benchmarks.solo_probe --shape full --device cuda --out "$OUT" \
               --time-budget $(( ${b:-420} - 60 )) ${SOLO_ARGS:-} > "$OUT/solo_probe.log" 2>&1; echo "solo_probe rc=$?"
             tail -14 "$OUT/solo_probe.log" ;;
    tiers)   bench bench_checkpoint_tiers "${b:-540}" --device cuda --random full --time-budget "${b:-540}" \
               ${TIERS_ARGS:-} ;;
    tp)      export NCCL_NVLS_ENABLE=0 GDNSERVE_TP_TIMEOUT_S=${GDNSERVE_TP_TIMEOUT_S:-180}
             nvidia-smi topo -m > "$OUT/gpu_topology.txt" 2>&1
             tb=$(( ${b:-500} / 2 - 10 ))
             # SIGINT at the limit: rank 0's finally blocks stop its workers (a SIGTERM would leave them holding a GPU)
             timeout -s INT -k 30 $(( tb + 60 )) python3 -m benchmarks.bench_tp --out "$OUT" --device cuda --tp 1,2 \
               --time-budget "$tb" ${TP_ARGS:---quick} > "$OUT/bench_tp.log" 2>&1
             echo "bench_tp rc=$?"; grep -h "^|\|^Greedy\|^Qwen3\|^qwen3" "$OUT"/tp_*.md 2>/dev/null | head -60 | cut -c1-240
             TESTS=tests/engine/test_tp_gpu.py JOBS=1 run_tests $(( ${b:-500} - tb - 90 )) ;;
    *)       echo "unknown suite $suite" ;;
  esac
  pack
done
