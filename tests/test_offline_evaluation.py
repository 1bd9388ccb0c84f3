"""The offline evaluation (entrypoints/evaluate.py): two checkpoints of the tiny UNet scored side by side with the
metrics of training's evaluation on real photographs (test_evaluation's module fixture: scikit-learn's photographs
through a tiny VAE, tiny DINOv2, Inception and CLIP models built from configs), from parquet rows and from prompts in
words; a set measured in parts adding up to the whole (what its Ray tasks do; once on the local Ray cluster); the
errors of bad input; our Frechet distance and CLIP score against torchmetrics' on the same images and models."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import test_evaluation
import torch
from conftest import REPO, tiny_config
from PIL import Image
from support.tiny_models import write_tiny_clip
from test_evaluation import TEXTS

from sdtrain.driver.offline_eval import evaluate_main
from sdtrain.evaluation.checkpoint_eval import Evaluator
from sdtrain.evaluation.eval_rows import read_eval_rows
from sdtrain.evaluation.image_metrics import ClipScore, DinoFeatures, FeatureStats, InceptionFeatures, frechet_distance
from sdtrain.evaluation.measures import Measures, metrics_of, part_range
from sdtrain.model.encoders import encode_prompts, load_text_encoder
from sdtrain.model.unet import build_unet
from sdtrain.sampling.sampler import initial_noise, shape_seed

evaluated = test_evaluation.evaluated  # the module fixture: data.val, the tiny models, a checkpoint of 2 steps
METRICS = ("fd_dinov2", "fd_inception", "clip_score")


@pytest.fixture(scope="module")
def offline(evaluated, tmp_path_factory):
    """A second checkpoint (the same run's, its UNet's weights drawn anew: an untrained model), a parquet set whose
    captions are TEXTS encoded by the tiny text encoder in float32 (what --prompts of TEXTS encode), a prompt file of
    those texts, and the command line's model options."""
    root = tmp_path_factory.mktemp("offline")
    state = torch.load(evaluated["checkpoint"] / "checkpoint.ckpt", map_location="cpu", weights_only=True)
    torch.manual_seed(1)
    fresh = build_unet(tiny_config("data.train=[x]").model).state_dict()
    for prefix in ("unet.", "ema_unet."):
        state["state_dict"].update({prefix + k: v for k, v in fresh.items() if prefix + k in state["state_dict"]})
    (root / "untrained").mkdir()
    torch.save(state, root / "untrained" / "checkpoint.ckpt")

    val = pq.read_table(evaluated["root"] / "val" / "part-0.parquet").slice(0, 8)
    texts = val.column("caption").to_pylist()
    tokenizer, text_encoder = load_text_encoder(evaluated["sd"])
    captions = encode_prompts(tokenizer, text_encoder, texts).numpy()
    prompted = val.set_column(1, "caption_latents", pa.array(list(captions.reshape(len(texts), -1))))
    (root / "prompted").mkdir()
    pq.write_table(prompted.replace_schema_metadata(val.schema.metadata), root / "prompted" / "part-0.parquet")
    (root / "prompts.txt").write_text("# the set's captions\n" + "\n".join(texts) + "\n")
    config = evaluated["config"]
    options = [
        f"eval.dinov2={config.eval.dinov2}",
        f"eval.inception={config.eval.inception}",
        f"eval.clip={config.eval.clip}",
        "eval.num_samples=8",
        "eval.batch_size=4",
        "sample_grid.steps=2",
    ]
    return {"root": root, "untrained": str(root / "untrained"), "prompted": str(root / "prompted"), "options": options}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = evaluate_main(argv)
    return code, capsys.readouterr().err


def _results(out) -> dict:
    with open(os.path.join(out, "evaluation.json")) as f:
        return json.load(f)


def test_two_models_are_scored_side_by_side_as_training_scores_each(evaluated, offline, tmp_path, capsys):
    """Both checkpoints from data.val's rows, one call: each one's numbers are those of training's evaluation of it
    (the same Evaluator, rows, noise and reference), in a JSON and a table with a column per model."""
    trained, untrained, out = str(evaluated["checkpoint"]), offline["untrained"], tmp_path / "out"
    val = str(evaluated["root"] / "val")
    code, err = _run([trained, untrained, *offline["options"], "--captions", val, "--out", str(out)], capsys)
    assert code == 0, err
    results = _results(out)
    assert [m["model"] for m in results["models"]] == [trained, untrained]
    assert results["set"] == {"captions": val, "samples": 8}
    assert results["reference"] == {"source": val, "kind": "the set's own images", "samples": 8}
    assert results["settings"]["vae"] == evaluated["sd"] and results["tasks"] == 1
    for model in (trained, untrained):
        alone = Evaluator(evaluated["config"], None, evaluated["sd"]).evaluate(model)
        metrics = next(m["metrics"] for m in results["models"] if m["model"] == model)
        assert set(metrics) == {*METRICS, "eval_samples", "eval_nonfinite_samples"} and metrics["eval_samples"] == 8
        assert metrics["eval_nonfinite_samples"] == 0
        for metric in METRICS:
            assert metrics[metric] == pytest.approx(alone[metric], rel=1e-6), (model, metric)
    first, second = (m["metrics"] for m in results["models"])
    assert first["fd_dinov2"] != second["fd_dinov2"]

    table = (out / "evaluation.md").read_text().splitlines()
    assert table[0] == f"| metric |  | {trained} | {untrained} |"
    row = next(line for line in table if line.startswith("| fd_dinov2 |"))
    assert row == f"| fd_dinov2 | lower is better | {first['fd_dinov2']:.5g} | {second['fd_dinov2']:.5g} |"
    assert any(line.startswith("| clip_score | higher is better |") for line in table)
    info = json.loads((out / "reference" / "reference.json").read_text())
    assert info["vae"] == evaluated["sd"] and info["latent_scaling_factor"] is None  # what a later call checks
    assert info["models"] == {
        "fd_dinov2": evaluated["config"].eval.dinov2,
        "fd_inception": evaluated["config"].eval.inception,
    }


def test_prompts_in_words_sample_what_their_embeddings_sample(evaluated, offline, tmp_path, capsys):
    """--prompts, encoded by --text-encoder, against the reference statistics an earlier call wrote: the numbers of
    --captions rows holding those prompts' embeddings. Then against the same rows as a parquet --reference."""
    trained, options = str(evaluated["checkpoint"]), offline["options"]
    rows, prompts = offline["prompted"], str(offline["root"] / "prompts.txt")
    code, err = _run([trained, *options, "--captions", rows, "--out", str(tmp_path / "rows")], capsys)
    assert code == 0, err
    expected = _results(tmp_path / "rows")["models"][0]["metrics"]
    for reference in (str(tmp_path / "rows" / "reference"), rows):
        out = tmp_path / f"prompts-{len(reference)}"
        argv = [trained, *options, "--prompts", prompts, "--reference", reference, "--out", str(out)]
        code, err = _run([*argv, "--text-encoder", evaluated["sd"]], capsys)
        assert code == 0, err
        results = _results(out)
        assert results["set"] == {"prompts": prompts, "samples": 8} and results["reference"]["source"] == reference
        metrics = results["models"][0]["metrics"]
        for metric in METRICS:
            assert metrics[metric] == pytest.approx(expected[metric], rel=1e-4, abs=1e-6), (reference, metric)


def test_a_set_measured_in_parts_adds_up_to_the_whole_set(evaluated):
    """What each Ray task of --tasks N measures: its share of each shape group, every row sampled from the noise it
    has in the whole set; the parts' sums are the whole set's, and so are the metrics."""
    from sdtrain.artifacts.loading import load_model

    assert [part_range(10, (k, 3)) for k in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [part_range(2, (k, 3)) for k in range(3)] == [(0, 0), (0, 1), (1, 2)]
    with pytest.raises(ValueError, match="part 3 of 3"):
        part_range(5, (3, 3))

    config = evaluated["config"]
    evaluator = Evaluator(config, None, evaluated["sd"])
    loaded = load_model(str(evaluated["checkpoint"]))
    rows = read_eval_rows(config, (4, 16, 16), (77, 32))
    whole = evaluator.measure(loaded, rows)
    parts = [evaluator.measure(loaded, rows, (k, 3)) for k in range(3)]
    merged = parts[0].merged(parts[1]).merged(parts[2])
    assert [p.samples for p in parts] == [2, 3, 3] and merged.samples == whole.samples == 8
    # Each part samples its rows in batches of other sizes than the whole set: float32 kernels round differently
    # (CI saw 1.4e-4 relative on a CLIP score); the same noise and rows, not bitwise the same arithmetic.
    np.testing.assert_allclose(merged.clip_scores, whole.clip_scores, rtol=1e-3, atol=1e-3)
    for metric, stats in whole.generated.items():
        np.testing.assert_allclose(merged.generated[metric].mean, stats.mean, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(merged.generated[metric].cov, stats.cov, rtol=1e-3, atol=1e-6)
    references = evaluator.reference_stats(rows, loaded)
    shares = [evaluator.reference_stats(rows, loaded, (k, 3)) for k in range(3)]
    for metric, stats in references.items():
        summed = FeatureStats(stats.dim)
        for share in shares:
            summed.merge(share[metric])
        assert summed.count == 8 and np.allclose(summed.mean, stats.mean, atol=1e-6)
    ours, theirs = metrics_of(config, merged, references), evaluator.evaluate(loaded)
    for metric in METRICS:
        assert ours[metric] == pytest.approx(theirs[metric], rel=1e-4), metric
    # Without the whole set's noise each part would sample its rows from noise of its own: other samples.
    alone = Evaluator(config, None, evaluated["sd"])
    part = Measures(generated={m: FeatureStats(f.dim) for m, f in alone.features.items()})
    group = rows.groups[0]
    noise = initial_noise(group.shape, 3, shape_seed(config.train.seed, group.shape))
    latents = alone._sample(loaded.unet, loaded, torch.from_numpy(rows.captions[5:8]), group.shape, noise)
    alone._measure_samples(part, loaded, latents, rows, group.rows[5:8])
    assert not np.allclose(part.clip_scores, parts[2].clip_scores)


@pytest.mark.slow
def test_the_set_split_among_ray_tasks_scores_as_in_this_process(evaluated, offline, tmp_path, capsys, ray_cluster):
    """--tasks 2 on the local Ray cluster: two tasks each measure half of the set and of the reference; merged, the
    numbers of the call measured in this process."""
    trained, val = str(evaluated["checkpoint"]), str(evaluated["root"] / "val")
    argv = [trained, *offline["options"], "--captions", val]
    assert _run([*argv, "--out", str(tmp_path / "here")], capsys)[0] == 0
    code, err = _run([*argv, "--out", str(tmp_path / "ray"), "--tasks", "2"], capsys)
    assert code == 0, err
    here, there = _results(tmp_path / "here"), _results(tmp_path / "ray")
    assert there["tasks"] == 2 and there["set"] == here["set"] and there["reference"] == here["reference"]
    for metric in (*METRICS, "eval_samples"):
        assert there["models"][0]["metrics"][metric] == pytest.approx(here["models"][0]["metrics"][metric], rel=1e-4)


def test_bad_input_is_refused_in_one_line_naming_it(evaluated, offline, tmp_path, capsys):
    trained, options = str(evaluated["checkpoint"]), offline["options"]
    val, prompts = str(evaluated["root"] / "val"), str(offline["root"] / "prompts.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    narrow = pq.read_table(offline["prompted"] + "/part-0.parquet")
    narrow = narrow.set_column(1, "caption_latents", pa.array([row[:1232] for row in narrow.column(1).to_pylist()]))
    (tmp_path / "narrow").mkdir()
    pq.write_table(narrow, tmp_path / "narrow" / "part-0.parquet")
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "reference.json").write_text(json.dumps({"models": {"fd_dinov2": "/another/dinov2"}}))
    models = {"fd_dinov2": evaluated["config"].eval.dinov2, "fd_inception": evaluated["config"].eval.inception}
    for name, recorded in (("vae", {"vae": "/another/vae"}), ("scaled", {"latent_scaling_factor": 0.5})):
        (tmp_path / name).mkdir()
        info = {"models": models, "vae": evaluated["sd"], "latent_scaling_factor": None, **recorded}
        (tmp_path / name / "reference.json").write_text(json.dumps(info))
    out = ["--out", str(tmp_path / "out")]
    cases = [
        ([str(tmp_path / "nowhere"), *options, "--captions", val], r"model: .*nowhere does not exist"),
        ([trained, *options, "--prompts", str(tmp_path / "missing.txt")], r"--prompts: cannot read .*missing.txt"),
        ([trained, *options, "--prompts", str(tmp_path / "empty.txt")], r"--prompts: .*empty.txt holds no prompts"),
        ([trained, *options, "--captions", str(tmp_path / "absent")], r"--captions: .*absent matches no parquet"),
        (
            [trained, *options, "--captions", str(tmp_path / "narrow")],
            r"--captions: .*part-0.parquet's column 'caption_latents' holds 1232 caption embedding values a row; "
            r".*checkpoint_000000002 was trained on captions of shape 77x32 \(2464 a row\)",
        ),
        (
            [trained, *options, "--prompts", prompts, "--reference", val],
            r"--prompts: .*checkpoint_000000002 records no text encoder .*give --text-encoder",
        ),
        (
            [trained, *options, "--prompts", prompts, "--text-encoder", evaluated["sd"]],
            r"--reference: fd_dinov2, fd_inception compares the samples with reference images, and --prompts have "
            r"none: give --reference DATA",
        ),
        (
            [trained, *options, "--captions", val, "--reference", str(tmp_path / "stats")],
            r"--reference: .*stats's fd_dinov2 statistics are of the feature model /another/dinov2, not .*dinov2",
        ),
        (
            [trained, *options, "data.latent_scaling_factor=0.18215", "--captions", val],
            r"data\.latent_scaling_factor: .*part-0\.parquet records that its latents are already multiplied by "
            r"[0-9.]+ \(parquet metadata sdtrain\.latent_scaling_factor\); scaling them by 0\.18215 again",
        ),
        (
            [trained, *options, f"eval.vae={evaluated['sd']}", "--captions", val, "--reference", str(tmp_path / "vae")],
            r"eval\.vae: .*sd, but --reference: .*vae's statistics \(reference\.json\) are of images decoded by "
            r"/another/vae",
        ),
        (
            [trained, *options, "--captions", val, "--reference", str(tmp_path / "scaled")],
            r"data\.latent_scaling_factor: None, but --reference: .*scaled's statistics \(reference\.json\) were "
            r"measured from latents scaled by data\.latent_scaling_factor 0\.5",
        ),
        ([trained, "--captions", val], r"eval: nothing to measure: set eval.dinov2"),
        (
            [trained, *options, "sample_grid.steps=1000", "--captions", val],
            r"sample_grid\.steps: 1000 steps with sample_grid\.sampler=ddim on .*checkpoint_000000002's noise "
            r"schedule of 1000 timesteps \(num_train_timesteps\): .*every evaluation task would fail when it samples; "
            r"set sample_grid\.steps below 1000",
        ),
    ]
    for argv, message in cases:
        code, err = _run([*argv, *out], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert err.startswith("error: ") and re.search(message, err), (message, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_storage_failing_past_its_retries_exits_75_in_one_line_not_as_bad_input(
    evaluated, offline, flaky_proxy, s3_bucket, tmp_path, capsys
):
    """--captions on S3 throttled past the client's retries: the one-paragraph StorageUnavailable the training
    command lines print and exit 75 (run again), not a traceback and exit 1, nor exit 2 ("fix your input")."""
    import boto3

    from sdtrain.storage.s3 import configure_s3

    val = evaluated["root"] / "val" / "part-0.parquet"
    boto3.client("s3").upload_file(str(val), "sdtrain-test", "val/part-0.parquet")
    endpoint, log = flaky_proxy("throttle", 10**6)
    configure_s3(endpoint, 2)
    argv = [str(evaluated["checkpoint"]), *offline["options"], "--captions", f"{s3_bucket}/val/"]
    code, err = _run([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 75 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, err)
    assert err.startswith(
        f"error: --captions: cannot list {s3_bucket}/val/: object storage failed after 2 attempt(s) with backoff ("
    ), err
    assert "not bad input: run again later, or raise storage.max_attempts" in err
    assert log.read_text().split() and not (tmp_path / "out").exists()


def test_the_entrypoint_as_users_run_it(evaluated, offline, tmp_path):
    trained, val = str(evaluated["checkpoint"]), str(evaluated["root"] / "val")
    command = [sys.executable, str(REPO / "entrypoints" / "evaluate.py"), trained, *offline["options"]]
    done = subprocess.run([*command, "--captions", val, "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (
        "| fd_dinov2 | lower is better |" in done.stdout and "wrote " + str(tmp_path / "evaluation.json") in done.stdout
    )
    assert _results(tmp_path)["models"][0]["model"] == trained
    refused = subprocess.run([*command, "--prompts", str(tmp_path / "none.txt")], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --prompts: cannot read"), refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


class _TransformersFiveClip(torch.nn.Module):
    """torchmetrics 1.9 reads CLIPModel.get_image_features / get_text_features as tensors; transformers 5 returns an
    output whose pooler_output they are: the same model, answering as torchmetrics expects."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def get_image_features(self, *args, **kwargs):
        return self.model.get_image_features(*args, **kwargs).pooler_output

    def get_text_features(self, *args, **kwargs):
        return self.model.get_text_features(*args, **kwargs).pooler_output


class _Features(torch.nn.Module):
    """One of our feature extractors as the module torchmetrics' FrechetInceptionDistance calls on (N, 3, H, W) uint8
    images (float64 features: its result keeps their dtype)."""

    def __init__(self, extract):
        super().__init__()
        self.extract = extract

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.extract(images.permute(0, 2, 3, 1).numpy()))


def _photos(count: int, height: int, width: int, seed: int) -> np.ndarray:
    from sklearn.datasets import load_sample_images

    rng, photos, crops = np.random.default_rng(seed), load_sample_images().images, []
    for i in range(count):
        photo = photos[i % 2]
        y, x = rng.integers(0, photo.shape[0] - 150), rng.integers(0, photo.shape[1] - 225)
        crops.append(np.asarray(Image.fromarray(photo[y : y + 150, x : x + 225]).resize((width, height))))
    return np.stack(crops)


def test_the_commands_docs_evaluation_md_shows_parse_as_written(monkeypatch, capsys):
    """Its examples put key=value overrides after the options, which argparse's plain parse refused ("unrecognized
    arguments", exit 2 before anything ran); here they get as far as the model, which this checkout lacks."""
    import shlex

    text = (REPO / "docs" / "evaluation.md").read_text().replace("\\\n", " ")
    commands = [line for line in text.splitlines() if line.startswith(".venv/bin/python entrypoints/evaluate.py ")]
    assert len(commands) >= 2, commands
    monkeypatch.chdir(REPO)
    for command in commands:
        assert evaluate_main(shlex.split(command)[2:]) == 2
        error = capsys.readouterr().err
        assert error.startswith("error: ") and "runs/small-256" in error and "unrecognized" not in error, error


def test_frechet_distance_and_clip_score_agree_with_torchmetrics(evaluated, tmp_path):
    """torchmetrics' FrechetInceptionDistance with our feature models as its extractor (the Inception file as FID
    calls it on uint8 images; DINOv2 as FD_DINOv2 preprocesses), and its CLIPScore with the tiny CLIP model and CLIP's
    own image processor, on real photographs: our numbers are theirs. CLIP's processor crops a non-square image's
    center, where ClipScore used to squeeze it to a square (aspect-ratio buckets' samples scored otherwise)."""
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.multimodal.clip_score import CLIPScore
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    config = evaluated["config"]
    real, fake = _photos(40, 32, 32, seed=0), _photos(40, 32, 32, seed=1)
    for extractor in (InceptionFeatures(config.eval.inception), DinoFeatures(config.eval.dinov2)):
        fid = FrechetInceptionDistance(feature=_Features(extractor), reset_real_features=False)
        ours = [FeatureStats(extractor.dim), FeatureStats(extractor.dim)]
        for images, is_real, stats in ((real, True, ours[0]), (fake, False, ours[1])):
            for batch in np.split(images, 4):  # both accumulate batch by batch
                fid.update(torch.from_numpy(batch).permute(0, 3, 1, 2), real=is_real)
                stats.add(extractor(batch))
        theirs = float(fid.compute())
        # Both covariances are singular here (DINOv2's layer-normed features always are, and dead units of the tiny
        # Inception): ours then adds pytorch-fid's 1e-6 * I to both, which torchmetrics does not, moving the distance
        # by about 2 * D * 1e-6.
        offset = 4 * extractor.dim * 1e-6
        assert frechet_distance(ours[1], ours[0]) == pytest.approx(theirs, rel=1e-6, abs=offset), extractor

    clip_dir = write_tiny_clip(str(tmp_path / "clip"))
    model = _TransformersFiveClip(CLIPModel.from_pretrained(clip_dir))
    size = {"height": 32, "width": 32}
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=size),
        tokenizer=AutoTokenizer.from_pretrained(clip_dir),
    )
    scorer = ClipScore(clip_dir)
    texts = [TEXTS[i % len(TEXTS)] for i in range(8)]
    # Square and not, each side a multiple of the model's 32 px (resized alike) or not (PIL's bicubic and torch's
    # antialiased one differ by hundredths of a point).
    for (height, width), tolerance in (((32, 32), 1e-4), ((32, 48), 1e-4), ((48, 32), 1e-4), ((64, 96), 0.25)):
        images = _photos(8, height, width, seed=height + width)
        ours = scorer(images, texts)
        per_pair = []
        for image, text in zip(images, texts, strict=True):
            metric = CLIPScore(model_name_or_path=lambda: (model, processor))
            metric.update(torch.from_numpy(image).permute(2, 0, 1), [text])
            per_pair.append(float(metric.compute()))
        np.testing.assert_allclose(ours, per_pair, atol=tolerance, err_msg=f"{height}x{width}")
        assert 0 < np.count_nonzero(ours) < len(ours)  # some pairs clamped to 0, some not


def _bucketed_set(root, files: int = 2, rows: int = 24, row_group: int = 2) -> str:
    """Parquet rows as preprocessing writes them, in ``files`` files of ``rows`` rows: two aspect-ratio buckets (sorted
    by bucket within each file, so a bucket's rows lie apart in the set), random latents and caption embeddings of
    SD2's width (~158 KB a row, as COCO-30k's), a text and a label each, ``row_group`` rows a row group."""
    from sdtrain.data.metadata import BUCKET_SHAPES
    from sdtrain.preprocess.outputs import parquet_bytes, shard_table

    rng, shapes = np.random.default_rng(0), [[4, 16, 16], [4, 16, 24]]
    (root / "set").mkdir()
    for f in range(files):
        made = [
            {
                "latents": rng.standard_normal(shapes[i % 3 == 2]),
                "embeddings": rng.standard_normal((77, 1024)),
                "bucket": int(i % 3 == 2),
                "caption": f"file {f} row {i}",
                "key": f"{f}-{i}",
            }
            for i in range(rows)
        ]
        columns = {"latents": "image_latents_256", "embeddings": "caption_latents"}
        table = shard_table(made, columns, {BUCKET_SHAPES: json.dumps(shapes)})
        table = table.append_column("label", pa.array(np.arange(rows) + 100 * f))
        (root / "set" / f"part-{f}.parquet").write_bytes(parquet_bytes(table, row_group))
    return str(root / "set")


def _bytes_read() -> int:
    """What this process has read from files so far (Linux's /proc/self/io: every read call's bytes)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's /proc/self/io")
def test_a_task_reads_and_holds_only_its_part_of_the_set_and_the_parts_are_the_whole_sets_rows(tmp_path):
    """--tasks N: each task used to read all eval.num_samples rows and hold them (and a copy), sampling 1/N of them
    (COCO-30k's 30k rows of SD2 embeddings: ~9.5 GB a task). Each now reads only the row groups that hold its share of
    each shape group and holds only those rows; together the parts are the whole set's rows, each at its place in its
    group (what its noise is drawn by: the same samples as before)."""
    val = _bucketed_set(tmp_path)
    measured = ["eval.clip=unused", "eval.class_agreement=true", "eval.num_samples=36"]  # texts and labels read
    config = tiny_config(f"data.train=[{val}]", f"data.val=[{val}]", *measured)
    shapes = ((4, 16, 16), (77, 1024))
    read_eval_rows(config, *shapes)  # anything a first read loads, loaded
    before = _bytes_read()
    whole = read_eval_rows(config, *shapes)
    whole_bytes = _bytes_read() - before
    parts, part_bytes = [], []
    for k in range(3):
        before = _bytes_read()
        parts.append(read_eval_rows(config, *shapes, part=(k, 3)))
        part_bytes.append(_bytes_read() - before)
    assert len(whole) == 36 and [(g.shape, len(g.rows)) for g in whole.groups] == [((4, 16, 16), 28), ((4, 16, 24), 8)]
    assert whole.files == parts[0].files and len(whole.files) == 2
    # Each part holds its share alone: 12 of the 36 rows' 5.7 MB of embeddings, not all of them...
    assert [len(part) for part in parts] == [11, 12, 13]
    for part in parts:
        assert len(part.captions) == len(part.texts) == len(part.labels) == len(part)
    # ...and read about that share of the files (their footers too), where each read all of it.
    assert all(read < 0.5 * whole_bytes for read in part_bytes) and sum(part_bytes) < 1.4 * whole_bytes, part_bytes
    for group in whole.groups:
        for k, part in enumerate(parts):
            (own,) = [g for g in part.groups if g.shape == group.shape]
            taken, within = group.share((k, 3))
            assert own.share((k, 3)) == (slice(0, len(own.rows)), within) and (own.first, own.size) == within
            rows = group.rows[taken]
            np.testing.assert_array_equal(part.captions[own.rows], whole.captions[rows])
            np.testing.assert_array_equal(own.latents, group.latents[taken])
            assert [part.texts[i] for i in own.rows] == [whole.texts[i] for i in rows]
            np.testing.assert_array_equal(part.labels[own.rows], whole.labels[rows])
            with pytest.raises(ValueError, match=f"part {(k + 1) % 3} of 3 takes rows"):
                own.share(((k + 1) % 3, 3))  # rows read for one part give no other
    # More tasks than rows: a part without rows reads none and holds none.
    two = tiny_config(f"data.train=[{val}]", f"data.val=[{val}]", *measured[:2], "eval.num_samples=2")
    empty = read_eval_rows(two, *shapes, part=(0, 3))
    assert (len(empty), empty.groups, empty.captions.shape, empty.texts) == (0, [], (0, 77, 1024), [])
    assert empty.labels is not None and len(empty.labels) == 0


def test_each_task_samples_and_measures_what_it_did_from_the_whole_sets_rows(evaluated):
    """A task of --tasks 3 (measure_part, reading only its part's rows, of the set and of the reference) samples the
    rows with the noise it did when it read every row and took its share: the same measures, and merged, the metrics
    of the whole set."""
    from sdtrain.artifacts.loading import load_model
    from sdtrain.evaluation.offline import OfflineSet, measure_part, merge_parts, set_rows

    config = tiny_config(*test_evaluation._eval_keys(evaluated["config"]), *test_evaluation._rest(evaluated["config"]))
    checkpoint = str(evaluated["checkpoint"])
    task = OfflineSet(config.to_dict(), [checkpoint], "auto", evaluated["sd"], captions=config.data.val[0])
    parts = [measure_part(task, (k, 3)) for k in range(3)]
    evaluator, loaded = Evaluator(config, None, evaluated["sd"]), load_model(checkpoint)
    rows = read_eval_rows(config, (4, 16, 16), (77, 32))
    for k, part in enumerate(parts):
        (measured,), before = part.measures, evaluator.measure(loaded, rows, (k, 3))
        first, stop = part_range(8, (k, 3))
        assert measured.samples == before.samples == stop - first == len(set_rows(task, config, loaded, (k, 3)))
        np.testing.assert_allclose(measured.clip_scores, before.clip_scores, rtol=1e-6)
        np.testing.assert_allclose(measured.generated["fd_dinov2"].mean, before.generated["fd_dinov2"].mean, rtol=1e-6)
        reference = evaluator.reference_stats(rows, loaded, (k, 3))["fd_dinov2"]
        assert part.reference["fd_dinov2"].count == reference.count == measured.samples
        np.testing.assert_allclose(part.reference["fd_dinov2"].mean, reference.mean, rtol=1e-6)
    merged = merge_parts(parts)
    ours, whole = metrics_of(config, merged.measures[0], merged.reference), evaluator.evaluate(loaded)
    for metric in ("fd_dinov2", "clip_score"):
        assert ours[metric] == pytest.approx(whole[metric], rel=1e-4), metric


def test_the_rows_a_part_samples_are_taken_from_the_caption_embeddings_by_index_not_a_copy_of_all():
    """Sampling used to copy every row's caption embeddings first (torch.tensor of the whole array, held while the
    rows were sampled), whatever share of them a task samples; now only the rows asked for are copied."""
    import psutil

    from sdtrain.evaluation.eval_rows import EvalRows, ShapeGroup

    captions = np.ones((500, 77, 1024), np.float16)  # 79 MB, written: in memory
    rows = EvalRows([ShapeGroup((4, 16, 16), np.arange(500), None)], captions, None, None, [], [])
    evaluator = Evaluator(tiny_config("data.train=[x]"), None, None)  # no metric: no model loaded
    process = psutil.Process()
    before = process.memory_info().rss
    captions_of = evaluator._captions_of(rows)
    chosen = captions_of(None, np.array([3, 5]))
    grown = process.memory_info().rss - before
    assert grown < 40e6, f"{grown / 1e6:.0f} MB"
    np.testing.assert_array_equal(chosen.hidden.numpy(), captions[[3, 5]].astype(np.float32))
