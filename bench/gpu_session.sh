#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, as commands for the device tool's `run` (one phase per call,
# each well inside its 10-minute limit), so any session lent a GPU repeats them the same way.
#
# Here, once per session (the lent machine has no diffusers and no network):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl diffusers==0.42.1 importlib-metadata
# (diffusers 0.42.1 needs huggingface-hub >= 1.32: gpu.txt shows the machine's; carry a newer one if it is older)
# Then, with the device tool (carry: [".whl"]), in this order:
#   bash bench/gpu_session.sh tests         # pytest -m gpu: every option trained on CUDA
#   bash bench/gpu_session.sh 256           # bench/gpu_throughput.py at 256 px, every preset and variant
#   bash bench/gpu_session.sh 512           # the same at 512 px
# Logs land in $OUT; record the figures in bench/results/<date>-<gpu>.md with the versions printed.
set -uo pipefail
phase=${1:?usage: bench/gpu_session.sh tests|256|512}
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" >>"$out/gpu.txt"
python3 -m pip show huggingface-hub transformers lightning 2>/dev/null | grep -E "^(Name|Version)" >>"$out/gpu.txt"
case "$phase" in
  tests) python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.log" ;;
  256|512) python3 bench/gpu_throughput.py --resolutions "$phase" 2>&1 | tee "$out/gpu_throughput-$phase.log" ;;
  *) echo "unknown phase $phase: tests, 256 or 512" >&2; exit 2 ;;
esac
