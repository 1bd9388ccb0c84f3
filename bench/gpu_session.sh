#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md as ONE prepared run for the device tool's `run`, within 8 minutes on a bare
# H100 or H200 (no network, no Ray; torch, lightning and transformers are there, diffusers is carried):
#   1. the GPU test tier (pytest -m gpu: every option trained on CUDA), at most 150 s;
#   2. bench/gpu_throughput.py: small and sd2-base at 256 and 512 px, eager then compiled, at the shipped
#      micro-batches (96 and 64; halved where the memory model says they do not fit), images/s, MFU, peak allocated
#      and reserved memory beside the memory model's peak and the per-op model's images/s (predictions, labelled),
#      and one more step of each profiled: its time by kind of op beside the model's (--profile);
#      it starts no measurement that would not end in the budget, and says which it skipped;
#   3. the check job's one-GPU phase on configs/small.yaml without Ray: one worker's share of the config as
#      configured (compiled, micro-batch 96 accumulated 3 times: bench/gpu_throughput.py --config), 90 s kept for it
#      (it is skipped, and says so, where its compile is not expected to end in the time left).
#
# Here, once per session (the lent machine has no diffusers and no network):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl diffusers==0.42.1 importlib-metadata
# (diffusers 0.42.1 needs huggingface-hub >= 1.32: gpu.txt shows the machine's; carry a newer one if it is older)
# Then ONE call of the device tool:  run  command="bash bench/gpu_session.sh"  carry=[".whl"]  timeout_s=540
# A cold compile takes 4-5 minutes there, so the whole grid does not fit one call: choose with --parts (any of
# tests,throughput,check; all by default) and hand bench/gpu_throughput.py's own options after "--", e.g.
#   bash bench/gpu_session.sh --parts tests,throughput -- --presets sd2-base --resolutions 256 --variants compile
# Logs and JSON land in $OUT (7 files); record the figures in bench/results/<date>-<gpu>.md with the versions
# printed, and recalibrate the per-op model from them (tools/performance_model.py, SESSION_ROWS).
#
#   bash bench/gpu_session.sh --smoke    # here, on CPU: every step above on the tiny UNet (the dry run CI's smoke
#                                        # tests cover piecewise), so a session with a GPU runs it once
set -uo pipefail
smoke=0 parts=tests,throughput,check extra=()
while (($#)); do
  case $1 in
    --smoke) smoke=1 ;;
    --parts) parts=$2; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option $1 (--smoke, --parts tests,throughput,check, -- gpu_throughput.py options)"; exit 2 ;;
  esac
  shift
done
part() { [[ ",$parts," == *",$1,"* ]]; }
out=${OUT:-/tmp/gpu-session}
budget=${GPU_SESSION_BUDGET_S:-470}  # seconds, of the run's 480: the tool's 8-minute slot
mkdir -p "$out"
left() { echo $((budget - SECONDS)); }
if ((smoke)); then
  python=${PYTHON:-.venv/bin/python}
  export PYTHONPATH=src PYTHONUNBUFFERED=1
else
  python=python3
  timeout 60 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
fi
"$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" >>"$out/gpu.txt" 2>&1
"$python" -m pip show diffusers huggingface-hub transformers lightning 2>/dev/null | grep -E "^(Name|Version)" \
  >>"$out/gpu.txt"

# Each step logs to a file, not a pipe: inductor's compile workers outlive a timed-out python and would hold a pipe
# open (the first GPU session hung there until the device tool's limit).
touch "$out/pytest-gpu.log" "$out/throughput.log" "$out/check_phase.log"
if part tests; then
  echo "== 1. GPU tests ($(left) s left)"
  timeout -k 5 150 "$python" -m pytest -m gpu tests/test_gpu.py -x -q -p no:cacheprovider --timeout 120 \
    >"$out/pytest-gpu.log" 2>&1
  tail -n 25 "$out/pytest-gpu.log"
fi

if part throughput; then
  echo "== 2. throughput ($(left) s left)"
  keep=$(part check && echo 90 || echo 10)  # seconds left for what follows
  grid=(--profile --json "$out/throughput.json" --deadline $(($(left) - keep)) "${extra[@]}")
  ((smoke)) && grid=(--smoke --profile --json "$out/throughput.json")
  timeout -k 5 $(($(left) - keep + 10)) "$python" bench/gpu_throughput.py "${grid[@]}" >"$out/throughput.log" 2>&1
  grep -v -e Warning -e warn "$out/throughput.log"
fi

if part check; then
  echo "== 3. the check job's one-GPU phase on configs/small.yaml ($(left) s left)"
  phase=(--config configs/small.yaml --json "$out/check_phase.json" --deadline $(($(left) - 5)))
  ((smoke)) && phase=(--config configs/small.yaml --json "$out/check_phase.json" --smoke)
  timeout -k 5 $(($(left) > 10 ? $(left) : 10)) "$python" bench/gpu_throughput.py "${phase[@]}" \
    >"$out/check_phase.log" 2>&1
  grep -v -e Warning -e warn "$out/check_phase.log"
fi

grep -h -e "^RATIO" -e "^# .*predicted" -e "^# profile" -e "skipped" "$out/throughput.log" "$out/check_phase.log" \
  >"$out/summary.txt"
tail -n 3 "$out/pytest-gpu.log" >>"$out/summary.txt"
echo "== done in ${SECONDS} s; $out: $(ls "$out" | tr '\n' ' ')"
