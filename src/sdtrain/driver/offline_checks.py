"""The checks of an offline evaluation (entrypoints/evaluate.py) before any model samples: everything the input can
get wrong is refused here, in one line naming the argument or file (exit status 2): a missing model, set, prompt
file or reference, captions of another width than a model's, prompts for a model whose text encoder nobody names, a
Frechet distance without a reference."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sdtrain.artifacts.loading import LoadedModel
from sdtrain.config.schema import Config
from sdtrain.errors import ConfigError, DataError
from sdtrain.evaluation.offline import FRECHET, OfflineSet
from sdtrain.sampling.sampler import check_sampler_steps


@dataclass
class Prepared:
    """An offline evaluation checked and ready: the set, the models loaded, the reference if given as statistics."""

    task: OfflineSet
    config: Config
    loaded: list[LoadedModel]
    given_reference: dict = field(default_factory=dict)
    """Statistics by metric (--reference DIR), or {}: the parts measure the reference."""
    reference_info: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def prepare(args: argparse.Namespace, models: list[str], overrides: list[str]) -> Prepared:
    """The evaluation checked (see the module docstring) and its models loaded."""
    from sdtrain.artifacts.loading import load_model
    from sdtrain.config.loader import load_config

    source = args.captions or args.prompts
    data = [f"data.train={json.dumps([source])}", f"data.val={json.dumps([source])}"]
    config = load_config(args.config, [*overrides, *data])
    if not config.eval.enabled:
        raise ConfigError(
            "eval: nothing to measure: set eval.dinov2, eval.inception, eval.clip or eval.class_agreement "
            "(in --config or as key=value)"
        )
    loaded = [load_model(model, args.weights) for model in models]
    _check_sampler_steps(config, loaded)
    task = OfflineSet(config=config.to_dict(), models=models, weights=args.weights, vae=None)
    prepared = Prepared(task, config, loaded)
    if args.captions:
        _check_captions(prepared, args.captions)
    else:
        _check_prompts(prepared, args.prompts, args.text_encoder)
    _check_reference(prepared, args.reference)
    _check_stored_scaling(prepared)
    _check_vae(prepared)
    return prepared


def _check_sampler_steps(config: Config, loaded: list[LoadedModel]) -> None:
    """sample_grid.steps against each model's own noise schedule, which training's driver check never saw."""
    for model in loaded:
        check_sampler_steps(
            config.sample_grid.steps,
            config.sample_grid.sampler,
            dict(model.noise_scheduler.config),
            "sample_grid.steps",
            schedule=f"{model.source}'s noise schedule",
            fails="every evaluation task would fail when it samples",
        )


def _check_captions(prepared: Prepared, captions: str) -> None:
    """--captions: its files, the columns the metrics read, and captions each model can take."""
    from sdtrain.data.footer import read_schema
    from sdtrain.data.listing import list_dataset

    config = prepared.config
    first = list_dataset([captions], "--captions").paths[0]
    schema = read_schema(first, "--captions")
    wanted = [config.data.latent_column, config.data.caption_column]
    wanted += [config.eval.text_column] if config.eval.clip is not None else []
    wanted += ["label"] if config.eval.class_agreement else []
    _need_columns(schema.names, wanted, f"--captions: {first}")
    token_ids, width = _caption_width(first, schema, config.data.caption_column, "--captions")
    for loaded in prepared.loaded:
        caption_shape = loaded.trained_shapes("--captions")[1]
        expected = caption_shape[0] if token_ids else _product(caption_shape)
        if width != expected:
            what = "token ids" if token_ids else "caption embedding values"
            shape = "x".join(map(str, caption_shape))
            raise DataError(
                f"--captions: {first}'s column {config.data.caption_column!r} holds {width} {what} a row; "
                f"{loaded.source} was trained on captions of shape {shape} ({expected} a row)"
            )
        if token_ids and _text_encoder(loaded) is None:
            raise DataError(f"--captions: {first} holds token ids, but {loaded.source} records no text encoder")
    prepared.task = replace(prepared.task, captions=captions)


def _check_prompts(prepared: Prepared, path: str, text_encoder: str | None) -> None:
    """--prompts: a file of prompts, and a text encoder for each model whose output is that model's caption shape."""
    from sdtrain.model.token_captions import text_encoder_config
    from sdtrain.sampling.prompts import read_prompts_file

    if prepared.config.eval.class_agreement:
        raise ConfigError(
            "eval.class_agreement: --prompts have no labels; it needs --captions data with a label column"
        )
    prompts = read_prompts_file(path, "--prompts")
    first = prepared.loaded[0]
    for loaded in prepared.loaded:
        source = text_encoder or _text_encoder(loaded)
        if source is None:
            raise DataError(
                f"--prompts: {loaded.source} records no text encoder (its data was not written by "
                "entrypoints/preprocess.py, or is not reachable from here); give --text-encoder"
            )
        encoder = text_encoder_config(source)
        shape = (int(encoder.max_position_embeddings), int(encoder.hidden_size))
        if loaded.caption_shape is not None and shape != tuple(loaded.caption_shape):
            raise DataError(
                f"--text-encoder: {source} encodes prompts to shape {shape[0]}x{shape[1]}, but {loaded.source} was "
                f"trained on captions of shape {'x'.join(map(str, loaded.caption_shape))}"
            )
        if loaded is not first and loaded.latent_shape != first.latent_shape:
            prepared.notes.append(
                f"{loaded.source} trained at latents {loaded.latent_shape}; both models are sampled at the first's, "
                f"{first.latent_shape}"
            )
    latent_shape = first.trained_shapes("--prompts")[0]
    shape3 = (int(latent_shape[0]), int(latent_shape[1]), int(latent_shape[2]))
    task = replace(prepared.task, prompts=prompts, prompts_file=path, text_encoder=text_encoder, latent_shape=shape3)
    prepared.task = task


def _check_reference(prepared: Prepared, reference: str | None) -> None:
    """What the Frechet distances compare with: --reference (statistics, or parquet rows), else --captions' rows."""
    from sdtrain.evaluation.offline import REFERENCE_INFO, read_reference
    from sdtrain.storage.filesystems import read_bytes

    config = prepared.config
    asked = {metric: getattr(config.eval, key) for metric, key in FRECHET.items() if getattr(config.eval, key)}
    if not asked:
        if reference is not None:
            prepared.notes.append("--reference is not used: no Frechet distance is measured")
        return
    if reference is None:
        if prepared.task.prompts is not None:
            raise DataError(
                f"--reference: {', '.join(asked)} compares the samples with reference images, and --prompts have "
                "none: give --reference DATA (parquet rows with latents) or the reference/ directory of an earlier "
                "call, or leave out " + ", ".join(f"eval.{FRECHET[m]}" for m in asked)
            )
        prepared.reference_info = {"source": prepared.task.captions, "kind": "the set's own images"}
        return
    recorded = read_bytes(f"{reference.rstrip('/')}/{REFERENCE_INFO}")
    if recorded is not None:
        _check_recorded(reference, json.loads(recorded), config)
        prepared.given_reference, info = read_reference(reference, asked)
        prepared.reference_info = {
            "source": reference,
            "kind": "statistics",
            "measured_from": f"{info.get('kind')} of {info.get('source')}",
            "vae": info.get("vae"),
        }
        prepared.task = replace(prepared.task, measure_reference=False)
        return
    _check_reference_rows(prepared, reference)


def _check_reference_rows(prepared: Prepared, reference: str) -> None:
    from sdtrain.data.footer import read_schema
    from sdtrain.data.listing import list_dataset

    config = prepared.config
    first = list_dataset([reference], "--reference").paths[0]
    schema = read_schema(first, "--reference")
    _need_columns(schema.names, [config.data.latent_column, config.data.caption_column], f"--reference: {first}")
    _, width = _caption_width(first, schema, config.data.caption_column, "--reference")
    prepared.task = replace(prepared.task, reference=reference, reference_width=width)
    prepared.reference_info = {"source": reference, "kind": "images of parquet rows"}


def _check_recorded(reference: str, info: dict, config: Config) -> None:
    """Statistics --reference DIR recorded as made with another VAE than eval.vae names, or from latents scaled by
    another data.latent_scaling_factor, are refused: they are of other images. A reference.json from before these
    were recorded is taken as it is."""
    from sdtrain.evaluation.offline import REFERENCE_INFO

    where = f"--reference: {reference}'s statistics ({REFERENCE_INFO})"
    if config.eval.vae is not None and info.get("vae") is not None and info["vae"] != config.eval.vae:
        raise ConfigError(
            f"eval.vae: {config.eval.vae}, but {where} are of images decoded by {info['vae']}; leave eval.vae unset, "
            "or measure the reference again with this VAE"
        )
    if "latent_scaling_factor" in info and info["latent_scaling_factor"] != config.data.latent_scaling_factor:
        raise ConfigError(
            f"data.latent_scaling_factor: {config.data.latent_scaling_factor}, but {where} were measured from latents "
            f"scaled by data.latent_scaling_factor {info['latent_scaling_factor']}: give the --config they were "
            "measured with, or measure the reference again"
        )


def _check_stored_scaling(prepared: Prepared) -> None:
    """The reference rows' latents (--reference DATA, else --captions) are multiplied by data.latent_scaling_factor
    before they are decoded, as training multiplies them: refused, as training refuses it
    (:func:`sdtrain.model.recipe.stored_latent_scaling`), where their files record that they carry a factor already."""
    from sdtrain.data.footer import read_schema
    from sdtrain.data.listing import list_dataset
    from sdtrain.model.recipe import stored_latent_scaling

    task = prepared.task
    if not prepared.reference_info or not task.measure_reference:
        return
    data, key = (task.reference, "--reference") if task.reference is not None else (task.captions, "--captions")
    if data is None:
        return
    first = list_dataset([data], key).paths[0]
    stored_latent_scaling([(first, read_schema(first, key).metadata)], prepared.config.data)


def _check_vae(prepared: Prepared) -> None:
    """The VAE that decodes: eval.vae, else the one the set's files (or the reference's, or its statistics) record,
    else the first model's; its files and the feature models' checked."""
    from sdtrain.artifacts.export import model_sources
    from sdtrain.data.metadata import VAE_SOURCE
    from sdtrain.evaluation.checks import check_eval_models

    config, task = prepared.config, prepared.task
    if not config.eval.needs_vae:
        return
    vae = config.eval.vae
    for key, data in (("--captions", task.captions), ("--reference", task.reference)):
        if vae is None and data is not None:
            vae = _recorded(data, VAE_SOURCE, key)
    vae = vae or prepared.reference_info.get("vae")
    sources = [model_sources(loaded) for loaded in prepared.loaded]
    vae = vae or (sources[0].vae if sources[0] is not None else None)
    if vae is None:
        raise ConfigError(
            "eval.vae: neither the data nor the model records the VAE its latents were encoded with; set eval.vae"
        )
    if len(sources) == 2 and sources[1] is not None and sources[1].vae != vae and config.eval.vae is None:
        prepared.notes.append(f"{prepared.loaded[1].source} records the VAE {sources[1].vae}; both decode with {vae}")
    check_eval_models(config, vae)
    prepared.task = replace(task, vae=vae)


def _need_columns(names: list[str], wanted: list[str], where: str) -> None:
    missing = [column for column in wanted if column not in names]
    if missing:
        raise DataError(f"{where} has no column {missing[0]!r} (its columns: {', '.join(names)})")


def _caption_width(file: str, schema, column: str, key: str) -> tuple[bool, int]:
    """(whether the column holds token ids, values a row)."""
    from sdtrain.data.decode import column_layout
    from sdtrain.data.inspection import first_row

    try:
        layout = column_layout(schema.field(column))
    except DataError as error:
        raise DataError(f"{key}: {file}'s column {column!r} {error}") from None
    width = layout.values_per_row or len(first_row(file, key, [column]).column(column)[0])
    return bool(layout.token_ids), int(width)


def _text_encoder(loaded: LoadedModel) -> str | None:
    from sdtrain.evaluation.checkpoint_eval import text_encoder_of

    return text_encoder_of(loaded)


def _recorded(data: str, name: str, key: str) -> str | None:
    """What the first file of ``data`` (named by ``key``) records under the parquet metadata ``name``."""
    from sdtrain.data.footer import read_schema
    from sdtrain.data.listing import list_dataset

    first = list_dataset([data], key).paths[0]
    value = (read_schema(first, key).metadata or {}).get(name.encode())
    return value.decode() if value else None


def _product(shape: Sequence[int]) -> int:
    out = 1
    for side in shape:
        out *= int(side)
    return out
