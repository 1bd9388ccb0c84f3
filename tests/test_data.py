"""Parquet encodings, file resolution and the pre-flight data checks (pyarrow only, no Ray cluster)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ENCODINGS, column, write_latents
from support.datasets import inspect_dataset

from sdtrain.config.learning import Columns
from sdtrain.data.decode import to_array
from sdtrain.data.metadata import LATENT_SCALING_FACTOR
from sdtrain.data.parquet_files import resolve_parquet_files
from sdtrain.data.rows import RowReader
from sdtrain.demo.digits import NUM_CLASSES, ensure_demo_data, load_digits
from sdtrain.errors import DataError

COLUMNS = Columns("image_latents_256", "caption_latents")


def _inspect(files, in_channels=4, cross_attention_dim=32, image="image_latents_256", caption="caption_latents"):
    return inspect_dataset(
        [str(f) for f in files], "data.train", Columns(image, caption), in_channels, cross_attention_dim
    )


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_every_encoding_decodes_to_the_written_values(tmp_path, encoding, dtype):
    path = tmp_path / "part.parquet"
    latents, captions = write_latents(
        path, rows=5, encoding=encoding, latent_shape=(4, 8, 8), caption_shape=(7, 32), dtype=dtype
    )
    spec = _inspect([path])
    assert spec.latent_shape == (4, 8, 8)  # from the data, not hard-coded
    assert spec.caption_shape == (7, 32)
    assert spec.num_rows == 5
    (batch,) = RowReader.of(spec, COLUMNS).batches([str(path)], "data.train")
    assert batch.latents.dtype == dtype  # kept as stored; cast on the device
    np.testing.assert_array_equal(batch.latents, latents)
    np.testing.assert_array_equal(batch.captions, captions)


def test_seed_notebook_layout_is_read_as_4x32x32_and_77x1024(tmp_path):
    path = tmp_path / "6_000108_000000.parquet"
    write_latents(path, rows=2, latent_shape=(4, 32, 32), caption_shape=(77, 1024))
    assert pq.read_schema(path).field("image_latents_256").type == pa.list_(pa.float16())
    spec = _inspect([path], cross_attention_dim=1024)
    assert (spec.latent_shape, spec.caption_shape) == ((4, 32, 32), (77, 1024))


def test_decode_of_a_sliced_batch_respects_offsets(tmp_path):
    path = tmp_path / "p.parquet"
    latents, _ = write_latents(path, rows=6, latent_shape=(4, 4, 4), caption_shape=(3, 32))
    table = pq.read_table(path).slice(2, 3)
    np.testing.assert_array_equal(to_array(table.column("image_latents_256"), (4, 4, 4), "latents"), latents[2:5])


def test_a_ragged_row_mid_file_names_the_column_and_file(tmp_path):
    good = np.zeros((2, 4 * 4 * 4), np.float32)
    rows = [good[0].tolist(), good[1].tolist()[:-1]]
    table = pa.table(
        {
            "image_latents_256": pa.array(rows, pa.list_(pa.float32())),
            "caption_latents": pa.array([[0.0] * 32] * 2, pa.list_(pa.float32())),
        }
    )
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    reader = RowReader(COLUMNS, (4, 4, 4), (1, 32))
    with pytest.raises(
        DataError,
        match=rf"data.val: {bad}: column 'image_latents_256' has a row of 63 values; expected 64 = 4 x 4 x 4",
    ):
        list(reader.batches([str(bad)], "data.val"))


def test_files_dirs_globs_and_lists(tmp_path):
    for name in ("a/1.parquet", "a/sub/2.parquet", "b/3.parquet", "a/_SUCCESS", "a/.tmp.parquet", "a/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = resolve_parquet_files(
        [str(tmp_path / "a"), str(tmp_path / "b" / "*.parquet"), str(tmp_path / "a/1.parquet")], "data.train"
    )
    assert [f[len(str(tmp_path)) + 1 :] for f in found] == ["a/1.parquet", "a/sub/2.parquet", "b/3.parquet"]
    with pytest.raises(DataError, match=r"data\.val: .*/nope matches no parquet files"):
        resolve_parquet_files([str(tmp_path / "nope")], "data.val")


# --- each pre-flight error: one paragraph naming file, column, found and expected -------------


def test_missing_column(tmp_path):
    write_latents(tmp_path / "p.parquet", latent_column="latents")
    with pytest.raises(DataError) as e:
        _inspect([tmp_path / "p.parquet"])
    message = str(e.value)
    assert "p.parquet has no column 'image_latents_256' (data.latent_column)" in message
    assert "its columns are id, latents, caption_latents" in message
    assert "\n" not in message


def test_latent_length_not_c_h_w(tmp_path):
    write_latents(tmp_path / "p.parquet", latent_shape=(4, 99))  # 396 values: 4 x 99 is not 4 x H x H
    with pytest.raises(
        DataError,
        match=(
            r"p\.parquet, column 'image_latents_256' \(data\.latent_column\) has 396 values a row, which is "
            r"not C\*H\*W for C = the UNet's in_channels = 4"
        ),
    ):
        _inspect([tmp_path / "p.parquet"])


def test_caption_width_is_not_cross_attention_dim(tmp_path):
    write_latents(tmp_path / "flat.parquet", caption_shape=(77, 30))
    with pytest.raises(
        DataError,
        match=(
            r"flat\.parquet, column 'caption_latents' \(data\.caption_column\) has 2310 values a row, which "
            r"is not L\*D for D = the UNet's cross_attention_dim = 32"
        ),
    ):
        _inspect([tmp_path / "flat.parquet"])
    write_latents(tmp_path / "tensor.parquet", caption_shape=(77, 1024), encoding="tensor")
    with pytest.raises(
        DataError,
        match=(
            r"holds caption embeddings of shape \(77, 1024\); expected \(L, D\) with D = the UNet's "
            r"cross_attention_dim = 32"
        ),
    ):
        _inspect([tmp_path / "tensor.parquet"])


def test_latent_channels_are_not_in_channels(tmp_path):
    write_latents(tmp_path / "p.parquet", latent_shape=(3, 16, 16), encoding="tensor")
    with pytest.raises(
        DataError,
        match=r"holds latents of shape \(3, 16, 16\); expected \(C, H, W\) with C = the UNet's in_channels = 4",
    ):
        _inspect([tmp_path / "p.parquet"])


def test_empty_dataset(tmp_path):
    write_latents(tmp_path / "p.parquet", rows=0)
    with pytest.raises(DataError, match=r"data\.train: the 1 parquet file\(s\) hold no rows"):
        _inspect([tmp_path / "p.parquet"])


def test_unreadable_file(tmp_path):
    write_latents(tmp_path / "good.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"data\.train: cannot read .*broken\.parquet as parquet"):
        _inspect([tmp_path / "good.parquet", tmp_path / "broken.parquet"])


def test_files_that_disagree_on_encoding(tmp_path):
    write_latents(tmp_path / "a.parquet", encoding="list")
    write_latents(tmp_path / "b.parquet", encoding="fixed_size_list")
    with pytest.raises(
        DataError,
        match=(
            r"column 'image_latents_256' is a fixed-size list of 1024 halffloat in .*b\.parquet but a list "
            r"of halffloat in .*a\.parquet"
        ),
    ):
        _inspect([tmp_path / "a.parquet", tmp_path / "b.parquet"])


def test_files_that_disagree_on_latent_scaling(tmp_path):
    # The factor was read from the first file only: a dataset of raw and scaled latents trained half its rows
    # at the wrong scale. Every footer is held to the first's.
    for name in "abc":
        write_latents(tmp_path / f"{name}.parquet")
    table = pq.read_table(tmp_path / "c.parquet")
    scaled = {**(table.schema.metadata or {}), LATENT_SCALING_FACTOR.encode(): b"0.18215"}
    pq.write_table(table.replace_schema_metadata(scaled), tmp_path / "c.parquet")
    with pytest.raises(
        DataError,
        match=(
            r"data\.train: .*c\.parquet records latents multiplied by 0\.18215 but .*a\.parquet records no factor "
            r"\(parquet metadata sdtrain\.latent_scaling_factor\)"
        ),
    ):
        _inspect([tmp_path / f"{name}.parquet" for name in "abc"])


def test_integer_values_and_nulls(tmp_path):
    table = pa.table(
        {
            "image_latents_256": pa.array([[1] * 1024], pa.list_(pa.int32())),
            "caption_latents": column(np.zeros((1, 2, 32), np.float32), "list"),
        }
    )
    pq.write_table(table, tmp_path / "ints.parquet")
    with pytest.raises(
        DataError,
        match=r"column 'image_latents_256' \(data\.latent_column\) holds int32 values; expected float16 or float32",
    ):
        _inspect([tmp_path / "ints.parquet"])
    table = pa.table(
        {
            "image_latents_256": pa.array([None], pa.list_(pa.float32())),
            "caption_latents": column(np.zeros((1, 2, 32), np.float32), "list"),
        }
    )
    pq.write_table(table, tmp_path / "nulls.parquet")
    with pytest.raises(
        DataError, match=r"nulls\.parquet, column 'image_latents_256' \(data\.latent_column\): the first row is null"
    ):
        _inspect([tmp_path / "nulls.parquet"])


def test_demo_dataset_is_learnable_shape_and_written_once(tmp_path):
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and set(labels) == set(range(NUM_CLASSES))
    train, val = tmp_path / "train", tmp_path / "val"
    assert ensure_demo_data(str(train), str(val), caption_dim=32)
    assert not ensure_demo_data(str(train), str(val), caption_dim=32)  # second call: already there
    spec = _inspect(sorted(train.glob("*.parquet")))
    assert (spec.num_rows, spec.latent_shape, spec.caption_shape) == (1600, (4, 16, 16), (77, 32))
    table = pq.read_table(val)
    assert table.num_rows == 197
    # One caption per class: identical within a class, different across classes.
    captions = {}
    for label, caption in zip(
        table.column("label").to_pylist(), table.column("caption_latents").to_pylist(), strict=True
    ):
        assert captions.setdefault(label, caption) == caption
    assert len({tuple(c[:8]) for c in captions.values()}) == len(captions)


def test_start_fresh_sets_the_old_run_aside_without_deleting_it(tmp_path):
    from sdtrain.storage.filesystems import set_aside

    run_dir = tmp_path / "runs" / "demo"
    (run_dir / "checkpoint_000000010").mkdir(parents=True)
    (run_dir / "checkpoint_000000010" / "checkpoint.ckpt").write_bytes(b"weights")
    moved = set_aside(str(run_dir))
    assert moved is not None and moved.startswith(f"{run_dir}.replaced-")
    assert not run_dir.exists()
    assert (
        tmp_path / "runs" / moved.split("/")[-1] / "checkpoint_000000010" / "checkpoint.ckpt"
    ).read_bytes() == b"weights"
    assert set_aside(str(run_dir)) is None  # nothing there: nothing to do


@pytest.mark.parametrize("done_steps, steps", [(0, 5), (0, 3), (1, 3)])  # whole windows; cut at the end; at both ends
def test_a_window_reads_the_planned_rows_in_the_planned_order(tmp_path, done_steps, steps):
    """The read task (no Ray): rows come from the right files and row groups, in the plan's order,
    also for windows a resume or the last step cuts (10 rows a step, 12 a window)."""
    from support.datasets import inspect_dataset

    from sdtrain.config.schema import DataConfig
    from sdtrain.data.read_order import DataState, SamplePlan
    from sdtrain.data.streams import WindowReader

    written = [
        write_latents(tmp_path / "a.parquet", rows=30, seed=1, row_group_size=8),
        write_latents(tmp_path / "b.parquet", rows=20, seed=2, row_group_size=8),
    ]
    latents = np.concatenate([w[0] for w in written])
    spec = inspect_dataset(
        [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")],
        "data.train",
        Columns("image_latents_256", "caption_latents"),
        4,
        32,
    )
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=5, window_rows=12)
    reader = WindowReader(spec, DataConfig(train=["x"]), plan)
    state = plan.advance(DataState(), 1, 10, done_steps)
    (stretch,) = plan.rank_stretches(state, 1, 10, steps)[0]
    seen = []
    for index in range(stretch.num_windows(plan.window_rows)):
        window = plan.window(stretch, index)
        block = reader.read(window)
        ids = block.column("sample_index").to_numpy()
        assert np.array_equal(ids, plan.sample_indices(window))
        read = block.column("latents").combine_chunks().to_numpy_ndarray()
        assert read.shape == (len(ids), 4, 16, 16) and np.array_equal(read, latents[ids])
        assert block.column("valid").to_numpy(zero_copy_only=False).all()
        seen.append(ids)
    read = np.concatenate(seen)
    assert len(read) == 10 * steps and len(set(read.tolist())) == len(read)  # which rows: tests/test_sampling.py


def test_an_unreadable_row_group_fails_naming_it_or_is_skipped_alone(tmp_path):
    from conftest import corrupt_row_group

    from sdtrain.config.schema import DataConfig
    from sdtrain.data.read_order import SamplePlan, Window
    from sdtrain.data.streams import WindowReader

    write_latents(tmp_path / "bad.parquet", rows=24, seed=1, row_group_size=8)
    corrupt_row_group(tmp_path / "bad.parquet", 1)  # rows 8-15
    spec = inspect_dataset(
        [str(tmp_path / "bad.parquet")], "data.train", Columns("image_latents_256", "caption_latents"), 4, 32
    )
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=24, window_rows=24)
    window = Window(np.array([[0, 0, 24]]), (0,), 0, 24)
    with pytest.raises(
        DataError, match=rf"data\.train: {tmp_path}/bad\.parquet: rows 8-15 cannot be read .* data\.on_read_error=skip"
    ):
        WindowReader(spec, DataConfig(train=["x"]), plan).read(window)
    block = WindowReader(spec, DataConfig(train=["x"], on_read_error="skip"), plan).read(window)
    invalid = block.column("sample_index").to_numpy()[~block.column("valid").to_numpy(zero_copy_only=False)]
    assert sorted(invalid) == list(range(8, 16))


def test_a_file_cut_short_since_the_run_planned_fails_naming_it_or_is_skipped_not_an_index_error(tmp_path):
    """A file rewritten with fewer rows after the driver read its footer: the read task raised IndexError, no error of
    ours, so Ray Train restarted on it until failure.max_failures was spent, and the message named no file."""
    from sdtrain.config.schema import DataConfig
    from sdtrain.data.read_order import SamplePlan, Window
    from sdtrain.data.streams import WindowReader

    path = tmp_path / "a.parquet"
    write_latents(path, rows=16, seed=1, row_group_size=8)
    spec = _inspect([path])
    write_latents(path, rows=8, seed=1, row_group_size=8)  # rewritten in place (or an upload cut short)
    plan = SamplePlan(spec.rows_per_file, seed=0, chunk_rows=16, window_rows=16)
    window = Window(np.array([[0, 0, 4], [0, 4, 16]]), (), 0, 16)  # rows 0-3 still there, 4-15 past its end now
    with pytest.raises(
        DataError,
        match=rf"data\.train: {path}: rows 4-15 cannot be read \(the file holds 8 rows now, the run planned 16: it "
        r"changed since the run started\)",
    ):
        WindowReader(spec, DataConfig(train=["x"]), plan).read(window)
    block = WindowReader(spec, DataConfig(train=["x"], on_read_error="skip"), plan).read(window)
    valid = block.column("valid").to_numpy(zero_copy_only=False)
    assert block.column("sample_index").to_pylist() == list(range(16))
    assert valid[:4].all() and not valid[4:].any()


def test_sd1_captions_against_a_1024_wide_unet_are_named_for_what_they_are(tmp_path):
    write_latents(tmp_path / "sd1.parquet", rows=2, caption_shape=(77, 768))
    with pytest.raises(DataError) as error:
        _inspect([tmp_path / "sd1.parquet"], cross_attention_dim=1024)
    assert (
        "59136 = 77 x 768: 768-wide embeddings (CLIP ViT-L/14, as SD 1.x writes), for a UNet with cross_attention_dim "
        "768. Set model.unet.cross_attention_dim=768" in str(error.value)
    )
    # The same as a tensor column (its shape is in the footer).
    write_latents(tmp_path / "sd1t.parquet", rows=2, caption_shape=(77, 768), encoding="tensor")
    with pytest.raises(DataError, match=r"59136 = 77 x 768: 768-wide embeddings"):
        _inspect([tmp_path / "sd1t.parquet"], cross_attention_dim=1024)
    # Latents of another channel count say which resolution they are.
    write_latents(tmp_path / "sd.parquet", rows=2, latent_shape=(4, 32, 32))
    with pytest.raises(DataError, match=r"4096 = 4x32x32: the latents of 256 px images through SD's VAE"):
        _inspect([tmp_path / "sd.parquet"], in_channels=9)


def test_a_damaged_first_row_group_is_named_not_a_traceback(tmp_path):
    path = tmp_path / "damaged.parquet"
    write_latents(path, rows=4)
    raw = bytearray(path.read_bytes())
    raw[8:2000] = b"\xff" * 1992  # the first data pages; the footer at the end still reads
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"data.train: cannot read the first row of .*damaged\.parquet: "):
        _inspect([path])


def test_non_finite_held_out_rows_are_a_data_error_naming_the_file_and_row_not_a_nan_loss(tmp_path):
    """One NaN row at row 50 of data.val made both held-out losses of the retraining gate NaN: every model was
    'diverged' and production never moved. The first row's check cannot see it; the read that computes the loss
    does, counting the rows, before any loss is reported."""
    from sdtrain.config.schema import DataConfig
    from sdtrain.data.inspection import DatasetSpec
    from sdtrain.data.local_read import iter_local_batches

    latents = np.zeros((80, 4, 16, 16), np.float32)
    latents[50, 1, 2, 3] = np.nan
    latents[61] = np.inf
    captions = np.zeros((80, 77, 32), np.float32)
    path = tmp_path / "val.parquet"
    pq.write_table(
        pa.table({"image_latents_256": column(latents, "list"), "caption_latents": column(captions, "list")}), path
    )
    spec = DatasetSpec((str(path),), (80,), (4, 16, 16), (77, 32))
    with pytest.raises(
        DataError, match=r"data.val: .*val.parquet: 2 row\(s\) hold NaN or infinite values \(the first: row 50\)"
    ):
        list(iter_local_batches(spec, DataConfig(train=["x"]), 32))
    latents[50, 1, 2, 3], latents[61] = 0, 0
    pq.write_table(
        pa.table({"image_latents_256": column(latents, "list"), "caption_latents": column(captions, "list")}), path
    )
    assert sum(len(b["latents"]) for b in iter_local_batches(spec, DataConfig(train=["x"]), 32)) == 80


def test_a_fresh_start_is_checked_against_its_data_not_the_old_runs_index(tmp_path):
    """check_run read the run's dataset index before run.start_fresh set the old run aside: data re-encoded with
    another VAE since was refused against the old run's index, naming one file twice. The old run is set aside
    first, whole; the fresh start reads the footers and records the new scaling."""
    import os

    from conftest import tiny_config

    from sdtrain.driver.run import check_run

    def encode(factor: bytes) -> None:
        for i, name in enumerate("ab"):
            path = tmp_path / "data" / f"{name}.parquet"
            write_latents(path, rows=8, seed=i)
            table = pq.read_table(path)
            pq.write_table(table.replace_schema_metadata({LATENT_SCALING_FACTOR.encode(): factor}), path)
            os.utime(path, ns=(0, (int(factor[-2:]) + i) * 10**9))  # another version, whatever the clock

    encode(b"0.18215")
    options = [f"data.train={tmp_path}/data", "export.enabled=false"]  # latents that name no VAE: no export
    first = check_run(tiny_config(*options, tmp_path=tmp_path, name="r", batch=4))
    assert first.stored_scale == pytest.approx(0.18215)
    old_index = tmp_path / "runs/r/dataset_index/train.parquet"
    recorded = old_index.read_bytes()

    encode(b"0.13025")
    fresh = check_run(tiny_config(*options, "run.start_fresh=true", tmp_path=tmp_path, name="r", batch=4))
    assert fresh.stored_scale == pytest.approx(0.13025) and fresh.committed is None
    (aside,) = (tmp_path / "runs").glob("r.replaced-*")
    assert (aside / "dataset_index/train.parquet").read_bytes() == recorded  # moved whole, not rewritten
    assert old_index.read_bytes() != recorded
    restart = check_run(tiny_config(*options, tmp_path=tmp_path, name="r", batch=4))
    assert restart.stored_scale == pytest.approx(0.13025)


def test_the_empty_prompt_is_by_default_the_one_preprocessing_wrote_beside_the_data(tmp_path, caplog):
    """data.unconditional_caption: auto. Dropped captions train the unconditional prediction that classifier-free
    guidance samples against; diffusers' pipeline guides against the text encoder's output for "". Training on zeros
    by default, an export prompted with words guided against an embedding its model never saw."""
    from conftest import tiny_config

    from sdtrain.driver.run import check_run
    from sdtrain.errors import ConfigError
    from sdtrain.storage.run_layout import UNCONDITIONAL_FILE

    write_latents(tmp_path / "data" / "a.parquet", rows=8)  # captions 77 x 32
    options = [f"data.train={tmp_path}/data", "export.enabled=false"]

    def resolved(*extra: str) -> str:
        return check_run(
            tiny_config(*options, *extra, tmp_path=tmp_path, name="r", batch=4)
        ).config.data.unconditional_caption

    assert resolved() == "zeros" and f"no {UNCONDITIONAL_FILE} beside data.train's first file" in caplog.text
    empty = np.random.default_rng(0).standard_normal((77, 32)).astype(np.float32)
    np.save(tmp_path / "data" / UNCONDITIONAL_FILE, empty)  # as entrypoints/preprocess.py writes it
    assert resolved() == str(tmp_path / "data" / UNCONDITIONAL_FILE)
    assert resolved("data.unconditional_caption=zeros") == "zeros"  # set: as it is
    np.save(tmp_path / "data" / UNCONDITIONAL_FILE, empty[:, :16])  # another text encoder's: refused, named
    with pytest.raises(ConfigError, match=r"holds an array of shape \(77, 16\).*auto found it beside data\.train"):
        resolved()
