#!/usr/bin/env bash
# One short GPU lease, in as few commands as possible: the smoke run, the full GPU benchmark, the GPU tests.
#
#   bench/gpu/window.sh OUT_DIR [smoke] [bench] [tests]     (default: all three, in that order)
#
# Runs with the machine's own python3 (torch with CUDA; no Horovod, no `make setup`). Wheels in
# .whl/ (simplejpeg, which the CPU decode rows need) are installed first into a scratch directory.
# Everything lands in OUT_DIR as it is made (the benchmark rewrites its results after each
# section), so a run stopped at its time limit still returns what it had. BENCH_ARGS go to the
# full benchmark (for example --budget-s 400); TESTS_TIMEOUT_S (default 240) stops the tests.
set -uo pipefail
out=${1:?usage: bench/gpu/window.sh OUT_DIR [smoke] [bench] [tests]}
shift
stages=${*:-smoke bench tests}
for stage in $stages; do  # before the lease's minutes go to installing anything
  case $stage in smoke | bench | tests) ;; *) echo "error: unknown stage $stage (smoke, bench or tests)" >&2; exit 2 ;; esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
echo "cpus: $(python3 -c 'import os; print(os.cpu_count())')" | tee -a "$out/gpu.txt"

read -ra bench_args <<<"${BENCH_ARGS:-}"
for stage in $stages; do
  started=$SECONDS
  case $stage in
    smoke) python3 -m bench.gpu --smoke --out "$out/smoke" 2>&1 | tee "$out/smoke.log" | tail -30 ;;
    bench) python3 -m bench.gpu --out "$out" "${bench_args[@]}" 2>&1 | tee "$out/bench.log" | tail -60 ;;
    tests) timeout --signal INT "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -m gpu -rs -q -p no:cacheprovider \
      tests/training/test_gpu_decode_cuda.py tests/training/test_gpu_speed.py 2>&1 | tee "$out/test-gpu.log" | tail -25 ;;
  esac
  echo "== $stage: $((SECONDS - started)) s"
done
