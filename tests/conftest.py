"""Shared fixtures: parquet writers for every encoding, the tiny training config, and one small real Ray cluster
per session."""

from __future__ import annotations

import os

# One torch (OpenMP) thread in each lane's process and every process it starts, as Ray gives each 1-CPU worker. The
# lanes share 2 cores with the Ray workers: a tiny UNet's step at torch's default of 2 threads took 1.45x the CPU time
# of one thread alone, and 4.3x beside two busy 1-thread processes, its threads spinning in OpenMP's waits
# (bench/results/2026-11-30-suite-threads.md). Set before anything imports torch, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _pytest.nodeid import NodeId
from s3_server import moto_server
from support import environment
from support.mlflow_server import mlflow_server
from support.ray_processes import committed_checkpoints  # noqa: F401  (tests import it from here)

from sdtrain.logs import configure_logging

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tools/ (the docs generators the tests hold the docs to)
    sys.path.append(str(REPO))
BIN = Path(sys.executable).parent

# Ray Train's controller polls its worker group every 2 s (Ray's default): a worker group's start, its end and a
# failure each wait for a poll, seconds of a test run that trains for seconds. The session's runs poll every 0.5 s:
# those in this process, and those of the processes and clusters it starts, which inherit the variable. Users' runs
# keep Ray's default, which a cluster of hundreds of workers needs.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# A raylet keeps as many idle worker processes as its node has CPUs (2 here) and ends the others after 1 s idle; a run's
# Ray Data tasks then start new ones, each importing Ray and the read path again (~1 s of CPU). A run of
# test_train_ray's started 21 such processes at Ray's defaults and 12 with these, in every cluster this session starts.
os.environ.setdefault("RAY_num_workers_soft_limit", "8")
os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", "60000")

# The driver's lines, as the command lines print them, for tests that call the driver's functions in this process (and
# to pytest's log capture too).
configure_logging(propagate=True)

ENCODINGS = ("list", "fixed_size_list", "tensor")


def column(values: np.ndarray, encoding: str) -> pa.Array:
    """Rows of ``values`` (N, *shape) as one arrow column in the given encoding."""
    n = len(values)
    if encoding == "tensor":
        from ray.data.extensions import ArrowTensorArray

        return ArrowTensorArray.from_numpy(values)
    width = int(np.prod(values.shape[1:]))
    flat = pa.array(values.reshape(n, width).ravel())
    if encoding == "fixed_size_list":
        return pa.FixedSizeListArray.from_arrays(flat, width)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)), flat)


def write_latents(
    path: Path,
    rows: int = 8,
    encoding: str = "list",
    latent_shape=(4, 16, 16),
    caption_shape=(77, 32),
    dtype=np.float16,
    latent_column: str = "image_latents_256",
    caption_column: str = "caption_latents",
    seed: int = 0,
    row_group_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Write a parquet file of random latents and captions; return what was written."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((rows, *latent_shape)).astype(dtype)
    captions = rng.standard_normal((rows, *caption_shape)).astype(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": pa.array(np.arange(rows)),
            latent_column: column(latents, encoding),
            caption_column: column(captions, encoding),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return latents, captions


def token_id_table(latents: np.ndarray, text_encoder: str, seed: int = 0) -> pa.Table:
    """``latents`` with captions as random token ids of ``text_encoder``'s tokenizers (77 int32 a row in caption_ids;
    SDXL's second tokenizer's in caption_ids_2), the schema metadata naming the encoder, the vocabulary and the id
    columns, as preprocessing writes them."""
    import json

    from sdtrain.data.metadata import TEXT_ENCODER_SOURCE, TOKEN_ID_COLUMNS, TOKEN_VOCAB_SIZE
    from sdtrain.model.encoders import load_tokenizers

    tokenizers = load_tokenizers(text_encoder)
    vocab = min(len(tokenizer) for tokenizer in tokenizers)  # an id every tokenizer knows
    ids = np.random.default_rng(seed).integers(0, vocab, (len(tokenizers), len(latents), 77)).astype(np.int32)
    names = ["caption_ids", "caption_ids_2"][: len(tokenizers)]
    table = pa.table(
        {
            "image_latents_256": column(latents, "list"),
            **{name: column(i, "list") for name, i in zip(names, ids, strict=True)},
        }
    )
    metadata = {TEXT_ENCODER_SOURCE: text_encoder, TOKEN_VOCAB_SIZE: str(vocab), TOKEN_ID_COLUMNS: json.dumps(names)}
    return table.replace_schema_metadata(metadata)


def tiny_config(
    *overrides: str,
    tmp_path: Path | None = None,
    name: str | None = None,
    steps: int | None = None,
    batch: int | None = None,
    workers: int | str | None = None,
):
    """The tests' training config: the code's defaults with the tiny UNet (model.preset=tiny), then ``overrides``
    (``key.sub=value``, in order), then the keywords, each only when given: run.storage_path={tmp_path}/runs,
    run.name, train.max_steps, train.global_batch_size, scaling.num_workers."""
    from sdtrain.config.loader import load_config

    keys = ["model.preset=tiny", *overrides]
    if tmp_path is not None:
        keys.append(f"run.storage_path={tmp_path}/runs")
    for key, value in (
        ("run.name", name),
        ("train.max_steps", steps),
        ("train.global_batch_size", batch),
        ("scaling.num_workers", workers),
    ):
        if value is not None:
            keys.append(f"{key}={value}")
    return load_config(None, keys)


# The thread settings this session started with. Lightning's launcher for an in-process FSDP or DDP fit sets
# OMP_NUM_THREADS in this process where it is unset (cores / processes: 2 here), and every Ray cluster a later test
# started inherited it: Ray then left each 1-CPU train worker 2 torch threads instead of 1, and two workers on 2 cores
# trained 3-4x slower (test_train_ray's runs, last in the suite, took ~50 s more each).
THREAD_ENV = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The lanes of ``make test`` (pytest-xdist's ``--dist loadgroup``): every test on a Ray cluster (the session's,
    or one of its own: marked ``ray``) in one group, so they run one after another in one process; a reclaim deadline,
    a stall watchdog or a job stopped mid-run must not share two cores with another Ray run. Each other test is
    grouped with its file, so that a module's fixtures are built once. In an xdist worker the Ray group comes first
    (the Makefile keeps collection order: it is the longest), the session cluster's tests before those that start
    their own. Without xdist the marks do nothing and the order is the files'."""

    def lane(item: pytest.Item) -> int:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            return 0
        return 1 if item.get_closest_marker("ray") is not None else 2

    in_lanes = getattr(config.option, "loadgroup", False)  # set in xdist's workers, which collect
    for item in items:
        group = "ray" if lane(item) < 2 else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
        if in_lanes:
            # xdist 3.8 groups by an "@group" suffix of the id its workers send, which it sets on item._nodeid;
            # pytest 9 derives nodeid from item._id, so without this every test would be a group of its own.
            item._id = NodeId.parse(f"{item.nodeid}@{group}")
    if in_lanes:
        items.sort(key=lane)  # stable: each lane keeps the files' order


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves the environment as it found it (support.environment), and the thread settings as the session
    started with them (THREAD_ENV: a module's fixture may have fitted in this process before the test)."""
    try:
        with environment.kept():
            yield
    finally:
        environment.set_values(THREAD_ENV)


def _start_ray() -> None:
    import ray

    saved = {key: os.environ.get(key) for key in S3_ENV}
    os.environ.update(S3_ENV)  # the raylet, and so every worker it starts, inherits this environment
    # The session's thread settings, not what an in-process fit of this test set: Ray sets 1 a 1-CPU worker.
    environment.set_values(THREAD_ENV)
    try:
        # address="local": a cluster of its own, even where ray start left one running on this machine.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    finally:
        environment.set_values(saved)


@pytest.fixture(scope="session")
def forkserver():
    """The session's forkserver context (support.forkserver: torch, Lightning, diffusers and sdtrain imported once),
    its server stopped at the session's end."""
    from support import forkserver

    yield forkserver.preloaded()
    forkserver.stop()


@pytest.fixture(scope="session")
def _ray_session():
    """Stops, at the end of the session, whatever Ray cluster this process started last."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session):
    """A local Ray cluster this session starts and stops (2 CPUs, like the machines we test on). Its
    processes have the test S3 server's credentials (as from an instance role) but no endpoint: a job
    on it must hand its own endpoint to its tasks (the s3_bucket fixture sets it in this process only).
    Started once and kept for the tests after; started again if a test left it for a cluster of its own
    (test_elastic's several nodes)."""
    import ray

    if not ray.is_initialized():
        _start_ray()
    yield


_MLFLOW_DIR = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory, pytestconfig):
    """One real MLflow tracking server (support.mlflow_server) for the session's tests that can share it: started by
    the first test that asks for it, stopped at the session's end. Each test keeps to an experiment of its own
    (mlflow_experiment_name) and registered model names of its own, so that none sees another's runs or versions.
    A test that stops its server and starts it again (an outage) has servers of its own."""
    directory = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(directory) as uri:
        pytestconfig.stash[_MLFLOW_DIR] = directory
        yield uri


@pytest.fixture
def mlflow_experiment_name(request) -> str:
    """An MLflow experiment of the test's own on the shared server (tracking.mlflow_experiment=...)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{request.module.__name__}.{request.node.name}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the shared MLflow server shows the server's side (a crash's traceback) in its report, as
    mlflow_server does for a server of the test's own: the session's tmp directory is not kept on a CI machine."""
    report = yield
    directory = item.config.stash.get(_MLFLOW_DIR, None)
    if report.failed and directory is not None and "mlflow_uri" in getattr(item, "fixturenames", ()):
        tail = (directory / "mlflow-server.log").read_text(errors="replace")[-3000:]
        report.sections.append(("mlflow server: the end of its log", tail))
    return report


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture
def run_attempts(monkeypatch):
    """How many worker-group attempts Ray Train recorded for the latest run of a given name (Ray
    Train's own state actor, on for trainers made while this fixture is active: what its failure
    policy did, not what our logs say)."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    monkeypatch.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")

    def attempts(run_name: str) -> int:
        actor = get_state_actor()
        runs = [run for run in ray.get(actor.get_train_runs.remote()).values() if run.name == run_name]
        latest = max(runs, key=lambda run: run.start_time_ns)
        return len(ray.get(actor.get_train_run_attempts.remote())[latest.id])

    return attempts


def corrupt_row_group(path: Path, row_group: int) -> None:
    """Overwrite the first column's pages of ``row_group`` with noise: the footer and the other
    row groups stay readable, as with a file damaged in storage."""
    column = pq.ParquetFile(path).metadata.row_group(row_group).column(0)
    data = bytearray(path.read_bytes())
    start, size = column.data_page_offset, column.total_compressed_size
    data[start : start + size] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def unset_env(monkeypatch: pytest.MonkeyPatch, names) -> None:
    """Unset ``names`` for the test, each restored after it as it was before it, including one the code under test
    sets meanwhile (monkeypatch.delenv alone records nothing for a variable that was not set, so such a one outlived
    the test: an endpoint of a stopped server, MLflow's worker retries)."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def clean_storage_settings(monkeypatch):
    """Storage settings and endpoint variables as a fresh process has them, restored afterwards
    (sdtrain.storage.s3.configure_s3 sets both)."""
    from sdtrain.storage import s3

    unset_env(monkeypatch, s3.ENDPOINT_VARS)
    s3.configure_s3(None, s3.DEFAULT_MAX_ATTEMPTS)
    yield
    s3.configure_s3(None, s3.DEFAULT_MAX_ATTEMPTS)


@pytest.fixture
def s3_bucket(monkeypatch, tmp_path, clean_storage_settings):
    """A real S3-protocol server (moto's server mode) in its own process on loopback, with one
    bucket; the standard AWS variables point pyarrow, Ray and boto3 at it."""
    import boto3

    with moto_server(tmp_path / "moto.log") as endpoint:
        for key, value in {"AWS_ENDPOINT_URL": endpoint, **S3_ENV}.items():
            monkeypatch.setenv(key, value)
        boto3.client("s3").create_bucket(Bucket="sdtrain-test")
        yield "s3://sdtrain-test"


@pytest.fixture
def without_ray():
    """No Ray in this process, so that a test shows the driver's checks start none: a cluster an earlier test left
    (ray_cluster keeps the session's) is stopped, and the next test that needs one starts it again."""
    import ray

    ray.shutdown()
    yield


@pytest.fixture
def flaky_proxy(s3_bucket, tmp_path):
    """Start tests/flaky_proxy.py in front of the moto server (s3_bucket): (endpoint, fault log) per call, the proxy
    failing its first ``faults`` connections by ``mode`` (drop, throttle) and forwarding the rest."""
    target = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxies = []

    def start(mode: str, faults: int):
        log = tmp_path / f"faults-{len(proxies)}.log"
        log.write_text("")
        proxy = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "flaky_proxy.py"), str(target), mode, str(faults), str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        proxies.append(proxy)
        return f"http://127.0.0.1:{proxy.stdout.readline().strip()}", log

    yield start
    for proxy in proxies:
        proxy.kill()
        proxy.wait(timeout=10)


@dataclass
class AuthServer:
    endpoint: str
    keys: dict[str, tuple[str, str]]  # user name -> (access key id, secret access key)


@pytest.fixture
def s3_auth(monkeypatch, tmp_path, clean_storage_settings):
    """A moto server that checks IAM permissions, with bucket sdtrain-test holding data/part.parquet,
    and users: admin (everything), reader (list and read the bucket), nobody (no permissions)."""
    import boto3

    # The first 3 requests are not authenticated: they create the admin user, key and policy.
    with moto_server(tmp_path / "moto.log", {"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as endpoint:
        for key, value in {"AWS_ENDPOINT_URL": endpoint, **S3_ENV}.items():
            monkeypatch.setenv(key, value)
        keys = {}

        def add_user(iam, name, actions):
            iam.create_user(UserName=name)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            keys[name] = (key["AccessKeyId"], key["SecretAccessKey"])
            if actions:
                statement = {"Effect": "Allow", "Action": actions, "Resource": "*"}
                iam.put_user_policy(
                    UserName=name,
                    PolicyName="p",
                    PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [statement]}),
                )

        add_user(boto3.client("iam"), "admin", "*")
        admin = boto3.session.Session(*keys["admin"], region_name="us-east-1")
        add_user(admin.client("iam"), "reader", ["s3:ListBucket", "s3:GetObject"])
        add_user(admin.client("iam"), "nobody", [])
        s3 = admin.client("s3")
        s3.create_bucket(Bucket="sdtrain-test")
        write_latents(tmp_path / "part.parquet", rows=4)
        s3.upload_file(str(tmp_path / "part.parquet"), "sdtrain-test", "data/part.parquet")
        yield AuthServer(endpoint, keys)


def rows_by_step(recorded: list[np.ndarray], global_batch: int) -> list[np.ndarray]:
    """The sample indices of each optimizer step, all ranks' together, from ``checkpoint.record_rows``' files in
    checkpoint order: each is (world size, rows since the previous checkpoint), and rank r's rows of a step
    are its next ``global_batch / world size``."""
    steps = []
    for samples in recorded:
        per_rank = global_batch // samples.shape[0]
        steps += [samples[:, k : k + per_rank].ravel() for k in range(0, samples.shape[1], per_rank)]
    return steps
