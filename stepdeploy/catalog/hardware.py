"""GPU and link specifications (data in stepdeploy/data/hardware.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024**2
GIB = 1024**3


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuSpec(_Frozen):
    name: str
    arch: str
    memory_mib: int = Field(gt=0)
    reserved_mib: int = Field(default=0, ge=0)
    bf16_dense_tflops: float = Field(gt=0)
    bf16_measured_tflops: float | None = None
    memory_bandwidth_gbps: float = Field(gt=0)
    intra_node_link: str | None
    cuda_context_mib: int = Field(ge=0)
    # CPU and GPU share one memory pool (GB10): offloading optimizer state to the host frees nothing.
    unified_memory: bool = False
    # Host (CPU) memory per GPU, the budget for optimizer state offloaded to the CPU; None = unknown.
    host_memory_gib_per_gpu: float | None = Field(default=None, gt=0)
    sources: list[str] = Field(min_length=1)

    @property
    def usable_bytes(self) -> int:
        """Memory a training process can allocate (unified-memory GPUs share theirs with the OS)."""
        return (self.memory_mib - self.reserved_mib) * MIB


class LinkSpec(_Frozen):
    name: str
    kind: Literal["nvlink", "infiniband", "roce", "ethernet"]
    bandwidth_gbps: float = Field(gt=0)
    busbw_gbps: float = Field(gt=0)
    per_gpu: bool = True
    sources: list[str] = Field(min_length=1)


class Efficiency(_Frozen):
    peak_when_unmeasured: float = Field(gt=0, le=1)
    dense: float = Field(gt=0, le=1)
    experts_grouped_gemm: float = Field(gt=0, le=1)  # at EXPERT_ROWS_REF rows per expert (plan/steptime.py)
    experts_grouped_half_rows: float = Field(default=0.0, ge=0)  # rows per expert where it reaches half its ceiling
    experts_grouped_half_width: float = Field(default=0.0, ge=0)  # expert FFN width where it reaches half its ceiling
    experts_sequential: float = Field(gt=0, le=1)
    comm_overlap: float = Field(ge=0, le=1)
    sources: list[str] = Field(min_length=1)


class Hardware(_Frozen):
    gpus: dict[str, GpuSpec]
    links: dict[str, LinkSpec]
    efficiency: Efficiency
    fabric_links: dict[str, str]

    def peak_tflops(self, gpu: GpuSpec) -> float:
        """The peak a step-time prediction divides by: measured where we have it, else a derated spec."""
        if gpu.bf16_measured_tflops:
            return gpu.bf16_measured_tflops
        return gpu.bf16_dense_tflops * self.efficiency.peak_when_unmeasured
