#!/usr/bin/env bash
# Issue 19 on the lent GPU machine (the device tool), from the repo root, with .whl carried
# (optree and torchao 0.17.0, the torchao release built against torch 2.11):
#   bash benchmarks/issue19.sh part1   # float8: fmp.float8 vs torchao float8 vs torch.amp bf16
#   bash benchmarks/issue19.sh part2   # bf16 without float32 masters on GPT-2 small
# Each part writes one JSON and one log under $OUT and stays within ~500 s on an H200
# (cold compiles included): the scripts skip variants that no longer fit their budget and
# every python call runs under `timeout`. Extra arguments go to the part's script.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 FMP_MACHINE=${FMP_MACHINE:-h200}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 60 python3 -c "import torch, optree, torchao, fmp; print('torch', torch.__version__, \
'optree', optree.__version__, 'torchao', torchao.__version__, 'fmp.float8', hasattr(fmp, 'float8'))" \
    2>&1 | grep -v "^W\|Failed to load"
case "$what" in
part1)
    # ~7 variants x (~15 s start + ~45 s compile + 200 steps x 70-95 ms): ~430 s estimated
    timeout 540 python3 benchmarks/float8.py --budget-s 480 --json "$OUT/issue19-part1.json" "$@" \
        2>&1 | tee "$OUT/issue19-part1.log" | grep -v "^W1\|Failed to load" | tail -40 ;;
part2)
    # 4 variants x (~15 s start + ~30 s compile + 500 steps x ~40 ms): ~260 s estimated
    timeout 540 python3 benchmarks/bf16_masterless.py --budget-s 480 \
        --json "$OUT/issue19-part2.json" "$@" \
        2>&1 | tee "$OUT/issue19-part2.log" | grep -v "^W1\|Failed to load" | tail -40 ;;
*)
    echo "usage: bash benchmarks/issue19.sh part1|part2 [script args]" >&2; exit 2 ;;
esac
