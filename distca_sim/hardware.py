"""Model shapes, GPU presets and the per-token costs of the step-time simulator.

Pure Python + numpy. Units: seconds, bytes, FLOPs (a multiply-add counts 2), tokens.

Everything here is a closed-form function of a model shape and a GPU; the simulator
(:mod:`distca_sim.simulate`) adds batches, plans, schedules and networks on top.

Sources of the formulas and constants (each is repeated where it is used):

* Transformer FLOPs: 2 FLOPs per weight per token in the forward pass, twice that in the backward
  pass (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, §5.1; Kaplan et al. 2020, Table 1). Core attention FLOPs come from
  :class:`scheduler.cost.CostModel` (FlashAttention-2 paper convention, backward = 2.5 × forward).
* Activation memory: the per-layer accounting of Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models" (MLSys'23, §4), redone for a Llama layer (RMSNorm,
  GQA, SwiGLU, no dropout) with FlashAttention (no ``s²`` score matrix is stored); tensor and
  sequence parallelism divide all of it by ``tp``.
* Model states: mixed-precision Adam, 2 B bf16 weights + 4 B fp32 gradients per weight on every
  model-parallel shard, and 12 B of fp32 master weight and Adam moments sharded over the data
  parallel ranks (ZeRO stage 1 / Megatron's distributed optimizer; Rajbhandari et al., "ZeRO",
  SC'20, §3).
* GPU rates: NVIDIA H100 and H200 SXM datasheets (see :data:`GPUS`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from dataclasses import dataclass, field, replace

from scheduler.checks import finite_nonnegative, finite_positive, positive_int
from scheduler.cost import BACKWARD_FLOPS_FACTOR, CostModel
from scheduler.profile import ProfileTable, read_profile_dir

__all__ = ["ModelConfig", "GPUConfig", "MODELS", "GPUS", "get_model", "get_gpu",
           "attention_tables", "load_attention_profile", "measured_attention_profile", "MEMORY_HEADROOM",
           "PROFILES_DIR"]

DTYPE_BYTES = 2            # bf16 activations, weights and wire tensors
MEMORY_HEADROOM = 0.9      # usable fraction of HBM: the rest goes to the CUDA context, NCCL
                           # buffers, workspaces and allocator fragmentation (assumption)
# Measured attention tables shipped with the package: PROFILES_DIR/<gpu preset>/<model>-tp<tp>/
# {forward,backward}.json, written by bench/gpu_kernels.py on a lent GPU (see its README).
PROFILES_DIR = Path(__file__).resolve().parent / "data" / "profiles"
TILE = 128                 # FlashAttention's query/key tile (DistCA §3: shards of >= 128 tokens
                           # keep full kernel efficiency); the profile grid starts here


MAX_LAYERS = 1024  # the simulator builds each layer's rounds (a loop per layer); real models have <= ~128


def _pos_int(name: str, x) -> int:
    if not isinstance(x, int) or isinstance(x, bool):  # Python ints only: the presets' and the CLI's
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return positive_int(name, x)  # and at most 2**63 - 1


def _pos_float(name: str, x, *, allow_zero: bool = False) -> float:
    return (finite_nonnegative if allow_zero else finite_positive)(name, x)


# ---- models ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, GQA attention with RoPE, SwiGLU MLP, untied embeddings.

    Args:
        name: label.
        hidden_size: model width ``h``.
        num_heads: query heads; ``head_dim = hidden_size // num_heads``.
        num_kv_heads: key/value heads (GQA); divides ``num_heads``.
        num_layers: transformer layers.
        ffn_hidden_size: SwiGLU inner width (three ``h × ffn`` matrices).
        vocab_size: vocabulary (embedding and LM head, untied).

    Raises:
        ValueError: a size that is not a positive int up to 2**63 - 1, more than
            :data:`MAX_LAYERS` layers, ``hidden_size`` not divisible by ``num_heads`` or
            ``num_heads`` not divisible by ``num_kv_heads``.
    """

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    ffn_hidden_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_heads", "num_kv_heads", "num_layers", "ffn_hidden_size",
                  "vocab_size"):
            _pos_int(f, getattr(self, f))
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers must be at most {MAX_LAYERS} (the simulator times each layer), "
                             f"got {self.num_layers}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                             f"num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        """Weights of one layer: Q, K, V, O projections, three SwiGLU matrices, two RMSNorms."""
        h, kvd = self.hidden_size, self.num_kv_heads * self.head_dim
        return h * (h + 2 * kvd) + h * h + 3 * h * self.ffn_hidden_size + 2 * h

    @property
    def num_params(self) -> int:
        """All weights: layers, final norm, input embedding and LM head (untied)."""
        return self.num_layers * self.layer_params + self.hidden_size * (2 * self.vocab_size + 1)

    @property
    def qkv_fraction(self) -> float:
        """Share of a layer's linear FLOPs that runs *before* core attention (the QKV GEMM);
        the rest (O projection and MLP) runs after it."""
        h, kvd = self.hidden_size, self.num_kv_heads * self.head_dim
        return h * (h + 2 * kvd) / (self.layer_params - 2 * h)

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of one layer's weights per token: ``2 × weights`` (Megatron-LM SC'21
        §5.1). The backward pass costs twice this (gradients of inputs and of weights)."""
        return 2.0 * (self.layer_params - 2 * self.hidden_size)

    def lm_head_flops_per_token(self) -> float:
        """Forward FLOPs of the LM head per token, ``2 · h · vocab`` (on the last stage)."""
        return 2.0 * self.hidden_size * self.vocab_size

    def cost_model(self, tp: int) -> CostModel:
        """Attention shape *per GPU* under tensor parallelism ``tp``: heads are split over the TP
        group; KV heads too, replicated when ``tp`` exceeds them (Megatron's GQA rule)."""
        return CostModel(num_heads_q=self.num_heads // tp,
                         num_heads_kv=max(1, self.num_kv_heads // tp),
                         head_dim=self.head_dim, dtype_bytes=DTYPE_BYTES)

    def activation_bytes_per_token_layer(self) -> int:
        """Bytes one token's activations of one layer occupy until its backward pass (bf16,
        before dividing by ``tp``).

        Korthikanti et al. (MLSys'23, §4) count the tensors a layer keeps for its backward pass;
        for a Llama layer with FlashAttention these are (elements per token): RMSNorm-1 input
        ``h``, QKV GEMM input ``h``, Q/K/V ``h + 2·kv·d``, attention output ``h`` plus its LSE
        (fp32, ``2·heads`` bf16 elements), RMSNorm-2 input ``h``, MLP GEMM input ``h``, gate and up
        outputs ``2·ffn``, SwiGLU output ``ffn``. FlashAttention stores no score matrix, so the
        ``5·a·s/h`` term of the paper vanishes.
        """
        h, d = self.hidden_size, self.head_dim
        elems = (4 * h + h + 2 * self.num_kv_heads * d + h + 2 * self.num_heads
                 + 3 * self.ffn_hidden_size)
        return DTYPE_BYTES * elems

    def logits_bytes_per_token(self) -> int:
        """fp32 logits the vocab-parallel cross-entropy keeps for its backward pass (last stage)."""
        return 4 * self.vocab_size


#: Table 2 of the DistCA paper names Llama-8B and Llama-34B. Shapes: Llama-3-8B (Meta's released
#: config: 4096 wide, 32 layers, 32 heads, 8 KV heads, SwiGLU 14336, vocabulary 128256) and the
#: Llama-2-architecture 34B of CodeLlama-34B (8192 wide, 48 layers, 64 heads, 8 KV heads, SwiGLU
#: 22016, vocabulary 32000; its published config.json).
MODELS = {
    "llama3-8b": ModelConfig("llama3-8b", 4096, 32, 8, 32, 14336, 128256),
    "llama-34b": ModelConfig("llama-34b", 8192, 64, 8, 48, 22016, 32000),
}
_MODEL_ALIASES = {"8b": "llama3-8b", "llama-8b": "llama3-8b", "34b": "llama-34b",
                  "llama3-34b": "llama-34b", "codellama-34b": "llama-34b"}


def get_model(name: str) -> ModelConfig:
    """A preset by name (``llama3-8b``, ``llama-34b``; aliases ``8b``, ``34b``, ``llama-8b``).

    Raises:
        ValueError: an unknown name.
    """
    key = _MODEL_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; presets: {sorted(MODELS)}")
    return MODELS[key]


# ---- GPUs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPUConfig:
    """One GPU model and its node/network, as rates the simulator multiplies by work.

    Args:
        name: label.
        peak_flops: dense bf16 tensor-core peak, FLOP/s.
        hbm_bytes: memory per GPU, bytes.
        nvlink_bw: NVLink bandwidth per GPU *per direction*, bytes/s.
        ib_bw: InfiniBand bandwidth per GPU (one NIC each) per direction, bytes/s.
        gpus_per_node: GPUs behind one NVSwitch domain.
        linear_efficiency: fraction of ``peak_flops`` the non-attention part of a layer sustains
            (GEMMs plus the memory-bound norm/RoPE/SwiGLU kernels folded in).
        attn_fwd_efficiency, attn_bwd_efficiency: fraction of peak a large FlashAttention forward /
            backward call sustains.
        link_efficiency: fraction of link bandwidth a collective achieves at large messages.
        collective_latency_s: fixed cost of one all-to-all / all-gather / p2p call, seconds.
        kernel_launch_s: fixed cost of one fused attention kernel call, seconds.
        attn_task_overhead_s: extra seconds per CA-task inside a fused call (the ``overhead_s`` of
            :meth:`ProfileTable.from_flops`); small tasks also pay the 128-token tile floor.
        attn_tables: optional measured ``(forward, backward)`` :class:`ProfileTable` pair that
            replaces the analytic one; it must describe the per-GPU attention shape simulated.

    Raises:
        ValueError: a non-positive rate or size, or an efficiency outside ``(0, 1]``.
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    nvlink_bw: float
    ib_bw: float
    gpus_per_node: int = 8
    linear_efficiency: float = 0.6
    attn_fwd_efficiency: float = 0.55
    attn_bwd_efficiency: float = 0.45
    link_efficiency: float = 0.8
    collective_latency_s: float = 20e-6
    kernel_launch_s: float = 5e-6
    attn_task_overhead_s: float = 0.0
    attn_tables: tuple | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for f in ("peak_flops", "hbm_bytes", "nvlink_bw", "ib_bw"):
            _pos_float(f, getattr(self, f))
        _pos_int("gpus_per_node", self.gpus_per_node)
        for f in ("linear_efficiency", "attn_fwd_efficiency", "attn_bwd_efficiency",
                  "link_efficiency"):
            v = _pos_float(f, getattr(self, f))
            if v > 1:
                raise ValueError(f"{f} must be in (0, 1], got {v}")
        for f in ("collective_latency_s", "kernel_launch_s", "attn_task_overhead_s"):
            _pos_float(f, getattr(self, f), allow_zero=True)
        if self.attn_tables is not None:
            if (not isinstance(self.attn_tables, tuple) or len(self.attn_tables) != 2
                    or not all(isinstance(t, ProfileTable) for t in self.attn_tables)):
                raise ValueError("attn_tables must be a (forward, backward) pair of ProfileTable")

    @property
    def linear_rate(self) -> float:
        """Sustained FLOP/s of the non-attention layers."""
        return self.peak_flops * self.linear_efficiency

    @property
    def nvlink_eff(self) -> float:
        return self.nvlink_bw * self.link_efficiency

    @property
    def ib_eff(self) -> float:
        return self.ib_bw * self.link_efficiency

    def with_tables(self, forward: ProfileTable, backward: ProfileTable) -> "GPUConfig":
        """A copy that uses measured attention latency tables instead of the analytic ones."""
        return replace(self, attn_tables=(forward, backward))


# Peak dense bf16: 989.4 TFLOP/s for both H100 SXM and H200 SXM (NVIDIA datasheets list
# 1,979 TFLOP/s *with 2:4 sparsity*; dense is half). HBM: what the devices report, 81,559 MiB
# (H100 SXM) and 143,771 MiB (H200 SXM), nvidia-smi's memory.total on the benchmark machines
# (bench/results/gpu/*/session*.log). The "80 GB" and "141 GB" of the product names, read as
# decimal bytes, are 6.5% less, and would call configurations that fit out of memory.
# NVLink 4: 900 GB/s per GPU bidirectional, i.e. 450 GB/s each way. InfiniBand: one ConnectX-7
# NDR NIC of 400 Gb/s = 50 GB/s each way per GPU (the DGX/HGX H100 and H200 layout).
# Efficiencies are assumptions, to be replaced by measured tables: 0.6 of peak for the linear part
# (large bf16 GEMMs reach 60-75% on Hopper; the norm/activation kernels pull the layer below
# that); attention forward 0.55 and backward 0.45 (FlashAttention-3 reports up to 740 TFLOP/s,
# 75% of H100 peak, for long non-causal forward passes; causal masks, GQA head counts per GPU and
# the backward pass sustain less; Shah et al. 2024, arXiv 2407.08608); 0.8 of link bandwidth for
# NCCL collectives at large messages. H200 uses the same GH100 compute die as H100, so the same
# rates; only memory differs (its faster HBM3e is not modelled).
GPUS = {
    "h100": GPUConfig("h100", peak_flops=989.4e12, hbm_bytes=81559 * 2**20, nvlink_bw=450e9, ib_bw=50e9),
    "h200": GPUConfig("h200", peak_flops=989.4e12, hbm_bytes=143771 * 2**20, nvlink_bw=450e9, ib_bw=50e9),
}


def get_gpu(name: str) -> GPUConfig:
    """A preset by name (``h100``, ``h200``).

    Raises:
        ValueError: an unknown name.
    """
    key = str(name).lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {name!r}; presets: {sorted(GPUS)}")
    return GPUS[key]


# ---- attention latency -------------------------------------------------------------------------
# 128 ... 524288 tokens in eighth-octave steps: ProfileTable interpolates latency bilinearly, which
# over-estimates the q² part of causal work between grid points; at 2^(1/8) spacing by < 0.2%
# (an octave grid would be off by up to 11% and bias whole documents against shards).
_GRID = sorted({round(TILE * 2 ** (i / 8)) for i in range(12 * 8 + 1)})


@functools.lru_cache(maxsize=64)
def _analytic_tables(rate_fwd: float, rate_bwd: float, overhead_s: float,
                     cost: CostModel) -> tuple[ProfileTable, ProfileTable]:
    fwd = ProfileTable.from_flops(rate_fwd, overhead_s, _GRID, _GRID, cost)
    # from_flops prices *forward* FLOPs; the backward kernel does 2.5x the FLOPs at its own rate.
    bwd = ProfileTable.from_flops(rate_bwd / BACKWARD_FLOPS_FACTOR, overhead_s, _GRID, _GRID, cost)
    return fwd, bwd


def attention_tables(gpu: GPUConfig, cost: CostModel) -> tuple[ProfileTable, ProfileTable]:
    """``(forward, backward)`` latency tables of one CA-task for the per-GPU shape ``cost``.

    The GPU's measured tables when it has them, else analytic ones
    (:meth:`ProfileTable.from_flops`): ``overhead + FLOPs / (peak × efficiency)`` on a grid from
    128 to 512K tokens in eighth-octave steps. Below the grid a task is charged as a 128-token tile
    (FlashAttention computes whole tiles), so small shards pay for the tile they waste.
    """
    if gpu.attn_tables is not None:
        return gpu.attn_tables
    return _analytic_tables(gpu.peak_flops * gpu.attn_fwd_efficiency,
                            gpu.peak_flops * gpu.attn_bwd_efficiency,
                            gpu.attn_task_overhead_s, cost)


def load_attention_profile(directory, cost: CostModel) -> tuple[ProfileTable, ProfileTable]:
    """Measured ``(forward, backward)`` tables for :meth:`GPUConfig.with_tables`.

    Args:
        directory: a folder holding ``forward.json`` and ``backward.json``, each a
            :class:`ProfileTable` JSON (``bench/gpu_kernels.py --sections profile`` writes them).
        cost: the per-GPU attention shape the simulation runs (``ModelConfig.cost_model(tp)``).

    Each table's ``meta["cost"]`` must equal ``cost.to_dict()``: a latency measured for other
    head counts, head_dim or element size would silently mis-price every CA-task.

    Raises:
        ValueError: a missing file, an invalid table, or a table without ``meta["cost"]`` or for
            another attention shape (the message names both shapes).
    """
    tables = read_profile_dir(directory)
    for kind, table in zip(("forward", "backward"), tables):
        shape = table.meta.get("cost")
        if shape != cost.to_dict():
            raise ValueError(f"attention profile {Path(directory) / (kind + '.json')} was measured for the "
                             f"attention shape {shape}, but the simulation's per-GPU shape is {cost.to_dict()} "
                             f"(meta['cost'] must match: measure the table for this model and tp)")
    return tables


def measured_attention_profile(gpu_name: str, cost: CostModel) -> Path | None:
    """The folder of the measured tables shipped for GPU preset ``gpu_name`` and the per-GPU
    attention shape ``cost`` (a table's ``meta["cost"]`` equal to ``cost.to_dict()``), or None.

    Such a folder goes to :func:`load_attention_profile`; ``distca simulate`` uses it unless told
    ``--assumed-rates``.
    """
    root = PROFILES_DIR / str(gpu_name).lower()
    for folder in sorted(p for p in root.glob("*") if (p / "forward.json").is_file()):
        try:
            meta = json.loads((folder / "forward.json").read_text()).get("meta", {})
        except (OSError, ValueError):
            continue  # load_attention_profile reports a broken table when one is asked for by path
        if meta.get("cost") == cost.to_dict():
            return folder
    return None
