#!/usr/bin/env bash
# Issue 7's GPU checks in one go, for the device machine (one H100, torch 2.11, lightning 2.6.6, no
# network, no hydra-core). Run from the repository root:
#
#   bash benchmarks/run_on_gpu.sh tests   # CUDA-path test + benchmark smoke test   (~3-5 min)
#   bash benchmarks/run_on_gpu.sh bench   # gpu_throughput.py, all four modes, xl   (~5-8 min)
#   bash benchmarks/run_on_gpu.sh all     # both (may not fit one 10-minute device command)
#
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
case "$stage" in tests | bench | all) ;; *)
    echo "usage: $0 [tests|bench|all] [gpu_throughput.py arguments...]" >&2
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
