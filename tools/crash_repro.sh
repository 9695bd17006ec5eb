#!/usr/bin/env bash
# Issue 16's crash sequence: the ahead-of-time TPU7x compile tests (marker tpu_compile), then
# tests/test_ragged_step.py, in ONE pytest process (no xdist), RUNS times. A run crashed when pytest died by a
# signal or faulthandler printed "Fatal Python error"; its log is kept in build/crash_repro/.
# usage: tools/crash_repro.sh [RUNS=30] [extra pytest args...]
set -u
cd "$(dirname "$0")/.."
RUNS=${1:-30}; shift || true
PY=${PY:-python}
export PYTHONPATH=$PWD PYTHONFAULTHANDLER=1 JAX_PLATFORMS=cpu
mkdir -p build/crash_repro
mapfile -t AOT < <($PY -m pytest --collect-only -q -p no:xdist -m tpu_compile tests 2>/dev/null | grep '::')
[ ${#AOT[@]} -gt 0 ] || { echo "no tpu_compile tests collected: is the 'tpu' extra (libtpu) installed?"; exit 2; }
crashed=0; start=$SECONDS
for i in $(seq 1 "$RUNS"); do
  t0=$SECONDS; log=build/crash_repro/run-$i.log
  $PY -m pytest -q -p no:xdist -p no:cacheprovider "$@" "${AOT[@]}" tests/test_ragged_step.py >"$log" 2>&1; rc=$?
  if [ $rc -gt 128 ] || grep -q "Fatal Python error" "$log"; then
    crashed=$((crashed + 1)); verdict="CRASH (rc $rc, log $log)"
  else
    verdict="rc $rc: $(tail -n 1 "$log")"; rm -f "$log"
  fi
  echo "run $i/$RUNS $((SECONDS - t0)) s: $verdict"
done
echo "$crashed of $RUNS runs crashed, $((SECONDS - start)) s in all"
[ $crashed -eq 0 ]
