"""The communication model against hand-worked cases, the shipped jobs it chose, and docs/performance.md, which it
generates."""

import pytest
from conftest import REPO

from sdtrain.model.hardware import NODE_TYPES
from tools.performance_model import GBIT, LINK_EFFICIENCY, collective_seconds, predict_step
from tools.performance_report import JOB_FILES, REGENERATE, predict_job, read_job, render_markdown

PARAMS, FLOPS = 223_000_000, 145e9  # the small UNet at 256 px


def test_an_all_reduce_moves_twice_the_bytes_less_a_share_through_the_slowest_link():
    single = NODE_TYPES["g5.2xlarge"]
    nbytes = PARAMS * 4
    # 4 single-GPU nodes: a ring all-reduce sends 2 x 3/4 of the gradient through each node's 10 Gbit/s.
    assert collective_seconds(nbytes, single, 4, phases=2) == pytest.approx(2 * 0.75 * nbytes / (10 * GBIT * 0.7))
    # Within one node of 4 over PCIe, then across 2 such nodes over their 40 Gbit/s.
    quad = NODE_TYPES["g5.12xlarge"]
    intra = 2 * 0.75 * nbytes / (quad.intra_gbyte_s * 1e9 * LINK_EFFICIENCY)
    assert collective_seconds(nbytes, quad, 1, phases=2) == pytest.approx(intra)
    assert collective_seconds(nbytes, quad, 2, phases=2) == pytest.approx(intra + nbytes / (40 * GBIT * 0.7))


def test_a_step_hides_what_the_backward_pass_covers_and_accumulation_sends_once():
    quad = NODE_TYPES["g5.12xlarge"]
    step = predict_step(FLOPS, PARAMS, quad, 2, global_batch=512, micro_batch=64, mfu=0.4)
    assert step.samples_per_rank == 64
    assert step.compute_s == pytest.approx(64 * FLOPS / (70e12 * 0.4))
    assert step.exposed_communication_s == pytest.approx(step.communication_s - step.compute_s * 2 / 3)
    compressed = predict_step(FLOPS, PARAMS, quad, 2, 512, 64, 0.4, gradient_compression="bf16")
    assert compressed.gradient_bytes == step.gradient_bytes / 2
    assert compressed.communication_s == pytest.approx(step.communication_s / 2)
    # Twice the samples a rank (two micro-batches): twice the compute, the same one all-reduce.
    accumulated = predict_step(FLOPS, PARAMS, quad, 2, 1024, 64, 0.4)
    assert accumulated.compute_s == pytest.approx(2 * step.compute_s)
    assert accumulated.communication_s == step.communication_s
    assert accumulated.communication_share < step.communication_share
    # One GPU communicates with no one.
    alone = predict_step(FLOPS, PARAMS, NODE_TYPES["g5.2xlarge"], 1, 64, 64, 0.4)
    assert alone.exposed_communication_s == 0 and alone.images_per_s_per_gpu == pytest.approx(64 / alone.compute_s)
    # FSDP gathers the parameters twice a micro-batch: accumulating sends more.
    fsdp = predict_step(FLOPS, PARAMS, quad, 2, 512, 64, 0.4, strategy="fsdp")
    fsdp_accumulated = predict_step(FLOPS, PARAMS, quad, 2, 512, 32, 0.4, strategy="fsdp")
    assert fsdp_accumulated.communication_s > fsdp.communication_s
    with pytest.raises(ValueError, match="micro-batches of 48"):
        predict_step(FLOPS, PARAMS, quad, 2, 512, 48, 0.4)


@pytest.mark.parametrize("name", JOB_FILES)
def test_the_shipped_jobs_are_predicted_compute_bound_at_every_size(name):
    job = read_job(str(REPO / name))
    for nodes in (job.min_nodes, job.max_nodes):
        step = predict_job(job, nodes)
        assert step.communication_s < step.compute_s, (name, nodes, step)
        assert step.communication_share < 0.1, (name, nodes, step)


def test_docs_performance_is_what_the_report_renders():
    page = (REPO / "docs/performance.md").read_text()
    assert page == render_markdown(REPO), f"docs/performance.md is stale: {REGENERATE}"


def test_the_memory_table_is_the_trace_at_another_micro_batch():
    """The page's memory line (one trace, linear in the micro-batch) against a direct trace at another size."""
    from sdtrain.config.schema import ModelConfig
    from sdtrain.model.memory import predict_training_memory
    from sdtrain.model.unet import unet_config
    from tools.performance_report import GIB, linear_memory

    unet = unet_config(ModelConfig(preset="small"))
    traced = predict_training_memory(unet, (4, 32, 32), (77, 1024), 96).total_peak / GIB
    assert linear_memory("small", 256, False).gib(96) == pytest.approx(traced, rel=0.02)
