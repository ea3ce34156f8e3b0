# Sourced by the benchmarks/run_h200_*.sh device scripts: the carried wheels (.whl/, if any) on PYTHONPATH,
# unbuffered Python, results gathered under /tmp/<name> and packed into one tar in $OUT by `pack` (at most 8
# files come back from a device call).   usage: source benchmarks/device_env.sh <name>
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:. || exit 1
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
RES_NAME=${1:-res}
OUT=/tmp/$RES_NAME; rm -rf "$OUT"; mkdir -p "$OUT"
pack() { tar -C /tmp -cf "$FINAL/res.tar" "$RES_NAME"; }
