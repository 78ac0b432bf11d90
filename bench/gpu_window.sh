#!/usr/bin/env bash
# One short GPU lease, in one command: the smoke run, the full GPU benchmark, then the GPU tests.
#
#   bench/gpu_window.sh OUT_DIR [TESTS_BUDGET_S]
#
# Runs with the machine's own python3 (torch with CUDA; no Horovod, no `make setup`). Wheels in
# .whl/ (simplejpeg, which the CPU decode rows need) are installed first into a scratch directory.
# Everything lands in OUT_DIR as it is made (the benchmark writes its results after each section),
# so a run stopped at its time limit still returns what it had. The tests get what is left of
# TESTS_BUDGET_S (default 200 s) and are stopped past it.
set -uo pipefail
out=${1:?usage: bench/gpu_window.sh OUT_DIR [TESTS_BUDGET_S]}
tests_budget=${2:-200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
echo "cpus: $(python3 -c 'import os; print(os.cpu_count())')" | tee -a "$out/gpu.txt"

started=$SECONDS
python3 -m bench.gpu --smoke --out "$out/smoke" 2>&1 | tee "$out/smoke.log" | tail -40
echo "smoke: $((SECONDS - started)) s"

started=$SECONDS
python3 -m bench.gpu --out "$out" 2>&1 | tee "$out/bench.log" | grep -v '^\s*$' | tail -60
echo "bench: $((SECONDS - started)) s"

started=$SECONDS
timeout --signal INT "$tests_budget" python3 -m pytest -m gpu -rs -q -p no:cacheprovider \
  tests/training/test_gpu_decode_cuda.py tests/training/test_gpu_speed.py 2>&1 | tee "$out/test-gpu.log" | tail -25
echo "tests: $((SECONDS - started)) s"
