#!/usr/bin/env bash
# Before/after on one lease: the train_step rows and host time of this tree and of out/before.
# Here: mkdir -p out/before && git archive <commit> | tar -x -C out/before
# Device: run "bash benchmarks/before_after.sh" with carry [".whl", "out/before"].
# MODELS, G, R (train_step's models and variants) and HOST_ARGS (host_time.py's) narrow it;
# ROUNDS (default 1) interleaves that many rounds of every variant; HOST=0 skips host_time.py.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 FMP_MACHINE=${FMP_MACHINE:-h200}
ROOT=$PWD
G=${G:-amp_fp16_eager,fmp_fp16_eager,fmp_fp16_eager_donate,fmp_bf16_eager,apex_o1,apex_o2}
R=${R:-amp_fp16_eager,fmp_fp16_eager,fmp_fp16_eager_donate,apex_o1,apex_o2}
MODELS=${MODELS:-gpt,resnet}
for tree in after before; do
  dir=$ROOT; [ $tree = before ] && dir=$ROOT/out/before
  mkdir -p $OUT/$tree
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout ${TS_TIMEOUT:-280} python3 benchmarks/train_step.py --models $MODELS \
     --gpt-variants $G --resnet-variants $R --steps 20 --rounds ${ROUNDS:-1} --no-unscale --out $OUT/$tree --machine $FMP_MACHINE-$tree \
     > $OUT/$tree/train_step.log 2>&1; tail -16 $OUT/$tree/train_step.log)
  [ "${HOST:-1}" = 0 ] && continue
  PYTHONPATH=/tmp/site timeout 200 python3 benchmarks/host_time.py --tree $dir ${HOST_ARGS:-} --out $OUT/$tree/host.json \
     > $OUT/$tree/host.log 2>&1; cat $OUT/$tree/host.log | cut -c1-160
done
