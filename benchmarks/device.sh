#!/usr/bin/env bash
# Run on the lent GPU machine (the device tool), from the repo root, with .whl carried:
#   bash benchmarks/device.sh verify|gpu|tests|quick|bench|all [extra args for train_step.py]
# verify: CPU suite on this torch, CUDA tests, demo, bench; gpu: the same without the suite
# optree is not installed there: it comes as a wheel in .whl/ (see benchmarks/NOTES.md).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 FMP_MACHINE=h200
OUT=${OUT:-/tmp/out}
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, optree; print('torch', torch.__version__, 'optree', optree.__version__)"
if [ "$what" = quick ]; then
    python3 -m pytest tests -q -p no:cacheprovider -o addopts="" -rA -k "compile or cuda" \
        --ignore=tests/adapters --ignore=tests/distributed --ignore=tests/test_demo.py \
        2>&1 | tee "$OUT/quick-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
    what=bench
fi
if [ "$what" = verify ]; then
    # the whole suite on this machine's torch (CPU tests in parallel, 2 threads a worker)
    OMP_NUM_THREADS=2 python3 -m pytest tests -q -p no:cacheprovider -o addopts="" \
        -m "not cuda" -n 8 --timeout 400 -rfE 2>&1 | tee "$OUT/suite.log" | tail -25
    what=gpu
fi
if [ "$what" = gpu ]; then
    # the CUDA tests one by one with their names, then the demo on the GPU; bench follows
    python3 -m pytest tests -q -p no:cacheprovider -o addopts="" -m cuda -rA \
        2>&1 | tee "$OUT/cuda-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed"
    timeout 240 python3 -m fmp.demo --device cuda --no-progress --out "$OUT/demo" 2>&1 | tee "$OUT/demo.log" | tail -12
    what=bench
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest tests -q -x -p no:cacheprovider -o addopts="" \
        --ignore=tests/adapters --ignore=tests/distributed --ignore=tests/test_demo.py \
        2>&1 | tee "$OUT/tests.log" | tail -15
    python3 -m pytest tests -q -p no:cacheprovider -o addopts="" -m cuda -rA \
        2>&1 | tee "$OUT/cuda-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 benchmarks/train_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
