#!/usr/bin/env bash
# Issue 16's crash: a test worker that has compiled thousands of programs holds 3 mappings (code, constants, data)
# per XLA:CPU kernel that jax still caches; at vm.max_map_count the next compile's mmap fails and LLVM aborts the
# process ("LLVM ERROR: Unable to allocate section memory!", "Fatal Python error: Aborted"). In `make test` that was
# tests/model/test_ragged.py's first compile, in whichever worker reached it after ~290 tests.
# Faster than a worker's whole history: tools/map_filler.py leaves only HEADROOM mappings free, tests/model/test_decoder.py
# compiles (~3500 mappings), then tests/model/test_ragged.py compiles (~3300), in ONE pytest process, RUNS times.
# Without tests/conftest.py's cache drop between modules this crashes at tests/model/test_ragged.py; a crashed run's log is
# kept in build/crash_repro/.
# usage: tools/crash_repro.sh [RUNS=30] [extra pytest args...]   (HEADROOM=4500 by default)
set -u
cd "$(dirname "$0")/.."
RUNS=${1:-30}; shift || true
PY=${PY:-python}
export PYTHONPATH=$PWD PYTHONFAULTHANDLER=1 JAX_PLATFORMS=cpu CRASH_REPRO_HEADROOM=${HEADROOM:-4500}
mkdir -p build/crash_repro
crashed=0; start=$SECONDS
for i in $(seq 1 "$RUNS"); do
  t0=$SECONDS; log=build/crash_repro/run-$i.log
  $PY -m pytest -q -s -p no:xdist -p no:cacheprovider -p tools.map_filler "$@" tests/model/test_decoder.py \
    tests/model/test_ragged.py >"$log" 2>&1; rc=$?
  if [ $rc -gt 128 ] || grep -q "Fatal Python error" "$log"; then
    crashed=$((crashed + 1)); verdict="CRASH (rc $rc, log $log: $(grep -m1 'LLVM ERROR' "$log"))"
  else
    verdict="rc $rc: $(tail -n 1 "$log")"; rm -f "$log"
  fi
  echo "run $i/$RUNS $((SECONDS - t0)) s: $verdict"
done
echo "$crashed of $RUNS runs crashed, $((SECONDS - start)) s in all"
[ $crashed -eq 0 ]
