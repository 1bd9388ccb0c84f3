"""Object storage against real S3-protocol servers (moto's server mode, each in its own process on
loopback): endpoint precedence, data in a bucket, every pre-flight error, retries of real
transient faults (a proxy process in front of the server), and no secret in anything written."""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import boto3
import numpy as np
import pyarrow.parquet as pq
import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError
from conftest import REPO, tiny_config, write_latents
from support.datasets import inspect_dataset

from sdtrain.config.learning import Columns
from sdtrain.data.listing import list_dataset
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.driver.preflight import check_s3, preflight
from sdtrain.errors import ConfigError, DataError, StorageUnavailable, find_sdtrain_error
from sdtrain.storage import s3
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.s3 import configure_s3, is_transient, s3_client, s3_endpoint

SECRET = "sdtrain-test-secret/Do+Not+Leak"


def _s3():
    """A boto3 client with the credentials in the environment now (boto3's default session caches them)."""
    return boto3.session.Session().client("s3")


def _upload(tmp_path, key, **kwargs):
    local = tmp_path / key.replace("/", "_")
    written = write_latents(local, **kwargs)
    _s3().upload_file(str(local), "sdtrain-test", key)
    return written


def _expect(error_type, config, *fragments):
    """Run the pre-flight check; the one-paragraph error must hold every fragment and no secret."""
    with pytest.raises(error_type) as e:
        preflight(config)
    message = str(e.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert SECRET not in message and "\n" not in message
    return message


@pytest.fixture
def refused_port():
    """A loopback port that refuses connections for the whole test: bound here and never listened on, so no
    other process can start listening on it meanwhile, as it could on a port found free and let go."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


# --- endpoint ---------------------------------------------------------------------------------


def test_endpoint_precedence_config_then_environment_then_aws(monkeypatch, clean_storage_settings):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # the AWS endpoint's name depends on it
    assert s3_endpoint() == (None, "the AWS default")
    assert s3_client().meta.endpoint_url == "https://s3.amazonaws.com"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    assert s3_endpoint() == ("http://127.0.0.1:9001", "AWS_ENDPOINT_URL")
    monkeypatch.setenv(
        "AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9002"
    )  # the S3-specific variable wins, as in the AWS SDKs
    assert s3_endpoint() == ("http://127.0.0.1:9002", "AWS_ENDPOINT_URL_S3")
    configure_s3("http://127.0.0.1:9003", 7)  # storage.endpoint_url wins over both
    assert s3_endpoint() == ("http://127.0.0.1:9003", "storage.endpoint_url")
    assert s3_client().meta.endpoint_url == "http://127.0.0.1:9003"
    assert s3_client().meta.config.retries == {"mode": "standard", "total_max_attempts": 7}
    # Exported, so Ray Data and Ray Train (which read the environment) use the same endpoint.
    assert os.environ["AWS_ENDPOINT_URL"] == os.environ["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9003"


def test_the_filesystem_keeps_endpoint_and_retries_when_pickled_to_ray_workers(clean_storage_settings):
    configure_s3("http://127.0.0.1:9003", 7)
    fs, path = filesystem_for("s3://bucket/runs/")
    assert path == "bucket/runs"
    copy = pickle.loads(pickle.dumps(fs))
    assert copy.max_attempts == 7  # pyarrow's own pickle would drop the retry strategy
    assert pickle.loads(pickle.dumps(copy)).__reduce__()[1][1]["endpoint_override"] == "http://127.0.0.1:9003"


def test_storage_config_is_validated():
    with pytest.raises(
        ConfigError, match=r"storage\.endpoint_url: must be http\(s\)://host\[:port\], got 'minio:9000'"
    ):
        tiny_config("data.train=x", "storage.endpoint_url=minio:9000")
    with pytest.raises(ConfigError, match=r"storage\.max_attempts: must be >= 1 \(1 = no retries\), got 0"):
        tiny_config("data.train=x", "storage.max_attempts=0")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_storage_endpoint_url_beats_the_environment(s3_bucket, monkeypatch, tmp_path, refused_port):
    latents, _ = _upload(tmp_path, "data/part.parquet", rows=3)
    real = os.environ["AWS_ENDPOINT_URL"]
    closed = refused_port
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")  # nothing listens there
    preflight(tiny_config(f"data.train={s3_bucket}/data", f"storage.endpoint_url={real}"))
    fs, path = filesystem_for(f"{s3_bucket}/data/part.parquet")
    table = pq.read_table(path, filesystem=fs)
    assert table.num_rows == 3
    assert np.asarray(table["image_latents_256"][0].values).tolist() == latents[0].ravel().tolist()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_each_uri_is_checked_once_per_process(s3_bucket, tmp_path):
    """Retraining checks its roots and then its training run's URIs: a URI this process found usable is not probed
    again (here: still passing after its objects are gone), while one it has not checked is."""
    _upload(tmp_path, "once/part.parquet")
    config = tiny_config(f"data.train={s3_bucket}/once/", f"run.storage_path={s3_bucket}/runs")
    preflight(config)
    _s3().delete_object(Bucket="sdtrain-test", Key="once/part.parquet")
    preflight(config)  # the same URIs: not probed again
    _expect(
        DataError,
        tiny_config(f"data.train={s3_bucket}/once/", f"data.val={s3_bucket}/once/val/"),
        f"data.val[0]: {s3_bucket}/once/val/: bucket 'sdtrain-test' holds no objects under 'once/val'",
    )

    # data.train as a list of files: one check a bucket (one at a time, 1e5 files cost hours before anything ran);
    # each file is the listing's to find, many at once, naming a spec that matches nothing.
    for i in range(3):
        _upload(tmp_path, f"list/part-{i}.parquet")
    files = [f"{s3_bucket}/list/part-{i}.parquet" for i in (0, 1, 2, 9)]
    many = tiny_config(f"data.train={json.dumps(files)}")
    preflight(many)
    with pytest.raises(DataError, match=rf"^data\.train: {files[3]} matches no parquet files"):
        list_dataset(many.data.train, "data.train")
    assert list_dataset(files[:3], "data.train").paths == files[:3]
    elsewhere = tiny_config(f"data.train={json.dumps([*files[:3], 's3://no-such-bucket/part.parquet'])}")
    _expect(ConfigError, elsewhere, "data.train[3]: s3://no-such-bucket/part.parquet")


# --- data in a bucket -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_s3_files_prefixes_globs_and_lists(s3_bucket, tmp_path):
    for i, key in enumerate(
        ["d/a/1.parquet", "d/a/sub/2.parquet", "d/b/3.parquet", "d/a/_SUCCESS", "d/a/.tmp.parquet"]
    ):
        _upload(tmp_path, key, rows=2, seed=i)
    found = resolve_parquet_files(
        [f"{s3_bucket}/d/a/", f"{s3_bucket}/d/?/3.parquet", f"{s3_bucket}/d/a/1.parquet"], "data.train"
    )
    assert found == [f"{s3_bucket}/d/a/1.parquet", f"{s3_bucket}/d/a/sub/2.parquet", f"{s3_bucket}/d/b/3.parquet"]
    spec = inspect_dataset(found, "data.train", Columns("image_latents_256", "caption_latents"), 4, 32)
    assert (spec.num_rows, spec.latent_shape, spec.caption_shape) == (6, (4, 16, 16), (77, 32))


# --- each pre-flight error: the key, the URI, what went wrong, the fix --------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_start_fresh_on_s3_sets_the_old_run_aside_by_copies_s3_makes(s3_bucket, tmp_path):
    """run.start_fresh on S3: every object of the old run is under <run>.replaced-<time> byte for byte and gone from
    <run>, a neighbouring prefix untouched. S3 made the copies (the server saw no GET of them). An object over the
    single-copy limit goes in parts: one CopyObject, as pyarrow's copy_files made, is refused over 5 GiB, which a real
    checkpoint is (here the limit is lowered to 8 MiB, for the 20 MiB one)."""
    from sdtrain.storage import s3 as storage_s3
    from sdtrain.storage.filesystems import set_aside

    s3 = _s3()
    objects = {
        "runs/demo/checkpoint_000000010/checkpoint.ckpt": os.urandom(20 << 20),  # copied in parts
        "runs/demo/metrics.csv": b"step,loss\n2,0.5\n",
        "runs/demo/trackers.json": b"{}",
    }
    for key, body in {**objects, "runs/demo-b/keep.txt": b"another run"}.items():
        s3.put_object(Bucket="sdtrain-test", Key=key, Body=body)
    log = tmp_path / "moto.log"
    seen = len(log.read_text().splitlines())

    moved = set_aside(f"{s3_bucket}/runs/demo")
    assert moved is not None and moved.startswith(f"{s3_bucket}/runs/demo.replaced-")
    requests = log.read_text().splitlines()[seen:]
    assert requests and not [line for line in requests if '"GET /sdtrain-test/runs/demo/' in line], requests
    assert not [line for line in requests if "uploadId=" in line], requests  # all under 5 GiB: single copies
    assert not [line for line in requests if '"HEAD /sdtrain-test/runs/demo/' in line], requests  # sizes listed
    prefix = moved.removeprefix(f"{s3_bucket}/")
    listed = {item["Key"] for item in s3.list_objects_v2(Bucket="sdtrain-test", Prefix="runs/")["Contents"]}
    assert listed == {key.replace("runs/demo/", f"{prefix}/") for key in objects} | {"runs/demo-b/keep.txt"}
    for key, body in objects.items():
        copied = s3.get_object(Bucket="sdtrain-test", Key=key.replace("runs/demo/", f"{prefix}/"))["Body"].read()
        assert copied == body, key
    assert set_aside(f"{s3_bucket}/runs/demo") is None  # nothing there now

    seen = len(log.read_text().splitlines())
    assert storage_s3.move_prefix("sdtrain-test", prefix, "runs/parts", single_copy_max=8 << 20) == len(objects)
    requests = log.read_text().splitlines()[seen:]
    assert any("uploadId=" in line and "partNumber=" in line for line in requests), requests  # the 20 MiB one
    assert not [line for line in requests if f'"GET /sdtrain-test/{prefix}/' in line], requests
    for key, body in objects.items():
        assert s3.get_object(Bucket="sdtrain-test", Key=key.replace("runs/demo/", "runs/parts/"))["Body"].read() == body


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_file_over_the_single_request_limit_is_sent_and_copied_to_s3_in_parts(s3_bucket, tmp_path):
    """put_file and copy_file (realign's writes) on S3: a file up to the single-request limit in one PutObject or
    CopyObject, a larger one in parts, since one request is refused over 5 GiB (here the limit is lowered to 8 MiB, for
    a 12 MiB file). Either way the object holds the file's bytes, and the copy's bytes never pass through this
    process. A copy under the limit given the size listed is one request; one without it asks the size first."""
    from sdtrain.storage.filesystems import copy_file, put_file

    log = tmp_path / "moto.log"

    def requests_during(step, *args) -> list[str]:
        seen = len(log.read_text().splitlines())
        step(*args, single_request_max=8 << 20)
        return log.read_text().splitlines()[seen:]

    for name, body, in_parts in (("small.bin", b"a small file", False), ("large.bin", os.urandom(12 << 20), True)):
        (tmp_path / name).write_bytes(body)
        sent = requests_during(put_file, str(tmp_path / name), f"{s3_bucket}/put/{name}")
        assert any("uploadId=" in line for line in sent) is in_parts, sent
        copied = requests_during(copy_file, f"{s3_bucket}/put/{name}", f"{s3_bucket}/copied/{name}", len(body))
        assert any("uploadId=" in line for line in copied) is in_parts, copied
        assert not [line for line in copied if '"GET /sdtrain-test/put/' in line], copied
        assert any('"HEAD ' in line for line in copied) is in_parts, copied  # boto3's copy in parts asks the size
        unsized = requests_during(copy_file, f"{s3_bucket}/put/{name}", f"{s3_bucket}/unsized/{name}")
        assert [line for line in unsized if f'"HEAD /sdtrain-test/put/{name}' in line], unsized
        assert any("uploadId=" in line for line in unsized) is in_parts, unsized
        for key in (f"put/{name}", f"copied/{name}", f"unsized/{name}"):
            assert _s3().get_object(Bucket="sdtrain-test", Key=key)["Body"].read() == body, key


def test_bucket_missing(s3_bucket):
    _expect(
        ConfigError,
        tiny_config("data.train=s3://no-such-bucket/data"),
        "data.train[0]: s3://no-such-bucket/data: bucket 'no-such-bucket' does not exist at http://127.0.0.1:",
        "(from AWS_ENDPOINT_URL)",
        "Create it, or fix the bucket name in data.train[0]",
    )
    _expect(
        ConfigError,
        tiny_config(
            "data.train=/data/local", "run.storage_path=s3://no-such-runs/runs"
        ),  # local paths are checked where read
        "run.storage_path: s3://no-such-runs/runs: bucket 'no-such-runs' does not exist",
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prefix_empty(s3_bucket, tmp_path):
    _upload(tmp_path, "data/part.parquet")
    preflight(
        tiny_config(f"data.train={s3_bucket}/data/", f"run.storage_path={s3_bucket}/runs")
    )  # an empty run prefix is fine
    _expect(
        DataError,
        tiny_config(f"data.train={s3_bucket}/data/", f"data.val={s3_bucket}/Data/val/"),
        f"data.val[0]: {s3_bucket}/Data/val/: bucket 'sdtrain-test' holds no objects under 'Data/val'",
        "Check the path (keys are case-sensitive",
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_no_credentials(s3_bucket, monkeypatch, tmp_path):
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    for var in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        (tmp_path / var).write_text("")
        monkeypatch.setenv(var, str(tmp_path / var))
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"  # no instance role to fall back on
    _expect(
        ConfigError,
        tiny_config(f"data.train={s3_bucket}/data"),
        f"data.train[0]: {s3_bucket}/data: no AWS credentials found",
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
        "attach a role",
        "never takes credentials from its config",
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_rejected_credentials(s3_auth, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY00000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    _expect(
        ConfigError,
        tiny_config("data.train=s3://sdtrain-test/data"),
        "data.train[0]: s3://sdtrain-test/data: the S3 endpoint at http://127.0.0.1:",
        "rejected the credentials (InvalidAccessKeyId)",
        "Check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_access_denied_to_read_and_to_write(s3_auth, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.keys["nobody"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.keys["nobody"][1])
    _expect(
        ConfigError,
        tiny_config("data.train=s3://sdtrain-test/data"),
        "data.train[0]: s3://sdtrain-test/data: access denied: these credentials may not list in bucket 'sdtrain-test'",
        "Grant s3:ListBucket on it",
    )
    # The reader may list and read the data, but not write runs.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.keys["reader"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.keys["reader"][1])
    preflight(tiny_config("data.train=s3://sdtrain-test/data"))
    _expect(
        ConfigError,
        tiny_config("data.train=s3://sdtrain-test/data", "run.storage_path=s3://sdtrain-test/runs"),
        "run.storage_path: s3://sdtrain-test/runs: access denied: these credentials may not write in bucket "
        "'sdtrain-test'",
        "Grant s3:PutObject on it",
        "s3:DeleteObject",
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.keys["admin"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.keys["admin"][1])
    preflight(tiny_config("data.train=s3://sdtrain-test/data", "run.storage_path=s3://sdtrain-test/runs"))
    listed = _s3().list_objects_v2(Bucket="sdtrain-test", Prefix="runs/")
    assert listed["KeyCount"] == 0  # the write probe deleted itself


@pytest.mark.timeout(60)
def test_endpoint_unreachable_fails_in_seconds(clean_storage_settings, monkeypatch, refused_port):
    closed = refused_port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    start = time.monotonic()
    _expect(
        ConfigError,
        tiny_config("data.train=s3://bucket/data", f"storage.endpoint_url=http://127.0.0.1:{closed}"),
        f"data.train[0]: s3://bucket/data: cannot connect to the S3 endpoint http://127.0.0.1:{closed} (from "
        f"storage.endpoint_url;",
        f"[Errno 111] Connection refused; {s3.DEFAULT_MAX_ATTEMPTS} attempt(s)",
        "Check the URL and port in storage.endpoint_url, that the server is running",
    )
    assert time.monotonic() - start < 20  # standard backoff over 5 attempts: at most 1+2+4+8 s


def test_credentials_in_uris_or_endpoints_are_refused_without_repeating_them(clean_storage_settings, monkeypatch):
    for override, key in [
        (f"data.train=s3://AKIAXXXX:{SECRET}@bucket/data", "data.train[0]"),
        (f"run.storage_path=s3://AKIAXXXX:{SECRET}@bucket/runs", "run.storage_path"),
        (f"data.unconditional_caption=s3://AKIAXXXX:{SECRET}@bucket/empty.npy", "data.unconditional_caption"),
        (f"storage.endpoint_url=http://minio:{SECRET}@minio:9000", "storage.endpoint_url"),
        (f"data.val=s3://AKIAXXXX:se@{SECRET}@bucket/val", "data.val[0]"),
    ]:
        with pytest.raises(ConfigError) as e:
            tiny_config("data.train=s3://bucket/data", override)
        assert str(e.value).startswith(f"{key}: ") and "***@" in str(e.value), str(e.value)
        assert SECRET not in str(e.value) and "AWS credential chain" in str(e.value)
    with pytest.raises(ConfigError) as e:
        tiny_config("data.train=s3://bucket/data", f"tracking.mlflow_tracking_uri=https://admin:{SECRET}@mlflow:5000")
    message = str(e.value)
    assert message.startswith("tracking.mlflow_tracking_uri: https://***@mlflow:5000 holds a user name or password")
    assert SECRET not in message and "MLFLOW_TRACKING_PASSWORD" in message
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://minio:{SECRET}@127.0.0.1:9000")
    _expect(
        ConfigError,
        tiny_config("data.train=s3://bucket/data"),
        "from AWS_ENDPOINT_URL (http://***@127.0.0.1:9000) holds a user name or password",
    )


@pytest.mark.parametrize(
    "uri, shown",
    [
        # A secret holding '@' and '/': the separator is the last '@', and nothing before it survives.
        ("s3://AKIAX:se@cret/x@bucket/k", "s3://***@bucket/k"),
        (f"s3://AKIAX:{SECRET}@bucket/k", "s3://***@bucket/k"),
        ("https://admin:p@ss@mlflow:5000", "https://***@mlflow:5000"),
        ("https://admin:pa?ss#wd@mlflow:5000", "https://***@mlflow:5000"),
        # Query strings and fragments: every value, whatever its name.
        ("https://mlflow/?token=abc123", "https://mlflow/?token=***"),
        ("https://mlflow/api?x=1&access_token=abc123;sig=abc123", "https://mlflow/api?x=***&access_token=***;sig=***"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=abc123&X-Amz-Credential=AKIAX",
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        ("https://mlflow/#access_token=abc123", "https://mlflow/#access_token=***"),
        ("https://mlflow/?abc123", "https://mlflow/?***"),
        # Nothing to hide: kept as they are.
        ("s3://bucket/a@b/c.parquet", "s3://bucket/a@b/c.parquet"),
        ("http://minio:9000", "http://minio:9000"),
        ("data/what?token=1.parquet", "data/what?token=1.parquet"),  # a local file name, not a URI
    ],
)
def test_redaction_leaves_no_character_of_a_secret(uri, shown):
    from sdtrain.storage.uris import redact

    # The whole of what is shown: no character of a secret is left over.
    assert redact(uri) == shown


def test_tokens_in_a_query_are_refused_naming_the_variable_to_use_instead(clean_storage_settings):
    """The config is copied into checkpoints, tracker params, manifests and run files: a token in a URI's query
    would land in all of them, so it is refused like a password, and the message says where it belongs."""
    token = "tok-" + SECRET
    for override, key, instead in [
        (f"tracking.mlflow_tracking_uri=https://mlflow/?token={token}", "tracking.mlflow_tracking_uri", "MLFLOW"),
        (
            f"tracking.mlflow_tracking_uri=https://mlflow/x?a=1&access_token={token}",
            "tracking.mlflow_tracking_uri",
            "MLFLOW_TRACKING_TOKEN",
        ),
        (f"data.train=https://b.s3.amazonaws.com/k?X-Amz-Signature={token}", "data.train[0]", "AWS credential chain"),
        (f"run.storage_path=s3://bucket/runs?secret_key={token}", "run.storage_path", "AWS credential chain"),
        (f"model.pretrained=https://host/m?sig={token}", "model.pretrained", "AWS credential chain"),
        (f"storage.endpoint_url=http://minio:9000/?X-Amz-Security-Token={token}", "storage.endpoint_url", "AWS"),
    ]:
        with pytest.raises(ConfigError) as e:
            tiny_config("data.train=s3://bucket/data", override)
        message = str(e.value)
        assert message.startswith(f"{key}: ") and "=***" in message and "credential" in message, message
        assert token not in message and "tok-" not in message and instead in message, message
    # A query without a credential is no secret: kept.
    config = tiny_config(
        "data.train=s3://bucket/data", "tracking.mlflow_tracking_uri=postgresql://db/m?sslmode=require"
    )
    assert config.tracking.mlflow_tracking_uri.endswith("?sslmode=require")


# --- transient faults, retried ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode, pyarrow_error",
    [
        ("drop", "AWS Error NETWORK_CONNECTION"),
        ("throttle", r"AWS Error UNKNOWN \(HTTP status 503\) during HeadObject"),
    ],
    ids=["drop", "throttle"],
)
def test_transient_faults_are_retried_and_fail_clearly_without_retries(
    flaky_proxy, s3_bucket, tmp_path, mode, pyarrow_error
):
    _upload(tmp_path, "data/part.parquet", rows=5)
    uri = f"{s3_bucket}/data/part.parquet"
    for client in ("pyarrow", "boto3"):
        endpoint, log = flaky_proxy(mode, 2)
        configure_s3(endpoint, 3)  # 2 faults, 3 attempts: the third succeeds
        if client == "pyarrow":
            fs, path = filesystem_for(uri)
            assert pq.read_table(path, filesystem=fs).num_rows == 5
        else:
            check_s3(uri, "data.train", write=False)
        assert log.read_text().split() == [mode, mode], client  # both faults really happened

        endpoint, log = flaky_proxy(mode, 2)
        configure_s3(endpoint, 1)  # no retries: the first fault is final
        if client == "pyarrow":
            fs, path = filesystem_for(uri)
            with pytest.raises(OSError, match=pyarrow_error) as failed:
                pq.read_table(path, filesystem=fs)
            assert is_transient(failed.value)  # a failure for now, not a damaged file
        else:
            # Throttling and a dropped connection fail for now (exit 75); a refused connect may be a wrong endpoint.
            failure = StorageUnavailable if mode == "throttle" else (StorageUnavailable, ConfigError)
            with pytest.raises(failure) as e:
                check_s3(uri, "data.train", write=False)
            message = str(e.value)
            assert isinstance(e.value, StorageUnavailable) == (
                "connection was dropped" in message or mode == "throttle"
            )
            assert message.startswith(f"data.train: {uri}: ") and endpoint in message and "1 attempt(s)" in message, (
                message
            )
            assert "run again, or raise storage.max_attempts" in message
            # A reset that lands before the request is sent is a failed connect to boto3, one that
            # lands after it a dropped connection: which one is a matter of timing.
            causes = {
                "drop": ("[Errno 104] Connection reset by peer", "the connection was dropped (ConnectionClosedError)"),
                "throttle": ("SlowDown: the server is throttling or failing",),
            }[mode]
            assert any(cause in message for cause in causes), message
        assert log.read_text().split() == [mode], client


def _answer(code: str, status: int) -> dict:
    """An S3 error answer as botocore parses it (a HEAD's has no body: its code is the status)."""
    return {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.parametrize(
    "error, transient",
    [
        pytest.param(ClientError(_answer("SlowDown", 503), "ListObjectsV2"), True, id="SlowDown"),
        pytest.param(ClientError(_answer("503", 503), "HeadObject"), True, id="HEAD-503"),
        pytest.param(ClientError(_answer("ThrottlingException", 400), "ListObjectsV2"), True, id="Throttling"),
        pytest.param(ClientError(_answer("RequestLimitExceeded", 400), "ListObjectsV2"), True, id="RequestLimit"),
        pytest.param(ClientError(_answer("InternalError", 500), "GetObject"), True, id="InternalError"),
        pytest.param(ClientError(_answer("ServiceUnavailable", 503), "GetObject"), True, id="ServiceUnavailable"),
        pytest.param(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), True, id="cannot-connect"),
        pytest.param(ConnectionClosedError(endpoint_url="http://127.0.0.1:9"), True, id="connection-dropped"),
        pytest.param(ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), True, id="read-timeout"),
        pytest.param(
            OSError("AWS Error SLOW_DOWN during GetObject operation: Reduce your rate."), True, id="SLOW_DOWN"
        ),
        pytest.param(OSError("AWS Error INTERNAL_FAILURE during HeadObject operation"), True, id="INTERNAL_FAILURE"),
        pytest.param(StorageUnavailable("data.train: cannot read s3://b/k: ..."), True, id="StorageUnavailable"),
        pytest.param(ClientError(_answer("NoSuchKey", 404), "GetObject"), False, id="NoSuchKey"),
        pytest.param(ClientError(_answer("404", 404), "HeadObject"), False, id="HEAD-404"),
        pytest.param(ClientError(_answer("AccessDenied", 403), "ListObjectsV2"), False, id="AccessDenied"),
        pytest.param(FileNotFoundError("Path does not exist 'b/k'"), False, id="FileNotFoundError"),
        pytest.param(OSError("Parquet magic bytes not found in footer."), False, id="not-parquet"),
        pytest.param(DataError("data.train: cannot read s3://b/k as parquet"), False, id="DataError"),
    ],
)
def test_storage_failing_for_now_is_told_from_bad_input(error, transient):
    from sdtrain.driver.cli import exit_code
    from sdtrain.storage.s3 import raise_if_unavailable

    assert is_transient(error) is transient
    if not transient:  # returns: the caller's DataError says what is wrong with the input
        raise_if_unavailable(error, "data.train: cannot read s3://b/k")
        return
    with pytest.raises(StorageUnavailable, match=r"^data.train: cannot read s3://b/k: object storage failed") as raised:
        raise_if_unavailable(error, "data.train: cannot read s3://b/k")
    assert exit_code(raised.value) == 75  # run again; 2 would say "fix the input, do not retry"


def test_a_shared_filesystems_failure_for_now_is_no_bad_input():
    """A stale NFS file handle (a server restarted or failed over) or an I/O error on a shared run.storage_path or
    data.train became a DataError: exit 2 on the driver, and in a worker a run stopped without its restarts. Now it is
    a StorageUnavailable naming the file: exit 75, a restart. The EIO is a real one, of pyarrow reading a file."""
    import errno

    import pyarrow.fs as pafs

    from sdtrain.driver.cli import exit_code
    from sdtrain.storage.s3 import raise_if_unavailable

    with pafs.LocalFileSystem().open_input_file("/proc/self/mem") as file:
        with pytest.raises(OSError) as eio:
            file.read_at(16, 0)  # the unmapped page 0: the kernel's EIO, through pyarrow's own error
    assert eio.value.errno == errno.EIO
    stale = OSError(
        errno.ESTALE, "Failed to open local file '/mnt/efs/a.parquet'. Detail: [errno 116] Stale file handle"
    )
    # As Ray Data and pyarrow's dataset layer re-raise it: the number in the text alone.
    wrapped = OSError("Could not open Parquet input source '/mnt/efs/a.parquet': Detail: [errno 116] Stale file handle")
    for error in (eio.value, stale, wrapped):
        assert is_transient(error), error
        with pytest.raises(StorageUnavailable) as raised:
            raise_if_unavailable(error, "data.train: /mnt/efs/a.parquet")
        message = str(raised.value)
        assert (
            message.startswith("data.train: /mnt/efs/a.parquet: the filesystem failed (") and "not bad input" in message
        )
        assert exit_code(raised.value) == 75
    # What is wrong with the file itself stays bad input, as before.
    for error in (
        FileNotFoundError(
            errno.ENOENT, "Failed to open local file '/mnt/efs/a.parquet'. Detail: [errno 2] No such file"
        ),
        PermissionError(errno.EACCES, "Failed to open local file '/x'. Detail: [errno 13] Permission denied"),
        OSError("Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."),
    ):
        assert not is_transient(error), error


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["drop", "throttle"])
def test_storage_failing_past_its_retries_on_the_driver_is_no_bad_input(flaky_proxy, s3_bucket, tmp_path, capsys, mode):
    """The driver's footer reads, HEADs and listings under more faults than storage.max_attempts: no DataError (exit
    2, "fix your input, do not retry") but a StorageUnavailable naming the key and the file (exit 75, run again)."""
    from sdtrain.data.file_lists import FOLDER_LISTING_MIN
    from sdtrain.data.footer import read_footer
    from sdtrain.driver.cli import exit_code, index_main

    _upload(tmp_path, "data/part.parquet", rows=5)
    uri = f"{s3_bucket}/data/part.parquet"
    failing = "object storage failed after 2 attempt(s) with backoff ("
    endpoint, log = flaky_proxy(mode, 10**6)
    configure_s3(endpoint, 2)
    with pytest.raises(OSError) as raised:
        read_footer(uri, "data.train")
    assert isinstance(raised.value, StorageUnavailable) and exit_code(raised.value) == 75
    assert str(raised.value).startswith(f"data.train: cannot read {uri}: {failing}"), raised.value
    assert len(log.read_text().split()) >= 2  # the client's retries really ran
    for spec in (uri, f"{s3_bucket}/data/"):  # a file's HEAD, a directory's listing
        with pytest.raises(StorageUnavailable) as raised:
            list_dataset([spec], "data.val")
        assert str(raised.value).startswith(f"data.val: cannot list {spec}: {failing}"), raised.value

    # Many files named one by one: their folder's listing fails, and no HEAD each follows (they would fail too).
    before = len(log.read_text().split())
    named = [f"{s3_bucket}/many/{i:03d}.parquet" for i in range(FOLDER_LISTING_MIN)]
    with pytest.raises(StorageUnavailable) as raised:
        list_dataset(named, "data.train")
    assert str(raised.value).startswith(
        f"data.train: cannot list {s3_bucket}/many (for the {FOLDER_LISTING_MIN} files named in it): {failing}"
    ), raised.value
    assert len(log.read_text().split()) - before == 2  # one request, two attempts

    # The command line: one paragraph, exit 75, not 2.
    assert index_main([f"{s3_bucket}/data"]) == 75
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"error: index.py: cannot list {s3_bucket}/data: {failing}"), stderr
    assert "not bad input: run again later, or raise storage.max_attempts" in stderr and "Traceback" not in stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["drop", "throttle"])
def test_a_first_row_read_failing_past_its_retries_is_no_bad_input(flaky_proxy, s3_bucket, tmp_path, mode):
    """The driver reads a file's first row for the values a row of a variable-length column holds (the data checks,
    the dataset index, evaluate.py's and generate.py's captions): storage failing past its retries there is a
    StorageUnavailable naming the key and the file (exit 75, run again), not a damaged file's DataError (exit 2)."""
    from sdtrain.data.inspection import first_row
    from sdtrain.driver.cli import exit_code

    _upload(tmp_path, "data/part.parquet", rows=5)
    uri = f"{s3_bucket}/data/part.parquet"
    moto = os.environ["AWS_ENDPOINT_URL"]  # configure_s3 exports the proxy's
    endpoint, log = flaky_proxy(mode, 10**6)
    configure_s3(endpoint, 2)
    with pytest.raises(OSError) as raised:
        first_row(uri, "data.train", ["caption_latents"])
    assert isinstance(raised.value, StorageUnavailable) and exit_code(raised.value) == 75, raised.value
    failing = f"data.train: cannot read the first row of {uri}: object storage failed after 2 attempt(s) with backoff ("
    assert str(raised.value).startswith(failing), raised.value
    assert len(log.read_text().split()) >= 2  # the client's retries really ran
    configure_s3(moto, 3)
    assert first_row(uri, "data.train", ["caption_latents"]).num_rows == 1  # the file itself is fine


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["drop", "throttle"])
def test_a_dataset_index_read_failing_past_its_retries_is_no_bad_input(flaky_proxy, s3_bucket, tmp_path, mode):
    """A start reads a directory's and its run's dataset index (one GET each): storage failing past its retries there
    is a StorageUnavailable naming the index (exit 75, run again), not botocore's own error and a traceback (exit 1).
    A missing index is none (the footers are read), as before."""
    from sdtrain.data.index_format import read_index
    from sdtrain.data.listing import DIRECTORY_INDEX
    from sdtrain.driver.cli import exit_code

    _s3().put_object(Bucket="sdtrain-test", Key=f"data/{DIRECTORY_INDEX}", Body=b"an index")
    uri = f"{s3_bucket}/data/{DIRECTORY_INDEX}"
    moto = os.environ["AWS_ENDPOINT_URL"]  # configure_s3 exports the proxy's
    endpoint, log = flaky_proxy(mode, 10**6)
    configure_s3(endpoint, 2)
    with pytest.raises(OSError) as raised:
        read_index(uri)
    assert isinstance(raised.value, StorageUnavailable) and exit_code(raised.value) == 75, repr(raised.value)
    failing = f"cannot read the dataset index {uri}: object storage failed after 2 attempt(s) with backoff ("
    assert str(raised.value).startswith(failing), raised.value
    assert len(log.read_text().split()) >= 2  # the client's retries really ran
    configure_s3(moto, 3)
    assert read_index(f"{s3_bucket}/nowhere/{DIRECTORY_INDEX}") is None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_missing_denied_or_non_parquet_file_on_s3_stays_bad_input(s3_auth, monkeypatch, capsys):
    from sdtrain.data.footer import read_footer
    from sdtrain.data.index_format import read_index
    from sdtrain.data.inspection import first_row
    from sdtrain.data.listing import DIRECTORY_INDEX
    from sdtrain.driver.cli import index_main

    def as_user(name: str) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth.keys[name][0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth.keys[name][1])

    as_user("admin")
    _s3().put_object(Bucket="sdtrain-test", Key="text/notes.parquet", Body=b"not parquet")
    _s3().put_object(Bucket="sdtrain-test", Key=f"indexed/{DIRECTORY_INDEX}", Body=b"an index")
    for name in ("data/gone.parquet", "text/notes.parquet"):
        with pytest.raises(DataError, match=f"^data.train: cannot read s3://sdtrain-test/{name} as parquet: "):
            read_footer(f"s3://sdtrain-test/{name}", "data.train")
        with pytest.raises(DataError, match=f"^data.train: cannot read the first row of s3://sdtrain-test/{name}: "):
            first_row(f"s3://sdtrain-test/{name}", "data.train", ["caption_latents"])
    with pytest.raises(DataError, match="^data.train: s3://sdtrain-test/data/gone.parquet matches no parquet files"):
        list_dataset(["s3://sdtrain-test/data/gone.parquet"], "data.train")
    assert index_main(["s3://sdtrain-test/text"]) == 2
    assert capsys.readouterr().err.startswith("error: index.py: cannot read s3://sdtrain-test/text/notes.parquet as")

    as_user("nobody")  # may not read: AccessDenied (403)
    part = "s3://sdtrain-test/data/part.parquet"
    with pytest.raises(DataError, match=f"^data.train: cannot read {part} as parquet: .*ACCESS_DENIED"):
        read_footer(part, "data.train")
    with pytest.raises(DataError, match=f"^data.train: cannot list {part}: An error occurred \\(403\\)"):
        list_dataset([part], "data.train")
    with pytest.raises(DataError, match=f"^data.train: cannot read the first row of {part}: .*ACCESS_DENIED"):
        first_row(part, "data.train", ["caption_latents"])
    index = f"s3://sdtrain-test/indexed/{DIRECTORY_INDEX}"
    denied = rf"^cannot read the dataset index {index} \(An error occurred \(AccessDenied\) .*\): let these credentials"
    with pytest.raises(DataError, match=denied):
        read_index(index)


# --- secrets ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_secret_in_config_dumps_or_the_model_registry(s3_bucket, monkeypatch, tmp_path):
    import torch
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from sdtrain.artifacts.registry import ModelRegistry
    from sdtrain.model.presets import PRESETS

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto accepts any secret
    _upload(tmp_path, "data/part.parquet")
    config = tiny_config(
        f"data.train={s3_bucket}/data",
        f"run.storage_path={s3_bucket}/runs",
        f"storage.endpoint_url={os.environ['AWS_ENDPOINT_URL']}",
    )
    preflight(config)
    assert SECRET not in repr(config.to_dict())
    torch.manual_seed(0)
    registry = ModelRegistry(f"{s3_bucket}/models")
    version = registry.write_version(
        UNet2DConditionModel(**PRESETS["tiny"]), DDPMScheduler(), {"config": config.to_dict()}
    )
    registry.set_production(version)
    assert registry.manifest(version)["config"]["storage"]["endpoint_url"] == os.environ["AWS_ENDPOINT_URL"]
    s3 = _s3()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="sdtrain-test")["Contents"]]
    assert "models/production.json" in keys
    for key in keys:
        body = s3.get_object(Bucket="sdtrain-test", Key=key)["Body"].read()
        assert SECRET.encode() not in body and b"testing" not in body, key  # neither the secret nor the key id


# --- where the checks run --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_retrain_checks_its_roots_before_reading_anything(s3_bucket, tmp_path):
    import datetime

    from sdtrain.driver.retrain import retrain

    _upload(tmp_path, "parts/date=2026-11-01/part.parquet")
    _upload(tmp_path, "val/part.parquet")
    config = tiny_config(
        f"data.val={s3_bucket}/val",
        f"retrain.data_root={s3_bucket}/parts",
        "retrain.models_root=s3://no-models/m",
        f"run.storage_path={s3_bucket}/runs",
    )
    with pytest.raises(
        ConfigError, match=r"^retrain\.models_root: s3://no-models/m: bucket 'no-models' does not exist"
    ):
        retrain(config, datetime.date(2026, 11, 1))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_train_entrypoint_stops_before_ray_starts(s3_bucket, tmp_path):
    # Where a Ray started by the entrypoint would write its session first (short: Ray's socket paths live there).
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    start = time.monotonic()
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(REPO / "entrypoints" / "train.py"),
                "data.train=s3://no-such-bucket/latents",
                "data.val=[]",
                "eval.class_agreement=false",
                f"run.storage_path={s3_bucket}/runs",
            ],
            # This checkout's package, whatever an editable install elsewhere points at.
            cwd=tmp_path,
            env={**os.environ, "RAY_ADDRESS": "local", "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(REPO / "src")},
            capture_output=True,
            text=True,
            timeout=170,
        )
        started_ray = os.listdir(ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        "error: data.train[0]: s3://no-such-bucket/latents: bucket 'no-such-bucket' does not exist"
    )
    assert "Traceback" not in result.stderr
    # Ray never started: no session directory and no start-up line (how long the imports before the check take is
    # the machine's speed: 61 s on a busy 2-core machine, which a bound of 60 s failed).
    assert started_ray == [] and "Started a local Ray instance" not in result.stdout + result.stderr
    print(f"entrypoint stopped with exit code 2 after {elapsed:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_storage_failure_mid_run_is_neither_a_damaged_file_nor_skipped(flaky_proxy, s3_bucket, tmp_path):
    from sdtrain.config.schema import DataConfig
    from sdtrain.data.inspection import DatasetSpec
    from sdtrain.data.read_order import DataState, SamplePlan
    from sdtrain.data.streams import WindowReader

    _upload(tmp_path, "data/part.parquet", rows=8)
    plan = SamplePlan((8,), seed=0, chunk_rows=8, window_rows=8)
    spec = DatasetSpec((f"{s3_bucket}/data/part.parquet",), (8,), (4, 16, 16), (77, 32))
    window = plan.window(plan.rank_stretches(DataState(), 1, 8, 1)[0][0], 0)
    moto = os.environ["AWS_ENDPOINT_URL"]
    for on_read_error in ("fail", "skip"):
        endpoint, log = flaky_proxy("drop", 1000)
        configure_s3(endpoint, 1)
        reader = WindowReader(spec, DataConfig(train=["x"], on_read_error=on_read_error), plan)
        # Not the DataError that stops a run without retries, and no rows dropped under skip: the
        # attempt fails (an OSError, no SdtrainError), and Ray Train restarts it from the latest checkpoint.
        failed = r"^data.train: s3://sdtrain-test/data/part.parquet: object storage failed after 1 attempt\(s\)"
        with pytest.raises(StorageUnavailable, match=failed) as raised:
            reader.read(window)
        assert find_sdtrain_error(raised.value) is None
        assert log.read_text().split(), "the proxy dropped no connection"
    configure_s3(moto, 3)
    assert WindowReader(spec, DataConfig(train=["x"]), plan).read(window).num_rows == 8  # the data itself is fine

    # A damaged file is a damaged file, wherever it is.
    damaged = tmp_path / "damaged.parquet"
    write_latents(damaged, rows=8)
    raw = bytearray(damaged.read_bytes())
    raw[4:24] = b"\xff" * 20  # the first page header; the footer still reads
    damaged.write_bytes(bytes(raw))
    with pytest.raises(OSError, match="Deserializing page header failed") as error:  # an OSError, like the above
        pq.read_table(damaged)
    assert not is_transient(error.value)
