"""Accelerators the planner knows (`--target=<N>x<GPU>`), from the vendors' datasheets.

peak_bf16: dense bf16 tensor-core FLOP/s (no sparsity); peak_fp8: dense fp8 tensor-core FLOP/s
(None: no fp8 tensor cores, or no datasheet figure here); hbm: memory bandwidth in bytes/s;
intra_node: NVLink (or PCIe) bandwidth per GPU per direction in bytes/s; inter_node: network
bandwidth per GPU in bytes/s (one 200/400 Gb/s NIC per GPU on the usual 8-GPU nodes);
per_node: GPUs that share the intra-node link; host_link: the GPU's link to host memory in bytes/s
per direction (PCIe x16, or NVLink-C2C on Grace Hopper: what an offloaded optimizer state or
activation streams over); host_memory: host RAM per node in bytes (what offloaded state may use).
A target of `<N>x<M>GB` takes an unnamed device with M GB (1e9 bytes) and H100's speeds and host.

Sources (the dense figures; datasheets print twice as much "with sparsity"):
  A100-40GB/80GB  NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 TFLOPS bf16; 1,555 / 2,039 GB/s
  H100-80GB       NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 989 TFLOPS bf16 (1,979 fp8
                  and int8); 3.35 TB/s; NVLink 900 GB/s (450 each way)
  H200-141GB      NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 989 TFLOPS bf16 (1,979 fp8);
                  4.8 TB/s
  L40S-48GB       NVIDIA L40S datasheet: 362 TFLOPS bf16 (733 fp8); 864 GB/s; PCIe Gen4 x16
  RTX4090-24GB    NVIDIA Ada Lovelace architecture whitepaper, appendix A: 165 TFLOPS bf16 with
                  fp32 accumulation (fp16 with fp16 accumulation: 330); 1,008 GB/s; PCIe Gen4 x16;
                  it has fp8 tensor cores, whose figure is not entered here yet (peak_fp8 None)
  GH200-96GB      NVIDIA GH200 Grace Hopper Superchip datasheet: the H100's 989 TFLOPS bf16 (1,979
                  fp8); 96 GB
                  HBM3 at 4 TB/s; NVLink-C2C 900 GB/s (450 each way) to up to 480 GB LPDDR5X
Host links and memory: PCIe 4.0 x16 moves 31.5 GB/s each way, PCIe 5.0 x16 63 GB/s (PCI-SIG: 16
and 32 GT/s per lane, 128b/130b); system memory per node: NVIDIA DGX A100 datasheet 1 TB (2 TB
optional), DGX H100 and DGX H200 datasheets 2 TB. Assumptions, for want of a reference system:
L40S nodes 1 TB (an 8-GPU PCIe server), an RTX 4090 machine 128 GB (a workstation), GH200 4
superchips a node (4 x 480 GB).
MFU here is against peak_bf16, for fp8 and int8 matmuls too (their own peak is twice it on H100
and H200): a faster format shows as a higher MFU, as torchtitan and MaxText report it. An fp8 run
is stated against peak_fp8 as well, where the GPU has one (bench.train_step, the sweeps).
"""
GB = 1e9

PCIE4, PCIE5 = 31.5e9, 63e9   # x16, bytes/s each way
TB = 1e12

GPUS = {
    # name: memory bytes, peak bf16 and fp8 FLOP/s, HBM bytes/s, intra-node bytes/s, inter-node bytes/s, GPUs
    # per node, host link bytes/s, host memory bytes per node
    'A100-40GB': dict(memory=40 * GB, peak_bf16=312e12, peak_fp8=None, hbm=1.56e12, intra_node=300e9, inter_node=25e9, per_node=8, host_link=PCIE4, host_memory=1 * TB),
    'A100-80GB': dict(memory=80 * GB, peak_bf16=312e12, peak_fp8=None, hbm=2.04e12, intra_node=300e9, inter_node=25e9, per_node=8, host_link=PCIE4, host_memory=1 * TB),
    'H100-80GB': dict(memory=80 * GB, peak_bf16=989e12, peak_fp8=1979e12, hbm=3.35e12, intra_node=450e9, inter_node=50e9, per_node=8, host_link=PCIE5, host_memory=2 * TB),
    'H200-141GB': dict(memory=141 * GB, peak_bf16=989e12, peak_fp8=1979e12, hbm=4.8e12, intra_node=450e9, inter_node=50e9, per_node=8, host_link=PCIE5, host_memory=2 * TB),
    'L40S-48GB': dict(memory=48 * GB, peak_bf16=362e12, peak_fp8=733e12, hbm=0.864e12, intra_node=32e9, inter_node=12.5e9, per_node=8, host_link=PCIE4, host_memory=1 * TB),
    'RTX4090-24GB': dict(memory=24 * GB, peak_bf16=165e12, peak_fp8=None, hbm=1.01e12, intra_node=32e9, inter_node=3e9, per_node=8, host_link=PCIE4, host_memory=128 * GB),
    'GH200-96GB': dict(memory=96 * GB, peak_bf16=989e12, peak_fp8=1979e12, hbm=4.0e12, intra_node=450e9, inter_node=50e9, per_node=4, host_link=450e9, host_memory=4 * 480 * GB),
}

# jax's `device_kind` of each accelerator -> its entry above (the MFU of a run on it is measured
# against that entry's datasheet peak).
DEVICE_KINDS = {
    'NVIDIA A100-SXM4-40GB': 'A100-40GB', 'NVIDIA A100-SXM4-80GB': 'A100-80GB',
    'NVIDIA H100 80GB HBM3': 'H100-80GB', 'NVIDIA H200': 'H200-141GB', 'NVIDIA L40S': 'L40S-48GB',
    'NVIDIA GeForce RTX 4090': 'RTX4090-24GB', 'NVIDIA GH200 480GB': 'GH200-96GB',
}


def datasheet(device_kind: str) -> dict | None:
  """The datasheet figures of a device jax names `device_kind` (None: not a device listed here,
  e.g. a CPU)."""
  name = DEVICE_KINDS.get(device_kind)
  return None if name is None else GPUS[name]


def peak_flops(devices) -> float | None:
  """The datasheet bf16 dense peak of `devices` together, in FLOP/s (None where one of them is not
  a device listed here, e.g. a CPU)."""
  sheets = [datasheet(d.device_kind) for d in devices]
  return None if not sheets or None in sheets else sum(s['peak_bf16'] for s in sheets)
