"""docs/performance.md's calibration section: the figures the per-op model (tools/performance_model.py) is calibrated
on, MosaicML's published one and a GPU session's measured rows, each beside what the calibrated model predicts for it.
"""

from __future__ import annotations

import textwrap

from tools import performance_model as model
from tools.performance_model import MEMORY_EFFICIENCY, Anchor


def _bound_by(row: Anchor) -> str:
    """Whether the host floor sets the row's predicted step (it is faster without it) or the GPU does."""
    shares = model.efficiency(row.gpu)
    with_host = model.anchor_images_per_s(row, shares, model.host_s_per_op())
    return "host" if with_host < model.anchor_images_per_s(row, shares, 0.0) * (1 - 1e-9) else "GPU"


def calibration_section() -> list[str]:
    anchor, shares, fit = model.ANCHOR, model.calibrated(), model.session_fit()
    predicted = model.anchor_images_per_s(anchor, shares, model.host_s_per_op(), world=8)
    measured = ", ".join(f"{name} {share.matmul:.1%}" for name, share in fit.efficiencies.items())
    lines = [
        "## Calibration",
        "",
        f"Memory-bound ops run at {MEMORY_EFFICIENCY:.0%} of the bandwidth (stated, not fitted). Two figures are"
        " fitted to measurements:",
        "",
        f"- **The host's cost per eager op, {fit.host_s_per_op * 1e6:.1f} us**, and the compute share of each GPU a"
        f" session ran on ({measured} of the bf16 peak for matmuls, convolutions and attention alike), fitted"
        " together to the first GPU session's eager steps (`bench/results/2026-11-27-h200.md`, least squares of"
        " the log ratio). An eager pass cannot go faster than the host dispatches its ops, so at small"
        " micro-batches of the small UNet a fast GPU waits on Python, autocast and autograd; compile removes most"
        " of it (its launch cost is not modelled). The host cost is the host's, not the GPU's: every GPU gets it,"
        " as if its host were the session's 16-CPU machine. The H100 SXM gets the H200 SXM's compute share: the"
        " same die at the same peak.",
        f"- **Every other GPU's compute share, {shares.matmul:.1%}**, the share at which the model predicts"
        f" MosaicML's published ~{anchor.images_per_s:.0f} images/s per A100 for the SD 2 UNet at"
        f" {anchor.resolution} px (8 A100s, precomputed latents; assumed: A100 40GB, eager, micro-batch"
        f" {anchor.micro_batch}): {predicted:.1f} images/s predicted on one GPU without the all-reduce.",
        "",
        "One share for every kind of op: these rows cannot tell the kinds apart, which a per-kind profile can"
        " (`bench/gpu_throughput.py --profile`).",
        "",
    ]
    lines = [line for text in lines for line in (textwrap.wrap(text, 110, break_on_hyphens=False) or [""])]
    lines += [
        "| GPU | preset | px | micro-batch | measured images/s | predicted | measured / predicted | bound by"
        " | fitted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in model.SESSION_ROWS:
        rate = model.anchor_images_per_s(row, model.efficiency(row.gpu), model.host_s_per_op())
        lines.append(
            f"| {row.gpu.name} | {row.preset} | {row.resolution} | {row.micro_batch} | {row.images_per_s:.1f} |"
            f" {rate:.1f} | {row.images_per_s / rate:.3f} | {_bound_by(row)} | {'yes' if row.fitted else 'no'} |"
        )
    note = (
        "Small at 512 px is not fitted: it runs at about half the rate every share that fits sd2-base predicts,"
        " where the model has it bound by its kernels. Small's widths (160 channels, attention at head dim 20)"
        " are narrower than any kernel of sd2-base's, and the per-kind profile of the next GPU session will show"
        " which kernels are slow. Until then the model's figures for small at 512 px are likely high by up to 2x."
    )
    return [*lines, "", *textwrap.wrap(note, 110, break_on_hyphens=False), ""]
