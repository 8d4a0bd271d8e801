#!/usr/bin/env bash
# The GPU checks of cct in one call (on a GPU machine, from the checkout root, after ../shared/gpu/prepare.sh
# filled .gpu/ on the development machine): GPU tests, bench_gpu.py (cct eager/graphs/TF32 vs PyTorch
# FP32/default/captured), bench_infer.py's GPU rows (dense inference), bench_gpu_train.py (the README's main job
# vs a PyTorch loop on the same LMDB). About seven minutes on an H200; logs and JSON go to $OUT. ROUNDS /
# ITERATIONS shorten the main-job comparison.
set -o pipefail
T0=$(date +%s); OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD CCT_SHARED_DIR=$PWD/.gpu
nvidia-smi -L; lscpu | grep "Model name"
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" 2>/dev/null
echo "== GPU tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_gpu_*.py tests/test_lowering_types.py \
  > "$OUT/tests.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | head -30
echo "== bench_gpu"
timeout 150 python3 benchmarks/bench_gpu.py --rounds 3 --iters 10 --out "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - T0 )) s)"; grep -v '^[IWE][0-9]' "$OUT/bench_gpu.log" | tail -24
echo "== dense inference on the GPU (issue 31: gpu, gpu+host, cpu-gpu rows against cct-mpf on the CPU)"
timeout 150 python3 benchmarks/bench_infer.py --nets n337:8:1,2 --runs 3 --methods cct-mpf,gpu,gpu+host,cpu-gpu \
  --device_budget 64M --out "$OUT/bench_infer_gpu.json" > "$OUT/bench_infer_gpu.log" 2>&1
echo "infer rc=$? ($(( $(date +%s) - T0 )) s)"; grep -v '^[IWE][0-9]' "$OUT/bench_infer_gpu.log" | tail -8
echo "== main job vs PyTorch"
timeout 200 python3 benchmarks/bench_gpu_train.py --iterations "${ITERATIONS:-10000}" --rounds "${ROUNDS:-3}" \
  --out "$OUT/bench_gpu_train.json" > "$OUT/bench_gpu_train.log" 2>&1
echo "train rc=$? ($(( $(date +%s) - T0 )) s)"; tail -6 "$OUT/bench_gpu_train.log"
echo "== done ($(( $(date +%s) - T0 )) s)"
