#!/usr/bin/env bash
# Prepared GPU check for the Triton kernels (issue "Triton kernels for the decode and scoring hot paths").
#
#   benchmarks/gpu_check.sh            # on one NVIDIA GPU: ~4 min on an H200 (estimate), < 8 min budget
#   benchmarks/gpu_check.sh --smoke    # CPU dry run (~1.5 min): interpreter tests, sm_90 compile, tiny benchmark
#
# Needs a Python environment with a CUDA build of torch, triton and this package installed
# (`pip install -e '.[test]'`); it installs nothing. Steps:
#   1. the kernel tests on CUDA (tests/test_kernels.py, the `gpu`-marked larger shapes included);
#   2. benchmarks/decode_bench.py: a random-init Llama-3.1-8B-sized model (bf16) at 32K/64K/128K
#      context, rocketkv at budgets 256 and 1024 vs full attention (SDPA), printing the speedup and
#      the sparse attention kernel's achieved bandwidth as a fraction of the device's peak.
# Output goes to stdout and to docs/bench/gpu_check.{txt,json}; copy the numbers to docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=docs/bench
mkdir -p "$out"
start=$(date +%s)

if [ "${1:-}" = "--smoke" ]; then
    export TRITON_INTERPRET=1
    echo "== smoke: kernel tests under the Triton interpreter (CPU)"
    timeout 300 "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider; tests_rc=$?
    echo "== smoke: compile every kernel for sm_90 without a GPU (what the interpreter does not check)"
    env -u TRITON_INTERPRET timeout 300 "$PY" benchmarks/compile_check.py || tests_rc=1
    echo "== smoke: decode benchmark, tiny model on CPU (numbers meaningless; proves the script runs)"
    timeout 300 "$PY" benchmarks/decode_bench.py --smoke; bench_rc=$?
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "no NVIDIA GPU"; exit 1; }
    "$PY" -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'torch has no CUDA';
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" || exit 1
    unset TRITON_INTERPRET
    echo "== kernel tests on CUDA (small odd shapes + gpu-marked large shapes)"
    timeout 240 "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider -rs --durations=5; tests_rc=$?
    echo "== decode latency and sparse-kernel bandwidth"
    timeout 300 "$PY" benchmarks/decode_bench.py --json "$out/gpu_check.json" | tee "$out/gpu_check.txt"
    bench_rc=${PIPESTATUS[0]}
fi
echo "== done in $(( $(date +%s) - start )) s: kernel tests rc=$tests_rc, benchmark rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
