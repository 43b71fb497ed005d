#!/usr/bin/env bash
L=/tmp/hhab; mkdir -p $L
HH_BUILD_TARGETS="hydrahead" OUT=$L ./scripts/gpu-check --build-only > $L/build_console.txt 2>&1 || { tail -30 $L/build_console.txt; exit 1; }
CFG=scripts/gpu/configs/qwen3-1.7b.json
for v in 4 3 4 3; do
  if [ $v = 3 ]; then export HH_EXP_MINB3=1; else unset HH_EXP_MINB3; fi
  build-gpu/bin/hydrahead bench gdn --device cuda --dtype bf16 --shapes 1x64 --iters 10 --warmup 3 --reference-max-seq 0 \
    --layer-config $CFG --layer-shapes 1x131072 --ratio 7 --profile $L/p$v.json > $L/layer$v.txt 2>&1
  echo "minblocks $v: $(grep -E '^  1 x 131072' $L/layer$v.txt)"
  python3 scripts/gpu/trace_summary.py $L/p$v-layer.json --top 8 2>&1 | grep -E "kernels:|chunk_factors|flash|scan"
done
