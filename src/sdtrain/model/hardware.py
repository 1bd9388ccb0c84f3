"""The one table of the hardware sdtrain knows: each GPU's dense peak FLOP/s, memory and memory bandwidth, and the
cloud node types' GPUs and links. MFU (sdtrain.train.efficiency), the micro-batch fit before workers start
(train.micro_batch_size) and the performance model of docs/performance.md all read it; a GPU missing here has no MFU
and no memory check, never a guessed one.

Peaks are dense (no 2:4 structured sparsity), from each vendor's datasheet: datasheets print tensor-core peaks with
sparsity (marked *), often beside the dense figure; the dense one, half the sparse, is the one training reaches.
Each entry cites its datasheet and the figures as printed (TFLOP/s; memory bandwidth in GB/s or TB/s).

Memory is recorded twice: the size the datasheet sells a variant as (its "24 GB", which names the variant and keys its
bandwidth), and the memory the device reports, which is what a micro-batch must fit. They differ: a GDDR card with
ECC keeps part of its DRAM for the check bits (an A10G's 24 GB is 23028 MiB, 22.5 GiB), and an H100's 80 GB is 81559
MiB (79.6 GiB). The reported figure is nvidia-smi's ``memory.total`` on current drivers (older ones left out what
the driver reserves), from published nvidia-smi output cited at each entry. torch's ``total_memory`` is lower still
by that reservation, a few hundred MiB (an A10G's is 22.19 GiB in vllm-project/vllm#372): not recorded here, it is
left to the memory fit's 1 GiB runtime allowance and 10% headroom.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12
GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Gpu:
    """One GPU model as its datasheet describes it.

    Args:
        name: the model as the datasheet names it.
        accelerator_type: the name Ray gives its nodes' ``accelerator_type:<name>`` resource (several models may
            share one: Ray calls every H100 "H100").
        memory_gib: the memory sizes it is sold with, as the datasheet names them (its GB, here as GiB): the
            variant's label, which keys ``bandwidth``; not what a micro-batch fits (``device_mib``).
        device_mib: the memory each size in ``memory_gib`` reports (nvidia-smi's ``memory.total``), MiB.
        bf16: bfloat16 tensor-core peak FLOP/s (FP32 accumulate); None where it has none.
        fp16: float16 tensor-core peak FLOP/s (FP32 accumulate).
        tf32: TF32 tensor-core peak (float32 matmuls and convolutions with TF32 allowed); None where it has none.
        fp32: float32 peak without tensor cores.
        bandwidth: memory bandwidth, GB/s, of each size in ``memory_gib`` (the datasheet's; None where unrecorded).
    """

    name: str
    accelerator_type: str
    memory_gib: tuple[float, ...]
    device_mib: tuple[int, ...]
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None
    bandwidth: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.device_mib) != len(self.memory_gib):
            raise ValueError(f"{self.name}: one device_mib for each of memory_gib {self.memory_gib}")

    def device_bytes(self, memory_gib: float) -> int:
        """The memory the variant sold as ``memory_gib`` reports, bytes: what a micro-batch has to fit."""
        if memory_gib not in self.memory_gib:
            raise ValueError(f"the hardware table knows no {memory_gib:g} GB {self.name}")
        return self.device_mib[self.memory_gib.index(memory_gib)] * MIB

    def bandwidth_bytes(self, memory_gib: float) -> float:
        """Bytes/s of the variant with ``memory_gib``; a ValueError where the table records none."""
        if self.bandwidth is None or memory_gib not in self.memory_gib:
            raise ValueError(f"the hardware table records no memory bandwidth of a {memory_gib:g} GiB {self.name}")
        return self.bandwidth[self.memory_gib.index(memory_gib)] * 1e9

    @property
    def bf16_peak(self) -> float:
        """The bf16 peak of a GPU that trains in bf16 (every node type's); a ValueError for one the table has none
        of."""
        if self.bf16 is None:
            raise ValueError(f"the hardware table records no bf16 peak of the {self.name}")
        return self.bf16


# NVIDIA A10G for AWS (d1.awsstatic.com/product-marketing/ec2/NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf):
# FP32 35; TF32 35 | 70*; BF16 70 | 140*; FP16 70 | 140*; 24 GB GDDR6, 600 GB/s. Not the A10's figures: its tensor
# cores are clocked lower. Reported: 23028 MiB (nvidia-smi on a g5, NVIDIA/DCGM#232).
A10G = Gpu(
    "A10G", "A10G", (24,), (23028,), bf16=70 * TERA, fp16=70 * TERA, tf32=35 * TERA, fp32=35 * TERA, bandwidth=(600,)
)
# NVIDIA A10 datasheet: FP32 31.2; TF32 62.5 | 125*; BF16 125 | 250*; FP16 125 | 250*; 600 GB/s. Reported: 23028
# MiB, as the A10G (nvidia-smi totals of Modal's GPUs, modal-labs/modal-client#2797, the source of the reported
# figures below where no other is named).
A10 = Gpu(
    "A10",
    "A10",
    (24,),
    (23028,),
    bf16=125 * TERA,
    fp16=125 * TERA,
    tf32=62.5 * TERA,
    fp32=31.2 * TERA,
    bandwidth=(600,),
)
# NVIDIA L4 datasheet: FP32 30.3; TF32 120*; BF16 242*; FP16 242* (dense: half); 300 GB/s. Reported: 23034 MiB.
L4 = Gpu(
    "L4", "L4", (24,), (23034,), bf16=121 * TERA, fp16=121 * TERA, tf32=60 * TERA, fp32=30.3 * TERA, bandwidth=(300,)
)
# NVIDIA L40S datasheet: FP32 91.6; TF32 183 | 366*; BF16 362.05 | 733*; FP16 362.05 | 733*; 864 GB/s. Reported:
# 46068 MiB.
L40S = Gpu(
    "L40S",
    "L40S",
    (48,),
    (46068,),
    bf16=362.05 * TERA,
    fp16=362.05 * TERA,
    tf32=183 * TERA,
    fp32=91.6 * TERA,
    bandwidth=(864,),
)
# NVIDIA A100 datasheet (the same figures for 40GB and 80GB, PCIe and SXM; they differ in power, 250-300 W against
# 400 W, so a PCIe card sustains less of the peak): FP32 19.5; TF32 156 | 312*; BF16 312 | 624*; FP16 312 | 624*;
# 40GB 1,555 GB/s (PCIe and SXM); 80GB 1,935 GB/s PCIe, 2,039 GB/s SXM (the PCIe figure here: the lower).
# Reported: 40960 and 81920 MiB (older drivers left the driver's reservation out: an SXM4 40GB showed 40536 MiB).
A100 = Gpu(
    "A100",
    "A100",
    (40, 80),
    (40960, 81920),
    bf16=312 * TERA,
    fp16=312 * TERA,
    tf32=156 * TERA,
    fp32=19.5 * TERA,
    bandwidth=(1555, 1935),
)
# NVIDIA H100 datasheet, H100 SXM column: 80 GB; FP32 67; TF32 989*; BF16 1,979*; FP16 1,979*; 3.35 TB/s.
# Reported: 81559 MiB ("NVIDIA H100 80GB HBM3", also in NVIDIA/nccl#1264).
H100_SXM = Gpu(
    "H100 SXM",
    "H100",
    (80,),
    (81559,),
    bf16=989.5 * TERA,
    fp16=989.5 * TERA,
    tf32=494.5 * TERA,
    fp32=67 * TERA,
    bandwidth=(3350,),
)
# The same datasheet, H100 NVL column: 94 GB; FP32 60; TF32 835*; BF16 1,671*; FP16 1,671*; 3.9 TB/s.
# Reported: 95830 MiB (NVIDIA/gpu-admin-tools#4).
H100_NVL = Gpu(
    "H100 NVL",
    "H100",
    (94,),
    (95830,),
    bf16=835.5 * TERA,
    fp16=835.5 * TERA,
    tf32=417.5 * TERA,
    fp32=60 * TERA,
    bandwidth=(3900,),
)
# NVIDIA H100 datasheet (2022 edition), H100 PCIe column: 80 GB; FP32 51; TF32 756*; BF16 1,513*; FP16 1,513*;
# 2 TB/s. Reported: 81559 MiB, as the SXM module ("NVIDIA H100 PCIe, 81559 MiB" in published nvidia-smi queries).
H100_PCIE = Gpu(
    "H100 PCIe",
    "H100",
    (80,),
    (81559,),
    bf16=756.5 * TERA,
    fp16=756.5 * TERA,
    tf32=378 * TERA,
    fp32=51 * TERA,
    bandwidth=(2000,),
)
# NVIDIA H200 datasheet, H200 SXM column: 141 GB; FP32 67; TF32 989*; BF16 1,979*; FP16 1,979* (the H100 SXM's);
# 4.8 TB/s. Reported: 143771 MiB (the lent H200 of bench/results/2026-11-27-h200.md).
H200_SXM = Gpu(
    "H200 SXM",
    "H200",
    (141,),
    (143771,),
    bf16=989.5 * TERA,
    fp16=989.5 * TERA,
    tf32=494.5 * TERA,
    fp32=67 * TERA,
    bandwidth=(4800,),
)
# The same datasheet, H200 NVL column: 141 GB; FP32 60; TF32 835*; BF16 1,671*; FP16 1,671*; 4.8 TB/s.
# Reported: 143771 MiB, as the SXM module ("NVIDIA H200 NVL, 143771 MiB" in published nvidia-smi queries).
H200_NVL = Gpu(
    "H200 NVL",
    "H200",
    (141,),
    (143771,),
    bf16=835.5 * TERA,
    fp16=835.5 * TERA,
    tf32=417.5 * TERA,
    fp32=60 * TERA,
    bandwidth=(4800,),
)
# NVIDIA Blackwell datasheet (GB200 NVL72 / HGX B200), HGX B200 per GPU at up to 1,000 W: 180 GB; FP32 75; TF32
# 2.2 PF*; FP16/BF16 4.5 PF*. (A B200 in a GB200 runs at up to 1,200 W and is faster: not in this table.)
# Memory bandwidth: not recorded (the datasheet prints the 8-GPU board's total). Reported: 183359 MiB
# (NVIDIA/TensorRT-LLM#10278).
B200 = Gpu("B200", "B200", (180,), (183359,), bf16=2250 * TERA, fp16=2250 * TERA, tf32=1100 * TERA, fp32=75 * TERA)
# Inference GPUs a training cluster may still hold: their memory only (the micro-batch fit), no peaks recorded, so
# no MFU. NVIDIA T4 datasheet: 16 GB, 320+ GB/s; reported: 15360 MiB. NVIDIA V100 datasheet: 16 or 32 GB, 900 GB/s;
# reported: 16384 and 32768 MiB (older drivers, leaving the driver's reservation out, showed 16160 and 32510).
T4 = Gpu("T4", "T4", (16,), (15360,), bf16=None, fp16=None, tf32=None, fp32=None, bandwidth=(320,))
V100 = Gpu("V100", "V100", (16, 32), (16384, 32768), bf16=None, fp16=None, tf32=None, fp32=None, bandwidth=(900, 900))

GPUS = (A10G, A10, L4, L40S, A100, H100_SXM, H100_NVL, H100_PCIE, H200_SXM, H200_NVL, B200, T4, V100)


def device_gpu(device_name: str) -> Gpu | None:
    """The GPU ``torch.cuda.get_device_name`` calls ``device_name`` ("NVIDIA H100 80GB HBM3") if its peaks are in the
    table, or None for a device this table does not know, or whose variant the name leaves open.

    Args:
        device_name: the device's name as torch reports it.
    """
    # Whole words: "L4" must not match "L40S", nor "A10" "A100", nor "H200" "GH200".
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for gpu in (A10G, A10, L4, L40S, A100, B200):
        if gpu.name in words:
            return gpu
    if "H100" in words:
        if "NVL" in words:
            return H100_NVL
        if "PCIE" in words:
            return H100_PCIE
        # The SXM module reports its memory ("NVIDIA H100 80GB HBM3"; the PCIe card has HBM2e and says PCIe).
        if words & {"SXM", "SXM5", "HBM3"}:
            return H100_SXM
        return None  # an H100 that names no variant: SXM and PCIe are 24% apart, and guessing is inventing
    if "H200" in words:
        # "NVIDIA H200" is the SXM module; the PCIe card says "NVIDIA H200 NVL".
        return H200_NVL if "NVL" in words else H200_SXM
    return None


def peak_flops(gpu: Gpu, precision: str, tf32: bool) -> float | None:
    """The peak FLOP/s that bounds a run at Lightning's ``precision``: the tensor cores' at bf16 or fp16 for mixed
    precision; at 32-true, TF32's when ``tf32`` is allowed, else plain float32's. None for other precisions and for
    peaks the table does not record.

    Args:
        gpu: the device.
        precision: Lightning's precision (bf16-mixed, 16-mixed, 32-true, ...).
        tf32: float32 matmuls or convolutions may run as TF32.
    """
    if precision.startswith("bf16"):
        return gpu.bf16
    if precision.startswith("16"):
        return gpu.fp16
    if precision.startswith("32"):
        return gpu.tf32 if tf32 else gpu.fp32
    return None


def variants(accelerator_type: str) -> list[tuple[Gpu, float]]:
    """(model, memory size as sold) of each GPU Ray may name ``accelerator_type``: every model and size of a type Ray
    sets on GPU nodes ("A100"), or the one size of a variant's label ("A100-80G": Ray's ``NVIDIA_A100_80G``, which a
    cluster adds to its nodes beside "A100"); none for a name the table does not know."""
    found = [(gpu, gib) for gpu in GPUS if gpu.accelerator_type == accelerator_type for gib in gpu.memory_gib]
    sized = re.fullmatch(r"(.+)-(\d+)G", accelerator_type)
    if found or sized is None:
        return found
    base, gib = sized.group(1), float(sized.group(2))
    return [(gpu, gib) for gpu in GPUS if gpu.accelerator_type == base and gib in gpu.memory_gib]


def has_bf16(accelerator_type: str) -> bool | None:
    """Whether the GPUs Ray names ``accelerator_type`` have bf16 (a bf16 peak in the table), or None for a name the
    table does not know."""
    models = [gpu for gpu, _ in variants(accelerator_type)]
    return all(gpu.bf16 is not None for gpu in models) if models else None


def memory_range(accelerator_type: str) -> tuple[float, float] | None:
    """(smallest, largest) memory in bytes that the GPUs Ray names ``accelerator_type`` report (``device_mib``, not
    the datasheet's size), or None for a name the table does not know."""
    sizes = [gpu.device_bytes(gib) for gpu, gib in variants(accelerator_type)]
    return (min(sizes), max(sizes)) if sizes else None


@dataclass(frozen=True)
class NodeType:
    """One cloud instance type's GPUs and links, from its provider's published specifications.

    Args:
        name: the instance type as the provider names it (what job.yaml's ``instance_type`` says).
        gpu: the GPU model.
        gpus: GPUs in one node.
        gpu_memory_gib: memory of one GPU as the datasheet sells it (of the model's ``memory_gib``, this node's):
            the variant; :attr:`gpu_device_bytes` is what it holds.
        network_gbit_s: the node's network (inter-node) bandwidth, Gbit/s.
        intra_gbyte_s: one GPU's bandwidth to the others in its node, GB/s in one direction (NVLink through
            NVSwitch, or PCIe where there is no NVLink); 0 for a single-GPU node.
    """

    name: str
    gpu: Gpu
    gpus: int
    gpu_memory_gib: float
    network_gbit_s: float
    intra_gbyte_s: float

    @property
    def gpu_device_bytes(self) -> int:
        """The memory one of the node's GPUs reports, bytes: what a rank's micro-batch has to fit."""
        return self.gpu.device_bytes(self.gpu_memory_gib)


PCIE4_X16 = 32.0  # GB/s one direction: A10G, L4 and L40S nodes have no NVLink
NODE_TYPES = {
    node.name: node
    for node in (
        # AWS G5 (A10G 24 GB): 10 Gbit/s is the g5.2xlarge's burst ("up to"); the larger sizes' rates are sustained.
        NodeType("g5.2xlarge", A10G, 1, 24, 10, 0),
        NodeType("g5.8xlarge", A10G, 1, 24, 25, 0),
        NodeType("g5.12xlarge", A10G, 4, 24, 40, PCIE4_X16),
        NodeType("g5.48xlarge", A10G, 8, 24, 100, PCIE4_X16),
        # AWS G6 (L4 24 GB) and G6e (L40S 48 GB).
        NodeType("g6.12xlarge", L4, 4, 24, 40, PCIE4_X16),
        NodeType("g6e.12xlarge", L40S, 4, 48, 100, PCIE4_X16),
        NodeType("g6e.48xlarge", L40S, 8, 48, 400, PCIE4_X16),
        # AWS P4d (A100 40 GB, NVSwitch: 600 GB/s both directions) and P5 (H100 SXM 80 GB, 900 GB/s), EFA networks.
        NodeType("p4d.24xlarge", A100, 8, 40, 400, 300),
        NodeType("p4de.24xlarge", A100, 8, 80, 400, 300),
        NodeType("p5.48xlarge", H100_SXM, 8, 80, 3200, 450),
    )
}
"""The node types the shipped jobs and docs/performance.md consider."""
