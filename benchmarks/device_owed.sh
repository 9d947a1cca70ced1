#!/bin/bash
# What the CPU cannot check, in one device call per part (each ends inside 600 s):
#   bash benchmarks/device_owed.sh tests   # the compiled-step test traced (bisected over
#                                          # older commits if it fails), then every CUDA test
#   bash benchmarks/device_owed.sh eager   # eager rows incl. _halfnorm (3 rounds), the ResNet-50
#                                          # kernel breakdown amp vs fmp, float8 memory sites
#   bash benchmarks/device_owed.sh compiled eager-rows breakdown f8mem   # parts, in one call
#   (batched: the CUDA tests of the grouped buffer clone and select, fmp/_batched.py;
#    graph: the six GPT-2 graph variants of issue 18, ~430 s;
#    f8upd: float8.py's eager-update fmp variants against torchao and amp bf16, F8_VARIANTS)
# (tests = compiled + bisect + cuda; eager = eager-rows + breakdown + f8mem)
# carry [".whl", "out"] (optree, torchao wheels; see the device README's Notes). Logs and JSON in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print(torch.__version__)"
T='tests/test_cuda.py::test_cuda_compiled_step_matches_eager'
P='-q -o addopts= -p no:cacheprovider -p no:logging --tb=long'
rc=0
parts=""
for a in "$@"; do
  case "$a" in tests) parts+=" compiled bisect cuda" ;; eager) parts+=" eager-rows breakdown f8mem" ;;
  *) parts+=" $a" ;; esac
done
for part in $parts; do
case "$part" in
compiled)
timeout 120 python3 -m pytest $P "$T" tests/test_cuda.py::test_cuda_plain_torch_compile_needs_the_workaround 2>&1 | tee $OUT/failing_head.log | tail -40
rc=${PIPESTATUS[0]}
echo "compiled rc=$rc"
;;
bisect)
for b in inductor aot_eager; do timeout 60 python3 benchmarks/compiled_step_trace.py $b 2>&1 | grep -v DEBUG | tail -8; done
for c in 6169070 2a03010 1a723d5; do
  # the trees come carried (out/bisect/<commit>: git archive <commit> fmp tests adapters
  # pyproject.toml); the device's copy of the checkout has no .git
  w=$PWD/out/bisect/$c; [ -d "$w" ] || { echo "[$c] not carried"; continue; }
  (cd "$w" && PYTHONPATH=/tmp/site:$w timeout 60 python3 -m pytest $P "$T[torch.compile]" 2>&1 | tail -3 | sed "s/^/[$c] /")
done
;;
cuda)
timeout $((575 - SECONDS)) python3 -m pytest $P -m cuda tests/ --durations=12 --deselect "$T" 2>&1 | tee $OUT/cuda_all.log | tail -30
;;
graph)
# issue 18: the GPT-2 graph steps, compiled and eager (fused) update, against torch.amp's
timeout $((585 - SECONDS)) python3 benchmarks/train_step.py --isolate --variant-timeout 200 --no-unscale --models gpt --gpt-variants fmp_fp16_graph_eagerupd,amp_graph_fp16,fmp_fp16_graph,fmp_bf16_graph_eagerupd,amp_graph_bf16,fmp_bf16_graph --steps 20 --warmup 5 --out $OUT/graph --machine dev 2>&1 | grep -v DEBUG | tail -40
;;
eager-rows)
timeout 200 python3 benchmarks/train_step.py --models gpt,resnet --gpt-variants amp_fp16_eager,fmp_fp16_eager_donate,fmp_fp16_eager_donate_halfnorm,apex_o2 --resnet-variants amp_fp16_eager,fmp_fp16_eager_donate,apex_o2 --steps 20 --rounds 3 --no-unscale --out $OUT/eager --machine dev 2>&1 | grep -v DEBUG | tail -25
;;
batched)
timeout 90 python3 -m pytest $P -m cuda tests/test_batched_small.py tests/test_step_buffers.py tests/test_cuda.py -k "batch or buffer or bn or skip" 2>&1 | tail -6
;;
breakdown)
timeout 150 python3 benchmarks/breakdown.py --variants resnet:amp_fp16_eager,resnet:fmp_fp16_eager_donate --variant-timeout 70 --out $OUT/breakdown_resnet.json 2>&1 | grep -v DEBUG | tail -25
;;
f8upd)
# issue 19: the float8 step with the eager (fused, in-place) update against torchao and amp bf16
(cd benchmarks && timeout $((590 - SECONDS)) python3 float8.py --variants ${F8_VARIANTS:-amp_bf16,torchao_tensorwise,fmp_fp8_dynamic_eagerupd,fmp_bf16_eagerupd,fmp_fp8_best_graph} --budget-s $((570 - SECONDS)) --json $OUT/f8upd.json 2>&1 | grep -v DEBUG | tail -30)
;;
f8mem)
(cd benchmarks && timeout $((590 - SECONDS)) python3 float8.py --steps 4 --warmup 2 --variants amp_bf16,fmp_bf16 --memory-sites --budget-s $((560 - SECONDS)) --json $OUT/f8mem.json 2>&1 | grep -v DEBUG | tail -30)
;;
*) echo "usage: $0 tests|eager|compiled|bisect|cuda|batched|graph|eager-rows|breakdown|f8mem|f8upd ..."; exit 2 ;;
esac
done
exit $rc
