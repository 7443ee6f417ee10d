#!/usr/bin/env bash
# The 4-bit comparison of issue #15 on the default model: every variant in bench/variants/
# (or the names given) through `quantize run` into runs/sweep/<name>, one after another
# (a failed gate does not stop the sweep), then `quantize compare` over them.
set -u
cd "$(dirname "$0")/.."
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(gptq-asym gptq-asym-mse gptq-asym-imatrix rtn-asym gptq-asym-weight \
  gptq-asym-128x512 gptq-asym-damp05 rtn-asym-mse gptq-asym-imatrix-weight autoround-sym \
  awq-gptq-asym gptq-asym-128x2048)
mkdir -p runs/sweep
for n in "${names[@]}"; do
  src=bench/variants/$n.yaml; [ -f "$src" ] || src=$n
  echo "== $n $(date +%T)"
  .venv/bin/quantize run "$src" --model default --out "runs/sweep/$n" > "runs/sweep/$n.log" 2>&1
  echo "   exit $? $(date +%T)"
done
