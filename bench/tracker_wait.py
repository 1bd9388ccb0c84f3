"""How long rank 0's training thread waits for the experiment trackers at a report, against a real MLflow server.

A report row of --metrics metrics goes to TensorBoard and to an MLflow server in its own process on loopback (SQLite
store, as tests/support/mlflow_server starts it), --reports times, two ways: the trackers' calls made on the caller's
thread (``sdtrain.train.trackers.Trackers.log_metrics``, what a report did before), and what a report does now
(``sdtrain.train.run_view.RunView.reported``: the live files' copy handed to the tracker thread). Each report's wait
is timed on the caller's thread, --gap-ms apart (the steps between two reports, a sleep here: a GPU's steps leave the
host thread mostly waiting); a checkpoint report every --every reports waits for the tracker thread, as in a run. A
server across a network adds its round trips to the first figure only.

    python bench/tracker_wait.py           # 200 reports of 20 metrics, a checkpoint every 50
    python bench/tracker_wait.py --smoke   # seconds: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from conftest import tiny_config  # noqa: E402
from support.mlflow_server import mlflow_server  # noqa: E402

from sdtrain.train.run_view import RunView  # noqa: E402
from sdtrain.train.trackers import Trackers  # noqa: E402


def row(step: int, metrics: int) -> dict[str, float]:
    return {"step": step, "loss": 1.0 / step, **{f"metric_{i}": step * 0.001 * i for i in range(metrics - 1)}}


def waits(report, reports: int, metrics: int, gap: float) -> list[float]:
    """Seconds ``report(history, step)`` took on this thread, each, ``gap`` seconds after the one before."""
    history: list[dict[str, float]] = []
    seconds = []
    for step in range(1, reports + 1):
        history.append(row(step, metrics))
        began = time.perf_counter()
        report(history, step)
        seconds.append(time.perf_counter() - began)
        time.sleep(gap)  # the steps until the next report
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="10 reports")
    parser.add_argument("--reports", type=int, help="reports each way (default 200; smoke 10)")
    parser.add_argument("--metrics", type=int, default=20, help="metrics in a report's row (default 20)")
    parser.add_argument("--every", type=int, help="a checkpoint report every this many (default 50; smoke 5)")
    parser.add_argument("--gap-ms", type=float, default=200.0, help="between two reports (default 200)")
    args = parser.parse_args()
    reports = args.reports or (10 if args.smoke else 200)
    every = args.every or (5 if args.smoke else 50)

    print(f"# {benchlib.machine()}\n# {benchlib.versions()}\n# commit {benchlib.git_commit()}")
    with tempfile.TemporaryDirectory() as directory, mlflow_server(Path(directory)) as uri:

        def config(name: str):
            trackers = ("tracking.trackers=[tensorboard, mlflow]", f"tracking.mlflow_tracking_uri={uri}")
            return tiny_config("data.train=unused", *trackers, tmp_path=Path(directory), name=name)

        before_config = config("on-the-training-thread")
        trackers = Trackers(before_config, before_config.run.directory, [])

        def on_the_training_thread(history, step):
            trackers.log_metrics(history[-1], step, history)
            if step % every == 0:
                trackers.before_checkpoint()

        before = waits(on_the_training_thread, reports, args.metrics, args.gap_ms / 1000)
        trackers.finish("success")

        now_config = config("tracker-thread")
        view = RunView(now_config, now_config.run.directory, ray_metrics=False)
        view.started([])

        def in_the_tracker_thread(history, step):
            view.reported(history[-1], history, None, checkpoint=step % every == 0)

        now = waits(in_the_tracker_thread, reports, args.metrics, args.gap_ms / 1000)
        view.finished("success")

    for label, seconds in (("on the training thread", before), ("in the tracker thread", now)):
        plain = [s for i, s in enumerate(seconds, 1) if i % every]
        checkpoints = [s for i, s in enumerate(seconds, 1) if not i % every]
        print(
            f"# {label}: a report waits {statistics.median(plain) * 1000:.2f} ms median, {max(plain) * 1000:.1f} ms "
            f"at most; a checkpoint's report {statistics.median(checkpoints) * 1000:.1f} ms median "
            f"({reports} reports of {args.metrics} metrics {args.gap_ms:g} ms apart, TensorBoard and MLflow)"
        )
    print(
        benchlib.ratio_line(
            "report wait in the tracker thread",
            statistics.median(now),
            "on the training thread",
            statistics.median(before),
            "<= 0.1",
            statistics.median(now) <= 0.1 * statistics.median(before),
        )
    )


if __name__ == "__main__":
    main()
