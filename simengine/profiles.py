"""Timing model: how long one engine step takes on a given accelerator, for a dense 8B model.

Step time = fixed overhead + weight-read time (a step reads every weight once: decode is memory-bound)
          + per prefill chunk: tokens x compute time per token + attention term (quadratic in context)
          + per decode sequence: sampling overhead + KV read time of its context
          + tier loads (CPU / disk bytes over their bandwidth).

Model: Llama-3.1-8B (8.03e9 parameters, BF16 -> 16.06 GB of weights; 32 layers, 8 KV heads x 128 dims, so KV is
2 x 32 x 8 x 128 x 2 B = 128 KiB per token; 2 x 8.03e9 = 16.1 GFLOP per token of linear layers; attention
adds 4 x 32 layers x 4096 = 0.52 MFLOP per (query, key) pair). Sources: the model card and config.json of
meta-llama/Llama-3.1-8B on Hugging Face.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_BYTES_8B = 16.06e9
KV_BYTES_PER_TOKEN_8B = 2 * 32 * 8 * 128 * 2
FLOPS_PER_TOKEN_8B = 2 * 8.03e9
ATTN_FLOPS_PER_PAIR_8B = 4 * 32 * 4096


@dataclass(frozen=True, slots=True)
class Profile:
    """Accelerator figures the step time is computed from; `sources` cites where each number comes from."""

    name: str
    #: Dense BF16/FP16 peak, FLOP/s, and the share of it prefill reaches (model FLOPs utilisation).
    peak_flops: float
    mfu: float
    #: HBM bandwidth, bytes/s, and the share of it a decode step reaches.
    hbm_bandwidth: float
    hbm_efficiency: float
    #: Per-step overhead (scheduling, launch / graph replay), seconds.
    step_overhead_s: float
    #: Per-sequence overhead in a step (sampling, detokenisation bookkeeping), seconds.
    per_seq_overhead_s: float
    #: Host-to-device bandwidth for CPU-tier loads and disk read bandwidth, bytes/s.
    cpu_load_bandwidth: float
    disk_load_bandwidth: float
    #: Engine-to-engine KV transfer bandwidth (P/D), bytes/s.
    transfer_bandwidth: float
    sources: tuple[str, ...]

    @property
    def prefill_s_per_token(self) -> float:
        return FLOPS_PER_TOKEN_8B / (self.peak_flops * self.mfu)

    @property
    def attn_s_per_pair(self) -> float:
        return ATTN_FLOPS_PER_PAIR_8B / (self.peak_flops * self.mfu)

    @property
    def weights_read_s(self) -> float:
        return WEIGHT_BYTES_8B / (self.hbm_bandwidth * self.hbm_efficiency)

    @property
    def kv_read_s_per_token(self) -> float:
        return KV_BYTES_PER_TOKEN_8B / (self.hbm_bandwidth * self.hbm_efficiency)

    def prefill_chunk_s(self, num_tokens: int, context: int) -> float:
        """Compute time of `num_tokens` new tokens after `context` cached ones (causal attention)."""
        pairs = num_tokens * context + num_tokens * (num_tokens + 1) / 2
        return num_tokens * self.prefill_s_per_token + pairs * self.attn_s_per_pair

    def step_s(
        self,
        prefill_chunks: list[tuple[int, int]],
        num_decode: int,
        decode_context: int,
        load_tokens_cpu: int = 0,
        load_tokens_disk: int = 0,
    ) -> float:
        """Duration of one step: prefill chunks as (new tokens, context), decode sequences with their summed
        context, and prompt tokens loaded from the CPU and disk tiers."""
        if not prefill_chunks and not num_decode and not load_tokens_cpu and not load_tokens_disk:
            return 0.0
        t = self.step_overhead_s + self.weights_read_s
        for n, ctx in prefill_chunks:
            t += self.prefill_chunk_s(n, ctx)
        t += num_decode * self.per_seq_overhead_s + decode_context * self.kv_read_s_per_token
        t += load_tokens_cpu * KV_BYTES_PER_TOKEN_8B / self.cpu_load_bandwidth
        t += load_tokens_disk * KV_BYTES_PER_TOKEN_8B / self.disk_load_bandwidth
        return t

    def transfer_s(self, num_tokens: int) -> float:
        """Time to move the KV of `num_tokens` tokens between engines."""
        return num_tokens * KV_BYTES_PER_TOKEN_8B / self.transfer_bandwidth

    def expected_ttft_s(self, prompt_tokens: int) -> float:
        """TTFT of one request alone on an idle engine (one prefill step)."""
        return self.step_s([(prompt_tokens, 0)], 0, 0)

    def expected_itl_s(self, batch: int, context: int) -> float:
        """Inter-token latency of `batch` sequences each with `context` tokens."""
        return self.step_s([], batch, batch * context)


H100 = Profile(
    name="h100",
    peak_flops=989e12,
    mfu=0.50,
    hbm_bandwidth=3.35e12,
    hbm_efficiency=0.80,
    step_overhead_s=0.0010,
    per_seq_overhead_s=15e-6,
    cpu_load_bandwidth=50e9,
    disk_load_bandwidth=6e9,
    transfer_bandwidth=40e9,
    sources=(
        "NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, PCIe Gen5 x16 (64 GB/s per direction)",
        "MFU 0.5 and HBM efficiency 0.8: typical of vLLM/TensorRT-LLM prefill and decode kernels on Hopper; they "
        "give ~29 us per prefill token (~34k tok/s) and ~7 ms decode steps at small batch, in line with the "
        "~6-8 ms ITL vLLM reports for Llama-3.1-8B on one H100 at low concurrency (vLLM blog, 2024-09, v0.6.0 perf)",
        "disk: one PCIe Gen4 NVMe drive, ~6 GB/s sequential read; P/D transfer: 400 Gb/s NIC at ~80%",
    ),
)

ASCEND_910B = Profile(
    name="ascend-910b",
    peak_flops=313e12,
    mfu=0.45,
    hbm_bandwidth=1.6e12,
    hbm_efficiency=0.70,
    step_overhead_s=0.0020,
    per_seq_overhead_s=30e-6,
    cpu_load_bandwidth=25e9,
    disk_load_bandwidth=5e9,
    transfer_bandwidth=20e9,
    sources=(
        "Huawei Atlas 800T A2 / Ascend 910B3 public spec: ~313 TFLOPS FP16, 64 GB HBM2e at ~1.6 TB/s, "
        "PCIe Gen4 x16 host link (~25 GB/s usable)",
        "MFU 0.45 and HBM efficiency 0.7 (ACL graph mode): ~114 us per prefill token (~8.8k tok/s) and ~16 ms "
        "decode steps at small batch, the range vLLM-Ascend users report for 7-8B dense models on one 910B",
        "disk: NVMe ~5 GB/s; P/D transfer: 200 Gb/s RoCE at ~80% (Mooncake transfer engine over RDMA)",
    ),
)

PROFILES = {p.name: p for p in (ASCEND_910B, H100)}
