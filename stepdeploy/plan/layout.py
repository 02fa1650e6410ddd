"""A parallel layout (Megatron's knobs) and the job it runs: model, sequence, batch, GPU count."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Literal

from stepdeploy.catalog import ModelSpec
from stepdeploy.errors import BadInput

Recompute = Literal["none", "selective", "full"]
Dispatcher = Literal["alltoall", "flex", "allgather"]
# torch.optim.AdamW's implementation (megatron-core without Apex/TE builds torch's AdamW): foreach (torch's default
# on GPUs; its step allocates sqrt(v) for a whole param group) or fused (one kernel per tensor group, no temporary)
AdamImplementation = Literal["foreach", "fused"]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    mbs: int = 1
    recompute: Recompute = "none"
    distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    precision_aware_optimizer: bool = False
    optimizer: AdamImplementation = "foreach"
    sequence_parallel: bool | None = None  # None: on exactly when TP > 1
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool | None = None  # None: the planner's choice (plan.search.settle_param_gather)
    overlap_p2p_comm: bool = True
    overlap_moe_expert_parallel_comm: bool = False
    dispatcher: Dispatcher = "alltoall"
    grouped_gemm: bool = True  # grouped experts where the engine has them (ETP 1); False: SequentialMLP
    cross_entropy_fusion: bool = True  # megatron-core's fused vocab-parallel cross entropy (one more fp32 copy)
    # megatron-core's fused RoPE path (apply_rope_fusion), its kernel torch.compile'd by the engine (workload/rope.py)
    # where TransformerEngine is absent: one kernel each way on q and k instead of about six
    rope_fusion: bool = True
    # the routers' expert bias moves towards the mean load each step; off: it stays at zero (the control run that
    # must still fail expert_load)
    router_bias_update: bool = True
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def grouped_experts(self) -> bool:
        """Experts run as grouped GEMMs (the megatron engine's torch._grouped_mm module, ETP 1 only);
        otherwise megatron-core's SequentialMLP loop."""
        return self.grouped_gemm and self.etp == 1

    @property
    def param_gather_overlap(self) -> bool:
        """Given, or on wherever megatron allows it (distributed optimizer and overlapped gradient reduction):
        what plan.search.settle_param_gather writes into a layout left open."""
        if self.overlap_param_gather is None:
            return self.distributed_optimizer and self.overlap_grad_reduce
        return self.overlap_param_gather

    def short(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        parts += [
            f"{key}={getattr(self, key)}" for key in ("vpp", "cp", "ep", "etp") if getattr(self, key) > 1
        ]
        return ",".join(parts)


@dataclass(frozen=True)
class Job:
    """What is trained where: the model, its sequence and global batch, and the number of GPUs."""

    model: ModelSpec
    seq_length: int
    global_batch_size: int
    world: int

    def dp(self, layout: Layout) -> int:
        return self.world // (layout.tp * layout.pp * layout.cp)

    def edp(self, layout: Layout) -> int:
        return self.world // (layout.etp * layout.ep * layout.pp)

    def microbatches(self, layout: Layout) -> int:
        return max(1, self.global_batch_size // (layout.mbs * self.dp(layout)))


def check_sequence(spec: ModelSpec, seq_length: int) -> None:
    """BadInput when `seq_length` is beyond what the model has positions for: megatron-core refuses a sequence
    longer than max_position_embeddings, and both engines size their position tables by it. `plan` and `render`
    check it before any search, so such a sequence is bad input (exit 2), never 'no layout fits'."""
    if seq_length > spec.max_position_embeddings:
        raise BadInput(f"sequence length {seq_length} exceeds {spec.name}'s max_position_embeddings "
                       f"{spec.max_position_embeddings}",
                       hint=f"give --seq {spec.max_position_embeddings} or less (the model's default is "
                            f"{spec.training.seq_length})")


def vpp_group_size(microbatches: int, pp: int) -> int | None:
    """megatron-core's microbatch_group_size_per_vp_stage for an interleaved pipeline: the contiguous micro-batches
    each virtual stage runs, between PP and the micro-batches per step, whose last group is empty or at least PP
    long (schedules.py refuses anything else). The smallest such (PP itself where PP divides the micro-batches):
    the first stage holds (VPP-1) x group warm-up chunks. None when there are fewer micro-batches than stages."""
    if microbatches < pp:
        return None
    return next(g for g in range(pp, microbatches + 1) if microbatches % g == 0 or microbatches % g >= pp)


def stage_layer_counts(num_layers: int, layout: Layout) -> tuple[int, ...] | None:
    """Decoder layers per pipeline stage, or None when no split exists.

    Layers that do not divide evenly go to the middle stages first, so the first stage (which holds
    the most in-flight micro-batches) and the last (logits, MTP) get fewer: Megatron's
    decoder_first/last_pipeline_num_layers.
    """
    pp = layout.pp
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is not None or last is not None:
        return _explicit_split(num_layers, pp, first, last)
    if num_layers % pp == 0:
        return (num_layers // pp,) * pp
    if pp < 3:
        return (num_layers // pp, num_layers - num_layers // pp) if pp == 2 else None
    middle = -(-num_layers // pp)
    ends = num_layers - middle * (pp - 2)
    if ends < 2:
        return None
    return (ends // 2, *(middle,) * (pp - 2), ends - ends // 2)


def _explicit_split(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...] | None:
    if pp == 1:
        return None
    given = (first or 0) + (last or 0)
    unknown = pp - (first is not None) - (last is not None)
    rest = num_layers - given
    if unknown == 0:
        return (first or 0, last or 0) if rest == 0 else None
    if rest <= 0 or rest % unknown:
        return None
    each = rest // unknown
    return (first if first is not None else each, *(each,) * (pp - 2), last if last is not None else each)


_BOOL_WORDS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
_ALIASES = {
    "dist-opt": "distributed_optimizer",
    "offload": "optimizer_cpu_offload",
    "sp": "sequence_parallel",
    "ce-fusion": "cross_entropy_fusion",
    "first": "first_stage_layers",
    "last": "last_stage_layers",
}


def parse_layout(text: str, base: Layout | None = None) -> Layout:
    """`tp=8,pp=2,ep=4,recompute=full,dist-opt=0` -> Layout; BadInput naming the valid keys otherwise."""
    known = {field.name: field for field in fields(Layout)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        name = _ALIASES.get(key.strip(), key.strip().replace("-", "_"))
        if not sep or name not in known:
            valid = ", ".join([*known, *_ALIASES])
            raise BadInput(f"--layout: cannot read {item!r}; use key=value with keys: {valid}")
        if name in values:
            raise BadInput(f"--layout: {name} is given twice; give each key once")
        values[name] = _convert(name, raw.strip(), str(known[name].type))
    return replace(base or Layout(), **values)  # type: ignore[arg-type]


def _convert(name: str, raw: str, type_name: str) -> object:
    if "bool" in type_name:
        if raw.lower() not in _BOOL_WORDS:
            raise BadInput(f"--layout: {name} takes on/off, got {raw!r}")
        return _BOOL_WORDS[raw.lower()]
    if "int" in type_name:
        # ASCII digits only: str.isdigit() also takes '²' and other digits int() refuses
        if not re.fullmatch(r"[0-9]{1,6}", raw) or int(raw) < 1:
            raise BadInput(f"--layout: {name} takes a positive integer (at most 6 digits), got {raw!r}")
        return int(raw)
    choices = {"recompute": ("none", "selective", "full"), "dispatcher": ("alltoall", "flex", "allgather"),
               "optimizer": ("foreach", "fused")}
    if raw not in choices.get(name, ()):
        raise BadInput(f"--layout: {name} is one of {', '.join(choices.get(name, ()))}, got {raw!r}")
    return raw
