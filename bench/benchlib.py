"""Shared by the benchmark scripts: synthetic parquet latents, the package's data path behind one
function, the pandas/DataLoader baseline of the seed notebook, and a process-tree memory sampler."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# tests/support: the fixtures benchmarks share with the tests (tiny models, a dataset checked from its footers).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

IMAGE_COLUMN = "image_latents_256"
CAPTION_COLUMN = "caption_latents"


# ----------------------------------------------------------------------------- data


def write_dataset(
    directory: Path,
    rows: int,
    rows_per_file: int,
    dtype: str,
    latent_shape=(4, 32, 32),
    caption_shape=(77, 1024),
    encoding: str = "list",
    seed: int = 0,
) -> list[str]:
    """Parquet files of random latents and captions as flat lists (the seed notebook's encoding) or
    fixed-size lists, ``rows_per_file`` rows a file; returns the file paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = []
    for index, start in enumerate(range(0, rows, rows_per_file)):
        n = min(rows_per_file, rows - start)
        table = pa.table(
            {
                "id": pa.array(np.arange(start, start + n)),
                IMAGE_COLUMN: _column(
                    rng.standard_normal((n, *latent_shape), dtype=np.float32).astype(dtype), encoding
                ),
                CAPTION_COLUMN: _column(
                    rng.standard_normal((n, *caption_shape), dtype=np.float32).astype(dtype), encoding
                ),
            }
        )
        path = directory / f"part-{index:05d}.parquet"
        pq.write_table(table, path)
        files.append(str(path))
    return files


def replicate(files: list[str], directory: Path, times: int) -> list[str]:
    """``times`` copies of ``files`` under ``directory`` (hard links: the same bytes, no disk cost)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for copy in range(times):
        for file in files:
            target = directory / f"copy{copy:03d}-{Path(file).name}"
            if not target.exists():
                os.link(file, target)
            out.append(str(target))
    return out


def _column(values: np.ndarray, encoding: str) -> pa.Array:
    n = len(values)
    width = int(np.prod(values.shape[1:]))
    flat = pa.array(values.reshape(n * width))
    if encoding == "fixed_size_list":
        return pa.FixedSizeListArray.from_arrays(flat, width)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)), flat)


# ----------------------------------------------------------------------------- the three data paths


def sdtrain_batches(
    files: list[str],
    batch_size: int,
    caption_dim: int = 1024,
    prefetch_batches: int | None = None,
    object_store_limit: int | None = None,
    paced: bool = True,
):
    """The package's data path, as the one worker of a 1-worker group sees it: the sampling plan
    (sdtrain.data.read_order) -> that rank's Ray Data stream of shuffled windows (read + decode in one task
    each, sdtrain.data.streams.rank_dataset) -> ``iter_torch_batches``, one epoch. The one place the
    benchmarks call into sdtrain's data pipeline: re-point it here when the pipeline's API changes.

    ``object_store_limit`` (bytes) is an experiment, not the package: Ray Data's object-store
    budget for this dataset capped at that. ``paced=False`` is the stream without the package's
    pace for Ray Data's scheduling loop (sdtrain.data.pacing), for comparison.

    Returns (iterator of {"latents", "captions", ...} CPU tensor batches, the DataIterator for its stats)."""
    from support.datasets import inspect_dataset

    from sdtrain.config.schema import DataConfig
    from sdtrain.data.read_order import DataState, SamplePlan
    from sdtrain.data.streams import WindowReader, rank_dataset

    data = DataConfig(train=list(files), latent_column=IMAGE_COLUMN, caption_column=CAPTION_COLUMN)
    if prefetch_batches is not None:
        data = DataConfig(**{**data.__dict__, "prefetch_batches": prefetch_batches})
    spec = inspect_dataset(list(files), "data.train", data.columns, in_channels=4, cross_attention_dim=caption_dim)
    plan = SamplePlan(
        spec.rows_per_file, seed=0, chunk_rows=data.shuffle_chunk_rows, window_rows=data.shuffle_window_rows
    )
    (stretches,) = plan.rank_stretches(DataState(), 1, batch_size, spec.num_rows // batch_size)
    dataset = rank_dataset(WindowReader(spec, data, plan), stretches, None)
    if not paced:
        from sdtrain.data.pacing import PacedScheduling

        dataset.context.custom_execution_callback_classes.remove(PacedScheduling)
    if object_store_limit is not None:
        from ray.data import ExecutionResources

        dataset.context.execution_options.resource_limits = ExecutionResources(object_store_memory=object_store_limit)
    shard = dataset.iterator()  # what sdtrain.controller.data_hook.PlannedStreams hands a worker
    batches = shard.iter_torch_batches(batch_size=batch_size, prefetch_batches=data.prefetch_batches)
    return batches, shard


def pyarrow_batches(files: list[str], batch_size: int, latent_shape=(4, 32, 32), caption_shape=(77, 1024)):
    """The limit: one process, pyarrow reads the two columns file by file and decodes them into
    numpy arrays (flatten, zero-copy view, reshape), sliced into torch batches without a copy."""
    import torch

    carry: list[tuple[np.ndarray, np.ndarray]] = []
    carried = 0
    for file in files:
        table = pq.read_table(file, columns=[IMAGE_COLUMN, CAPTION_COLUMN])
        latents = _flat(table.column(IMAGE_COLUMN)).reshape(len(table), *latent_shape)
        captions = _flat(table.column(CAPTION_COLUMN)).reshape(len(table), *caption_shape)
        start = 0
        if carried:  # complete the batch left over from the previous file
            take = min(batch_size - carried, len(table))
            carry.append((latents[:take], captions[:take]))
            carried += take
            start = take
            if carried == batch_size:
                yield {
                    "latents": torch.from_numpy(np.concatenate([c[0] for c in carry])),
                    "captions": torch.from_numpy(np.concatenate([c[1] for c in carry])),
                }
                carry, carried = [], 0
        while start + batch_size <= len(table):
            yield {
                "latents": torch.from_numpy(latents[start : start + batch_size]),
                "captions": torch.from_numpy(captions[start : start + batch_size]),
            }
            start += batch_size
        if start < len(table):
            carry.append((latents[start:], captions[start:]))
            carried += len(table) - start
    # drop_last: a final partial batch is dropped, as in the other two paths


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    return array.flatten().to_numpy(zero_copy_only=False)


class NotebookParquetDataset:
    """The seed notebook's approach, written fresh: pandas reads every row into memory, each row's
    flat array is reshaped (and cast) on its own, and a map-style torch Dataset hands out rows."""

    columns = (IMAGE_COLUMN, CAPTION_COLUMN)

    def __init__(self, files: list[str], dtype, latent_shape=(4, 32, 32), caption_shape=(77, 1024)):
        import pandas as pd

        frame = pd.concat([pd.read_parquet(f, columns=list(self.columns)) for f in files], ignore_index=True)
        frame[IMAGE_COLUMN] = frame[IMAGE_COLUMN].apply(lambda x: x.reshape(latent_shape).astype(dtype))
        frame[CAPTION_COLUMN] = frame[CAPTION_COLUMN].apply(lambda x: x.reshape(caption_shape).astype(dtype))
        self.frame = frame

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, index: int):
        import torch

        row = self.frame.iloc[index]
        return {name: torch.as_tensor(row[name]) for name in self.columns}


def pandas_batches(files: list[str], batch_size: int, dtype, num_workers: int = 2):
    """The seed notebook's loader: ``NotebookParquetDataset`` (everything in memory) in a torch
    DataLoader with shuffling and 2 worker processes, as the notebook sets it up."""
    import torch.utils.data

    dataset = NotebookParquetDataset(files, dtype)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, drop_last=True
    )
    for batch in loader:
        yield {"latents": batch[IMAGE_COLUMN], "captions": batch[CAPTION_COLUMN]}


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    samples: int = 0
    batches: int = 0
    seconds: float = 0.0  # from the call that builds the iterator to the last batch
    first_batch_s: float = 0.0  # from that call to the first batch
    steady_samples: int = 0  # samples after the first quarter of the epoch (pipeline filled) ...
    steady_seconds: float = 0.0  # ... and the time they took

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def steady_samples_per_s(self) -> float:
        return self.steady_samples / self.steady_seconds if self.steady_seconds else 0.0


def drain(make_batches, expected_samples: int, expected_dtype=None) -> Timing:
    """Build an iterator with ``make_batches()`` and pull every batch through it (no model), touching
    one value of each tensor so lazily materialized data is really there. The steady rate counts
    from the batch that completes the first quarter of ``expected_samples`` to the last batch."""
    start = time.perf_counter()
    timing = Timing()
    first = quarter = None
    for batch in make_batches():
        latents, captions = batch["latents"], batch["captions"]
        if expected_dtype is not None:
            assert latents.dtype == expected_dtype and captions.dtype == expected_dtype, (latents.dtype, expected_dtype)
        float(latents.view(-1)[-1]) + float(captions.view(-1)[-1])
        timing.samples += len(latents)
        timing.batches += 1
        if first is None:
            first = time.perf_counter()
        if quarter is None and timing.samples >= expected_samples / 4:
            quarter, quarter_samples = time.perf_counter(), timing.samples
    end = time.perf_counter()
    timing.seconds = end - start
    if first is not None:
        timing.first_batch_s = first - start
    if quarter is not None and end > quarter:
        timing.steady_samples = timing.samples - quarter_samples
        timing.steady_seconds = end - quarter
    return timing


# ----------------------------------------------------------------------------- memory


@dataclass
class MemoryPeak:
    pss: int = 0  # peak over samples of the summed proportional set size (shared pages split)
    rss: int = 0  # peak over samples of the summed resident set size (shared pages counted per process)
    processes: int = 0  # most processes seen in one sample
    samples: int = 0
    names: set = field(default_factory=set)


class TreeMemorySampler(threading.Thread):
    """Samples a process and all its descendants every ``interval`` s: summed PSS (Linux
    /proc/<pid>/smaps_rollup, via psutil) and summed RSS; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak = MemoryPeak()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        pss = rss = 0
        for proc in procs:
            try:
                info = proc.memory_full_info()
                pss += info.pss
                rss += info.rss
                self.peak.names.add(proc.name())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.peak.pss = max(self.peak.pss, pss)
        self.peak.rss = max(self.peak.rss, rss)
        self.peak.processes = max(self.peak.processes, len(procs))
        self.peak.samples += 1

    def stop(self) -> MemoryPeak:
        self._halt.set()
        self.join()
        self.sample()
        return self.peak


# ----------------------------------------------------------------------------- reporting


RESULT = "RESULT "


def print_result(**figures) -> None:
    """A measurement child's figures, as one line its parent reads back with ``parsed_result``."""
    print(RESULT + json.dumps(figures), flush=True)


def parsed_result(stdout: str) -> dict:
    """The figures a measurement child printed last with ``print_result``."""
    return json.loads([line for line in stdout.splitlines() if line.startswith(RESULT)][-1][len(RESULT) :])


def medians(runs: list[dict]) -> dict:
    """Each numeric figure's median over repeated runs (the upper median for an even count)."""
    return {
        key: sorted(r[key] for r in runs)[len(runs) // 2] for key in runs[0] if isinstance(runs[0][key], (int, float))
    }


def machine() -> str:
    memory = psutil.virtual_memory().total / 2**30
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = cpu
    load = os.getloadavg()[0]
    system = f"{platform.system()} {platform.release()}"
    return f"{os.cpu_count()} CPUs ({model}), {memory:.0f} GiB RAM, {system}, load {load:.2f}"


def versions() -> str:
    import pyarrow
    import torch

    try:  # not imported: bench/gpu_throughput.py runs without Ray, which a lent GPU machine lacks
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray_version = "not installed"
    cuda = f", CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""
    return (
        f"python {platform.python_version()}, torch {torch.__version__}{cuda}, ray {ray_version}, "
        f"pyarrow {pyarrow.__version__}"
    )


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ratio_line(
    name: str, value: float, baseline_name: str, baseline: float, target: str | None = None, met: bool | None = None
) -> str:
    ratio = value / baseline if baseline else float("nan")
    # Three decimals, or three significant digits under 0.001 (0.06 ms over 227 ms is 0.000264, not 0.000), never in
    # exponent notation, which the readers of these lines do not parse.
    small = 0 < abs(ratio) < 1e-3
    shown = f"{ratio:.{2 - math.floor(math.log10(abs(ratio))) if small else 3}f}"
    line = f"RATIO {name} / {baseline_name} = {shown}"
    if target is not None:
        line += f"  (target {target}: {'met' if met else 'MISSED'})"
    return line
