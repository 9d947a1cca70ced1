#!/usr/bin/env bash
# Issue 18 on the lent GPU machine (the device tool), from the repo root, with .whl carried:
#   bash benchmarks/issue18.sh part1   # GPT-2 small: fmp vs the graphed torch.amp peer, fp16
#                                      # + bf16 (a process each, cold cache); eager GPT-2 and
#                                      # ResNet-50; ratios                      (~420-480 s)
#   bash benchmarks/issue18.sh part2   # kernel-time breakdown of fmp's and the peer's graphed
#                                      # steps, fp16 and bf16 (a process each)   (~350-420 s)
#   bash benchmarks/issue18.sh part3   # the peer's GradScaler-in-graph CUDA test; then
#                                      # GPT-2 medium bf16: fmp graph, peer graph, eager amp
#   bash benchmarks/issue18.sh part4   # GPT-2 medium fp16: the same            (~250-450 s each)
# Each part writes one JSON and one log under $OUT (2 files a part). The eager bf16 and fp16
# references of the loss check run inside each part. To put the medium rows beside part1's
# (part1's ratios are from one run; merging only adds the gpt_medium keys):
#   python benchmarks/train_step.py --merge part1.json part3.json part4.json --out DIR --machine h200
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 FMP_MACHINE=h200
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
part=${1:?usage: issue18.sh part1|part2|part3|part4}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, optree; print('torch', torch.__version__, 'optree', optree.__version__)"
TS="timeout -k 10"
case "$part" in
part1)
    $TS 570 python3 benchmarks/train_step.py --isolate --variant-timeout 240 --no-unscale \
        --models gpt,resnet \
        --gpt-variants amp_fp16_eager,fmp_fp16_eager_donate,amp_graph_fp16,fmp_fp16_graph,amp_graph_bf16,fmp_bf16_graph \
        --resnet-variants amp_fp16_eager,fmp_fp16_eager_donate \
        --steps 20 --warmup 5 --out /tmp/p1 --machine part1 2>&1 | tee "$OUT/part1.log" | tail -45
    cp /tmp/p1/part1-*.json "$OUT/part1.json" ;;
part2)
    $TS 570 python3 benchmarks/breakdown.py --variant-timeout 200 --steps 5 \
        --variants gpt:fmp_fp16_graph,gpt:amp_graph_fp16,gpt:fmp_bf16_graph,gpt:amp_graph_bf16 \
        --out "$OUT/part2.json" 2>&1 | tee "$OUT/part2.log" | tail -25 ;;
part3|part4)
    p=bf16; [ "$part" = part4 ] && p=fp16
    if [ "$part" = part3 ]; then  # GradScaler inside the peer's graph: skip + backoff (~30 s)
        $TS 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA \
            tests/test_bench18_peer_cuda.py 2>&1 | tee "$OUT/$part.log" | tail -3
    fi
    $TS 570 python3 benchmarks/train_step.py --isolate --variant-timeout 420 --no-unscale \
        --models gpt_medium --gpt-medium-variants amp_${p}_eager,amp_graph_${p},fmp_${p}_graph \
        --steps 20 --warmup 5 --out /tmp/p3 --machine "$part" 2>&1 | tee -a "$OUT/$part.log" | tail -30
    cp /tmp/p3/$part-*.json "$OUT/$part.json" ;;
*) echo "unknown part $part (part1|part2|part3|part4)"; exit 2 ;;
esac
