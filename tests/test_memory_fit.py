"""train.micro_batch_size against the cluster's GPU memory (sdtrain.driver.memory_fit): auto's choice, the refusal of
a size predicted not to fit, and the driver refusing it before any worker starts, on a Ray cluster whose node
reports an A10G."""

import re

import pytest
from conftest import write_latents

from sdtrain.config.loader import load_config
from sdtrain.driver.memory_fit import cluster_gpu, fit_micro_batch
from sdtrain.errors import ConfigError
from sdtrain.train.build import driver_precision

SMALL_512 = ((4, 64, 64), (77, 1024))  # the small UNet's latents at 512 px and OpenCLIP-H captions


def _small(*overrides, data="/unused"):
    return load_config(None, ["model.preset=small", f"data.train={data}", "scaling.use_gpu=true", *overrides])


def test_the_clusters_gpu_is_its_one_known_accelerator_type():
    assert cluster_gpu({"CPU": 32, "GPU": 4, "accelerator_type:A10G": 4}) == "A10G"
    assert cluster_gpu({"CPU": 32, "GPU": 8, "accelerator_type:A10G": 4, "accelerator_type:L4": 4}) is None
    assert cluster_gpu({"CPU": 8}) is None  # no GPU node up yet
    assert cluster_gpu({"GPU": 1, "accelerator_type:MI999": 1}) is None


def test_a_size_label_on_every_node_of_a_model_names_its_variant():
    """Ray names every A100 "A100" and leaves its size labels (accelerator_type:A100-80G, Ray's NVIDIA_A100_80G) to
    the cluster to add beside it: with one on every A100 node the fit is against that size, where the two labels
    made the GPU unknown (auto at null's size: the whole per-GPU batch at once); with some nodes unlabelled, or two
    sizes, against the A100's range."""
    from sdtrain.model.hardware import has_bf16, memory_range

    labelled = {"GPU": 16, "accelerator_type:A100": 2, "accelerator_type:A100-80G": 2}
    assert cluster_gpu(labelled) == "A100-80G" and cluster_gpu({"accelerator_type:A100-80G": 1}) == "A100-80G"
    assert cluster_gpu({**labelled, "accelerator_type:A100": 3}) == "A100"  # a node without the label
    assert cluster_gpu({**labelled, "accelerator_type:A100-40G": 1}) == "A100"
    assert cluster_gpu({**labelled, "accelerator_type:H100": 1}) is None
    assert cluster_gpu({"accelerator_type:A100-96G": 1}) is None  # no A100 is sold with 96 GB
    mib = 2**20
    assert memory_range("A100-80G") == (81920 * mib, 81920 * mib) and memory_range("A100-40G") == (40960 * mib,) * 2
    assert has_bf16("A100-80G") is True and has_bf16("V100-32G") is False
    # 64 samples of the small UNet at 512 px (~42 GiB): only an 80 GB A100 holds them, which the label says it is.
    config = _small("train.global_batch_size=128", "scaling.num_workers=2", "train.micro_batch_size=64")
    said = fit_micro_batch(config, "A100", *SMALL_512, "bf16-mixed")[1]
    assert said is not None and said.endswith("only its 80.0 GiB variant fits them")
    assert fit_micro_batch(config, "A100-80G", *SMALL_512, "bf16-mixed") == (config, None)
    auto = _small("train.global_batch_size=128", "scaling.num_workers=2", "train.micro_batch_size=auto")
    fitted, said = fit_micro_batch(auto, "A100-80G", *SMALL_512, "bf16-mixed")
    assert fitted.train.micro_batch_size == 64 and said is not None and said.endswith("on A100-80G (80.0 GiB)")


def test_auto_picks_the_largest_common_size_that_fits_and_keeps_the_global_batch():
    # 192, 128 or 96 a worker: sizes 32 and its divisors work at every world size. At 32 the small UNet at 512 px
    # is predicted to need ~23.5 GiB with the runtime, more than an A10G's 22.5 GiB; 16 needs ~14.
    config = _small("train.global_batch_size=384", "scaling.num_workers=[2,4]", "train.micro_batch_size=auto")
    fitted, said = fit_micro_batch(config, "A10G", *SMALL_512, "bf16-mixed")
    assert fitted.train.micro_batch_size == 16 and fitted.train.global_batch_size == 384
    assert [fitted.batch_layout(n).accumulation for n in (2, 3, 4)] == [12, 8, 6]
    assert said is not None and said.startswith("train.micro_batch_size=auto: 16, predicted ") and "A10G" in said
    # An H100 takes the largest common size; with no GPU known, auto is null's rule.
    assert fit_micro_batch(config, "H100", *SMALL_512, "bf16-mixed")[0].train.micro_batch_size == 32
    unknown, said = fit_micro_batch(config, None, *SMALL_512, "bf16-mixed")
    assert unknown.train.micro_batch_size == 32 and said is None


def test_a_size_predicted_not_to_fit_is_refused_naming_the_numbers():
    config = _small("train.global_batch_size=128", "scaling.num_workers=2", "train.micro_batch_size=64")
    with pytest.raises(
        ConfigError, match=r"train.micro_batch_size: 64 samples a rank are predicted to need 4\d\.\d GiB"
    ):
        fit_micro_batch(config, "A10G", *SMALL_512, "bf16-mixed")
    # What fits the largest variant is not refused, but auto would not pick it: over 90% of 22.5 GiB leaves too
    # little for what the caching allocator reserves beyond the tensors, and the line says so...
    fits = _small("train.global_batch_size=56", "scaling.num_workers=2", "train.micro_batch_size=28")
    fitted, said = fit_micro_batch(fits, "A10G", *SMALL_512, "bf16-mixed")
    assert fitted == fits and said is not None
    assert re.match(
        r"train.micro_batch_size: 28 samples a rank are predicted to need 2\d\.\d GiB, over 90% of a 22\.5 GiB A10G",
        said,
    )
    # ...which a size under 90% does not get.
    roomy = _small("train.global_batch_size=128", "scaling.num_workers=2", "train.micro_batch_size=16")
    assert fit_micro_batch(roomy, "A10G", *SMALL_512, "bf16-mixed") == (roomy, None)
    # ...nor anything where the GPU is not known (CPU workers, a cluster with no GPU node up yet).
    assert fit_micro_batch(config, None, *SMALL_512, "bf16-mixed") == (config, None)
    # An A100 may have 80 GB: 64 samples (~42 GiB) are not refused there, and the line says which A100 they need.
    fitted, said = fit_micro_batch(config, "A100", *SMALL_512, "bf16-mixed")
    assert fitted == config and said is not None and said.endswith("only its 80.0 GiB variant fits them"), said


def test_the_fit_measures_against_the_memory_the_gpu_reports_not_its_datasheet_size():
    """An A10G sold as 24 GB with ECC on its GDDR6 reports 23028 MiB (22.5 GiB; nvidia-smi's memory.total): a size
    predicted between that and 24 GiB cannot fit and is refused, and auto fills 90% of 22.5 GiB, not of 24."""
    from sdtrain.model.hardware import NODE_TYPES, memory_range

    # 32 samples: ~23.5 GiB with the runtime, under 24 GiB but over what the device holds.
    over = _small("train.global_batch_size=128", "scaling.num_workers=2", "train.micro_batch_size=32")
    with pytest.raises(ConfigError, match=r"predicted to need 23\.\d GiB .*more than a A10G's 22\.5 GiB"):
        fit_micro_batch(over, "A10G", *SMALL_512, "bf16-mixed")
    # 28 samples (~21.2 GiB) fit 90% of 24 GiB (21.6) but not of 22.5 (20.2): auto halves them.
    auto = _small("train.global_batch_size=56", "scaling.num_workers=2", "train.micro_batch_size=auto")
    fitted, said = fit_micro_batch(auto, "A10G", *SMALL_512, "bf16-mixed")
    assert fitted.train.micro_batch_size == 14 and said is not None and said.endswith("on A10G (22.5 GiB)"), said
    mib = 2**20
    assert memory_range("A10G") == (23028 * mib, 23028 * mib)
    assert memory_range("A100") == (40960 * mib, 81920 * mib)  # HBM2 and HBM2e: the datasheet's 40 and 80 GB are GiB
    assert NODE_TYPES["g5.8xlarge"].gpu_device_bytes == 23028 * mib
    assert NODE_TYPES["g6e.12xlarge"].gpu_device_bytes == 46068 * mib
    assert NODE_TYPES["p5.48xlarge"].gpu_device_bytes == 81559 * mib


def test_token_id_captions_count_the_text_encoders_every_rank_holds():
    """Data of token ids: each rank also holds the frozen text encoder that encodes them in the step (SD 2's
    OpenCLIP-H text tower, ~0.7 GB in bf16), and the prediction says so."""
    from transformers import CLIPTextConfig

    openclip_h = CLIPTextConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16, hidden_act="gelu"
    )
    config = _small("train.global_batch_size=128", "scaling.num_workers=2", "train.micro_batch_size=64")
    with pytest.raises(ConfigError, match=r"4\d\.\d GiB \(the text encoders' 0\.[67] included\)") as held:
        fit_micro_batch(config, "A10G", *SMALL_512, "bf16-mixed", (openclip_h,))
    with pytest.raises(ConfigError) as plain:
        fit_micro_batch(config, "A10G", *SMALL_512, "bf16-mixed")
    assert "text encoders" not in str(plain.value) and str(held.value) != str(plain.value)


def config_overrides(config):
    return [
        f"train.global_batch_size={config.train.global_batch_size}",
        f"scaling.num_workers={config.scaling.num_workers}",
        f"train.micro_batch_size={config.train.micro_batch_size}",
        f"run.storage_path={config.run.storage_path}",
    ]


def test_the_driver_predicts_with_the_precision_of_the_clusters_gpu_not_its_own_machines():
    """The driver's machine (an Anyscale head node) has no GPU: auto resolves from the cluster's GPU model, from the
    hardware table, as each worker will on its own GPU."""
    config = _small()
    assert driver_precision(config.train, True, "A10G") == "bf16-mixed"
    assert driver_precision(config.train, True, "T4") == "16-mixed"  # no bf16: the workers take 16-mixed
    assert driver_precision(config.train, True, None) == "bf16-mixed"  # not known yet: 16-mixed holds the same memory
    assert driver_precision(config.train, False, None) == "32-true"
    assert driver_precision(_small("train.precision=32-true").train, True, "A10G") == "32-true"
    fsdp = _small("train.strategy=fsdp").train
    assert driver_precision(fsdp, True, "H100") == "bf16-mixed"
    with pytest.raises(ConfigError, match=r"auto would be 16-mixed on this GPU \(T4, no bf16\)"):
        driver_precision(fsdp, True, "T4")


def test_the_driver_refuses_before_any_worker_starts_on_a_cluster_of_a10gs(tmp_path):
    """A Ray cluster of this machine whose node says it has an A10G (Ray sets accelerator_type on GPU nodes): the
    driver checks the data, joins the cluster and refuses the size before it builds the trainer."""
    import ray
    from ray.cluster_utils import Cluster

    from sdtrain.driver.run import train

    write_latents(tmp_path / "train/a.parquet", rows=128, latent_shape=(4, 64, 64), caption_shape=(77, 1024))
    config = _small(
        "train.global_batch_size=128",
        "scaling.num_workers=2",
        "train.micro_batch_size=64",
        f"run.storage_path={tmp_path}/runs",
        "export.enabled=false",  # latents that name no VAE: no pipeline to export
        data=str(tmp_path / "train"),
    )
    # FSDP with precision auto: the driver decides the precision it predicts with from the cluster's GPU (an A10G has
    # bf16), not from its own machine, which has no GPU (job.yaml's head node; this one): it called
    # torch.cuda.get_device_name() there, which raised, and would have predicted 16-mixed on a CUDA build.
    fsdp = _small(
        *config_overrides(config), "train.strategy=fsdp", "export.enabled=false", data=str(tmp_path / "train")
    )
    if ray.is_initialized():
        ray.shutdown()  # the session's cluster starts again for the tests after this one
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 2,
            "resources": {"accelerator_type:A10G": 2},
            "include_dashboard": False,
        },
    )
    try:
        ray.init(address=cluster.address)
        with pytest.raises(ConfigError, match=r"more than a A10G's 22\.5 GiB"):
            train(config)
        with pytest.raises(ConfigError, match=r"more than a A10G's 22\.5 GiB"):
            train(fsdp)
        assert not list(tmp_path.rglob("checkpoint_*"))  # no worker started
    finally:
        ray.shutdown()
        cluster.shutdown()
