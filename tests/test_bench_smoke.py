"""Each benchmark in bench/ runs (--smoke: tiny sizes, seconds) and prints its ratio lines.

Not timed tests: the figures of a smoke run mean nothing; bench/results/ has the real ones.
"""

import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO  # noqa: E402

pytestmark = pytest.mark.slow  # each benchmark runs in its own process, most with a Ray cluster

# A benchmark that trains under Ray Train runs in the Ray lane of `make test` (tests/conftest.py): two Ray Train runs
# at once on two cores starve each other, and a stall watchdog or a reclaim deadline of the other lane's must not
# share the cores with one. The others (Ray Data, tasks, or no Ray) stay in this file's lane beside them.
ray_train = pytest.mark.ray

RATIO = re.compile(r"^RATIO (.+?) = (-?[0-9.]+|nan|inf)", re.M)


def run_bench(*args: str, timeout: int = 240) -> tuple[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    # Its own process group: on a timeout, the script's measurement children (each with its own
    # Ray cluster) go with it instead of living on.
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(args)} ran past {timeout} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    ratios = {name: float(value) for name, value in RATIO.findall(stdout)}
    return stdout, ratios


def test_ingest_smoke():
    """Throughput of the three paths, then memory at 1x (those same runs) and 2x."""
    out, ratios = run_bench("bench/ingest.py", "--smoke")
    for path in ("pyarrow", "pandas", "sdtrain"):
        assert re.search(rf"^float16\s+{path}\s+\d+", out, re.M), out
    assert "ingest float16 steady sdtrain / pyarrow limit" in ratios, out
    assert "ingest float16 end-to-end sdtrain / pyarrow limit" in ratios, out
    assert "ingest float16 end-to-end sdtrain / pandas notebook" in ratios, out
    assert "memory sdtrain peak PSS at 2x / at 1x" in ratios, out
    assert "memory pandas peak PSS at 2x / at 1x" in ratios, out
    assert all(value > 0 for value in ratios.values()), ratios


@ray_train
def test_step_overhead_smoke():
    out, ratios = run_bench("bench/step_overhead.py", "--smoke")
    assert "steps/s full path / bare loop" in ratios, out
    assert "data wait / step time" in ratios, out
    assert "time to first step / steady step time" in ratios, out
    assert ratios["steps/s full path / bare loop"] > 0, out
    assert 0 <= ratios["data wait / step time"] < 1, out


@ray_train
def test_checkpoint_stall_smoke():
    """Async and sync uploads to a bucket of a moto server: both runs report their stalls."""
    out, ratios = run_bench("bench/checkpoint_stall.py", "--smoke")
    assert re.search(r"^async: checkpoint \d+ MB .* stall per checkpoint [0-9.]+ s", out, re.M), out
    assert re.search(r"^sync : checkpoint \d+ MB .* stall per checkpoint [0-9.]+ s", out, re.M), out
    assert ratios["checkpoint stall async / sync"] > 0, out


@ray_train
def test_preemption_check_smoke():
    """The workers' check for a reclaim notice, timed in a real worker group: its share of training time."""
    out, ratios = run_bench("bench/preemption_check.py", "--smoke")
    assert re.search(r"^1 worker\(s\): [0-9.]+ ms per ray\.train\.get_preemption_info\(\)", out, re.M), out
    assert 0 < ratios["preemption checks / training time at 1 worker(s)"] < 1, out


def test_micro_batch_syncs_smoke():
    """Two gloo ranks' host syncs between micro-batches: Lightning's loop on the main thread, sdtrain's in a thread."""
    out, ratios = run_bench("bench/micro_batch_syncs.py", "--smoke")
    assert ratios["host syncs per micro-batch, sdtrain"] == 0, out
    assert ratios["host syncs per micro-batch, lightning"] > 0.5 and ratios["steps/s sdtrain / lightning"] > 0, out


def test_scheduler_spin_smoke():
    """The package's stream with and without its scheduling pace: both runs report their figures."""
    out, ratios = run_bench("bench/scheduler_spin.py", "--smoke")
    for mode in ("unpaced", "paced"):
        assert re.search(rf"^{mode}\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+\d+$", out, re.M), out
    assert ratios["consumer steps/s paced / unpaced"] > 0, out
    assert "scheduler CPU paced / unpaced" in ratios, out


def test_gpu_throughput_smoke():
    """On CPU with the tiny UNet: the Ray worker's module and Trainer (sdtrain.train.build), the FLOP
    count and the MFU arithmetic run, and Ray is never imported (a lent GPU machine has none); then what
    configs/small.yaml's workers run (its options, eager on CPU, and 3 accumulated micro-batches at 4 workers; the
    smoke's micro-batch of 4 for its 96), with the memory model's and the per-op model's predictions. The first run
    profiles one more step by kind of op (--profile)."""
    code = (
        "import runpy, sys; sys.argv = ['bench/gpu_throughput.py', '--smoke', '--profile']; "
        "runpy.run_path('bench/gpu_throughput.py', run_name='__main__'); "
        "sys.argv = ['bench/gpu_throughput.py', '--smoke', '--config', 'configs/small.yaml']; "
        "runpy.run_path('bench/gpu_throughput.py', run_name='__main__'); "
        "print('RATIO modules from ray =', sum(m == 'ray' or m.startswith('ray.') for m in sys.modules))"
    )
    out, ratios = run_bench("-c", code)
    assert ratios["modules from ray"] == 0, out
    assert "MFU tiny 128px eager" in ratios, out
    assert "img/s per GPU tiny 128px eager / MosaicML SD2 per A100 at 256px" in ratios, out
    assert ratios["MFU tiny 128px eager"] > 0, out
    # --profile: one more step, its time split as the per-op model splits its prediction (CPU time here).
    kinds = ("matmul", "conv", "attention", "memory", "optimizer")  # bench/step_profile.py's PROFILE_KINDS
    profiled = {kind: ratios[f"profile measured / predicted {kind} tiny 128px eager"] for kind in kinds}
    assert all(ratio > 0 for ratio in profiled.values()), out
    line = re.search(r"^# profile tiny 128px eager: one step ([0-9.]+) s wall; (.*)$", out, re.M)
    assert line, out
    by_kind = [float(seconds) for seconds in re.findall(r"\w+ ([0-9.]+) s \(model", line[2])]
    assert len(by_kind) == len(kinds) and sum(by_kind) <= float(line[1]), out
    assert re.search(r"^tiny\s+128 config\s+4\s+[0-9.]+", out, re.M), out
    assert ratios["MFU tiny 128px config"] > 0, out
    assert re.search(r"^# tiny 128px config: predicted peak [0-9.]+ GiB$", out, re.M), out
    assert re.search(r"^# tiny 128px config: predicted [0-9.]+ img/s on a H100 SXM \(per-op model", out, re.M), out


def test_fsdp_memory_smoke():
    """2 gloo ranks, tiny UNet: FSDP2 holds half of DDP's state per rank and skips a one-rank NaN on both."""
    out, ratios = run_bench("bench/fsdp_memory.py", "--smoke")
    assert 0.45 < ratios["state per rank fsdp2 / ddp"] < 0.55, out
    assert "fsdp2           " in out and out.count("True") >= 4, out


def test_preprocess_throughput_smoke():
    out, ratios = run_bench("bench/preprocess_throughput.py", "--smoke")
    assert ratios["images/s end to end"] > 0, out


def test_encoder_throughput_smoke():
    """SD 2's VAE and text encoder at full size, random weights, on CPU at 64 px; Ray is never imported (a lent GPU
    machine has none)."""
    code = (
        "import runpy, sys; sys.argv = ['bench/encoder_throughput.py', '--smoke']; "
        "runpy.run_path('bench/encoder_throughput.py', run_name='__main__'); "
        "print('RATIO modules from ray =', sum(m == 'ray' or m.startswith('ray.') for m in sys.modules))"
    )
    out, ratios = run_bench("-c", code)
    assert ratios["modules from ray"] == 0, out
    assert ratios["encode images/s at 64 px"] > 0 and ratios["cpu stage images/s per core at 64 px"] > 0, out


def test_marker_digest_smoke():
    """A preprocessing re-run's planning with and without the digest of the done shards' markers."""
    out, ratios = run_bench("bench/marker_digest.py", "--smoke")
    assert ratios["planning with the digest / every marker read"] > 0, out
    assert "none read" in out and "the digest at 20,000 shards" in out, out


def test_footer_reads_smoke():
    """A first start's footer reads at the old 16 at a time and at DRIVER_READS, with simulated request latency."""
    out, ratios = run_bench("bench/footer_reads.py", "--smoke")
    assert ratios["footers 128 at a time / 16 at a time"] > 0, out


def test_tracker_wait_smoke():
    """A report's wait for TensorBoard and a real MLflow server, on the training thread and in the tracker thread."""
    out, ratios = run_bench("bench/tracker_wait.py", "--smoke")
    assert ratios["report wait in the tracker thread / on the training thread"] > 0, out
    assert "# in the tracker thread: a report waits" in out and "# on the training thread: a report waits" in out, out


def test_data_scale_smoke():
    """The plan and read tasks at 1M and 10M rows, of one shape and in 40 aspect-ratio buckets, the replay after
    world-size changes, then the restart start-up against an S3 server process."""
    out, ratios = run_bench("bench/data_scale.py", "--smoke")
    assert ratios["task_bytes_10M / task_bytes_1M"] > 0 and ratios["rank_s_10M / 2s"] > 0, out
    assert ratios["bucketed_task_bytes_10M / bucketed_task_bytes_1M"] > 0 and ratios["bucketed_rank_s_10M / 2s"] > 0, (
        out
    )
    assert ratios["resize_rank_s_4 / resize_rank_s_2"] > 0 and "after 4 resizes (16 and 15 ranks" in out, out
    assert ratios["resize_controller_s_4 / resize_controller_s_2"] > 0 and "the whole epoch's replay after 2" in out, (
        out
    )
    assert ratios["restart_with_index_100 / restart_with_index_20"] > 0, out
    assert "(100 from the index, 0 footers read)" in out, out
    assert ratios["restart_on_output_100 / restart_on_output_20"] > 0, out
    assert "100 in 1 directory unchanged since their directory index, not listed" in out, out


def test_read_amplification_smoke():
    """From the read plans alone: bucketed reads grow with the world size at 64-row groups, turns' do not; on files
    with a row group starting at each run, turns read about what they use; one shape's stay near 1."""
    out, ratios = run_bench("bench/read_amplification.py", "--smoke", timeout=60)
    one_shape = ratios["rows read / trained on, one shape, 64-row groups, W=256"]
    turns = ratios["rows read / trained on, turns/start, 64-row groups, W=256"]
    assert 1 <= one_shape < turns < ratios["rows read / trained on, buckets/start, 64-row groups, W=256"] / 2, out
    assert 1 <= ratios["rows read / trained on, turns/runs, 64-row groups, W=256"] < turns, out
    assert ratios["rows read / trained on, buckets/runs, 8-row groups, W=256"] >= 1, out
    assert ratios["files opened per row, buckets / one shape, W=8"] > 0, out


def test_caption_modes_smoke():
    """Storage, data path, FLOPs and step time of captions as embeddings against token ids."""
    out, ratios = run_bench("bench/caption_modes.py", "--smoke")
    assert 0 < ratios["bytes_per_row_token_ids_sd2_256px / embeddings"] < 1, out
    assert ratios["text_encoder_forward_flops_sd2-base / unet_train_step_flops"] > 0, out
    assert ratios["tiny_step_s_token_ids / embeddings"] > 0, out


@pytest.mark.parametrize(
    "script",
    [
        "caption_modes.py",
        "data_scale.py",
        "ingest.py",
        "step_overhead.py",
        "checkpoint_stall.py",
        "gpu_throughput.py",
        "scheduler_spin.py",
        "fsdp_memory.py",
        "preprocess_throughput.py",
        "encoder_throughput.py",
        "preemption_check.py",
    ],
)
def test_help(script):
    out, _ = run_bench(f"bench/{script}", "--help", timeout=60)
    assert "--smoke" in out


def test_gpu_session_runs_the_parts_asked_for_and_refuses_an_unknown_option(tmp_path):
    """bench/gpu_session.sh's --parts (a lent GPU's call holds only some of its steps), here its dry run's tests step
    alone: the other steps do not start, and the summary is written."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "bench/gpu_session.sh", "--smoke", "--parts", "tests"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "== 1. GPU tests" in run.stdout and "== 2." not in run.stdout and "== 3." not in run.stdout, run.stdout
    assert "skipped" in (tmp_path / "pytest-gpu.log").read_text()  # no CUDA here: the tier skips, not fails
    assert (tmp_path / "summary.txt").exists() and not (tmp_path / "throughput.json").exists()
    wrong = subprocess.run(
        ["bash", "bench/gpu_session.sh", "--part", "tests"], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert wrong.returncode == 2 and "unknown option --part" in wrong.stdout, wrong.stdout


def test_realign_cost_smoke():
    """An old bucketed shard's realigned copy beside a plain copy and the whole-table rewrite; the driver's plan."""
    out, ratios = run_bench("bench/realign_cost.py", "--smoke", timeout=120)
    assert ratios["realign peak memory / file size"] > 0 and ratios["realign s / copy s"] > 0, out
    assert "half done:" in out and "CPU-hours of rewriting" in out, out
