#!/usr/bin/env bash
# One device session's GPU checks for issue 27, batched (a machine with one CUDA GPU, torch and
# Triton installed; run from the repository root; results under $OUT). About 4 minutes on an H200:
#   OUT=gpu_out bash benchmarks/gpu_session.sh    (AGAINST=old.py: sweep_update.py also times that triton_lookup.py)
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src:. PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
HE=("$PY" -c "import sys; from hybridembed.cli import main; sys.exit(main(sys.argv[1:]))")
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
echo "== kernel and device tests on the GPU"
timeout ${T_TESTS:-200} "$PY" -m pytest -q -p no:cacheprovider --timeout 120 \
  tests/kernels tests/api/test_convert_device.py tests/train/test_device.py tests/bench/test_bench_device.py \
  tests/modules/test_assemble.py tests/modules/test_validation.py \
  tests/distributed/test_nccl.py "tests/train/test_train_nproc.py::test_a_gpu_trainer_with_a_host_server_trains_like_the_cpu_job" > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt"
echo "== the sharded runtime at world 1 over NCCL against one CPU process"
for k in eager triton; do timeout 60 "$PY" benchmarks/nccl_probe.py --kernels $k 2>&1 | grep "nccl world"; done
echo "== the pooled forward's launch parameters"
timeout ${T_SWEEP:-100} "$PY" benchmarks/sweep_pool.py 2>&1 | grep "^copy\|^[a-z].*ids\|^  [a-z_]*=" | tee "$OUT/sweep.txt"
echo "== the fused update's launch parameters"
timeout ${T_UPDATE:-60} "$PY" benchmarks/sweep_update.py --chunks 16 32 --warps 4 8 ${AGAINST:+--against $AGAINST} 2>&1 | grep -v "Warn\|warn" | tee "$OUT/sweep_update.txt"
echo "== bench_gpu"
timeout ${T_GPU:-120} "$PY" benchmarks/bench_gpu.py --device cuda --rounds ${ROUNDS:-8} --warmup 2 --json "$OUT/bench_gpu.json" 2>&1 \
  | grep -v "Warn\|warn\|sparse_coo"
for k in triton eager; do
  echo "== tiny --full-size, kernels=$k"
  timeout ${T_TINY:-80} "${HE[@]}" bench --model tiny --full-size --device cuda --kernels $k --steps ${STEPS:-10} --warmup 3 \
    --anchors per_table,floor --json "$OUT/tiny_$k.json" --png "$OUT/x.png" 2>&1 | grep -A4 contender
  rm -f "$OUT/x.png"
done
