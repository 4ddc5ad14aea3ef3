#!/usr/bin/env bash
# Issue 7's GPU checks in one go, for the device machine (one H100, torch 2.11, lightning 2.6.6, no
# network, no hydra-core). Run from the repository root:
#
#   bash benchmarks/run_on_gpu.sh tests   # CUDA-path test + benchmark smoke test   (~3-5 min)
#   bash benchmarks/run_on_gpu.sh bench   # gpu_throughput.py, all four modes, xl   (~5-8 min)
#   bash benchmarks/run_on_gpu.sh all     # both (may not fit one 10-minute device command)
#   bash benchmarks/run_on_gpu.sh multi   # >= 2 GPUs: tests/test_multi_gpu.py (NCCL, world = all GPUs) and
#                                         # gpu_throughput.py on all GPUs under torchrun, then one table
#
# multi refuses to start with fewer than 2 visible GPUs. Its files: multi_tests.log / .xml,
# multi_benchmark.log, gpu_throughput_multi.json, multi_summary.txt (the table).
# Extra arguments after the stage go to gpu_throughput.py, e.g. `bench --modes plain,strategy`.
# Everything lands in $OUT (the device tool copies it back; default ./gpu_out elsewhere):
# env.txt, tests.log, benchmark.log, gpu_throughput.json. Copy gpu_throughput.json to
# benchmarks/results/ in the checkout and the table of benchmark.log into docs/gpu.md.
#
# The package is used from the working tree through PYTHONPATH: `pip install -e .` would need
# network access (build isolation) and hydra-core, neither of which the machine has. Nothing here
# needs hydra. Should a package be missing, carry wheels in .whl/ (ignored by git; name `.whl` in
# the device tool's `carry`), fetched on the development machine with, e.g.:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl hydra-core==1.3.2 omegaconf==2.3.0
#
# (hydra-core and omegaconf are pure-Python wheels; hydra's antlr4-python3-runtime==4.9.3 exists
# only as an sdist, so the hydra tests cannot run there -- and are not part of issue 7.)
# Do not carry torch: the machine's CUDA build is the one to measure.
set -uo pipefail
cd "$(dirname "$0")/.."

stage="${1:-all}"
shift || true
case "$stage" in tests | bench | all | multi) ;; *)
    echo "usage: $0 [tests|bench|all|multi] [gpu_throughput.py arguments...]" >&2
    exit 2
    ;;
esac

OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    "$PYTHON" - <<'EOF'
import lightning, torch
print(f"torch {torch.__version__}, lightning {lightning.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
} 2>&1 | tee "$OUT/env.txt"

status=0
if [ "$stage" = multi ]; then
    gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    if [ "${gpus:-0}" -lt 2 ]; then
        echo "run_on_gpu.sh multi needs at least 2 visible GPUs; torch sees ${gpus:-0}" \
            "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}). On one GPU run 'tests' or 'bench' instead." >&2
        exit 2
    fi
    timeout 570 "$PYTHON" -m pytest tests/test_multi_gpu.py -q -rA -p no:cacheprovider \
        --junitxml="$OUT/multi_tests.xml" 2>&1 | tee "$OUT/multi_tests.log" || status=1
    timeout 570 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
        benchmarks/gpu_throughput.py --devices "$gpus" --json "$OUT/gpu_throughput_multi.json" "$@" 2>&1 |
        tee "$OUT/multi_benchmark.log" || status=1
    "$PYTHON" benchmarks/multi_gpu_summary.py "$OUT/multi_tests.xml" "$OUT/gpu_throughput_multi.json" "$gpus" |
        tee "$OUT/multi_summary.txt" || status=1
    exit "$status"
fi
if [ "$stage" = tests ] || [ "$stage" = all ]; then
    # -rs lists skips: a skipped CUDA test here means the strategy lacks an option, not "no GPU".
    timeout 540 "$PYTHON" -m pytest tests/test_cuda_path.py tests/test_benchmark_gpu.py -q -rs -p no:cacheprovider 2>&1 |
        tee "$OUT/tests.log" || status=1
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
    timeout 570 "$PYTHON" benchmarks/gpu_throughput.py --json "$OUT/gpu_throughput.json" "$@" 2>&1 |
        tee "$OUT/benchmark.log" || status=1
fi
exit "$status"
