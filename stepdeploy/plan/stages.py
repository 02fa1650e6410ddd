"""What each pipeline stage holds: its decoder layers, and on the ends the embedding, logits and MTP."""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.plan.layout import Job, Layout, stage_layer_counts
from stepdeploy.plan.params import LayerParams, ParamCount


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline-parallel stage of a planned layout (not a rollout stage: rollout/stages/)."""

    index: int
    layers: tuple[LayerParams, ...]  # decoder layers, then MTP layers on the last stage
    first: bool
    last: bool


@dataclass(frozen=True)
class StageParams:
    """Parameters ONE GPU of the stage holds, split by how they are sharded."""

    dense: float  # non-expert, sharded over TP (replicated norms and router included)
    expert: float  # sharded over EP*ETP

    @property
    def total(self) -> float:
        return self.dense + self.expert


def stages(params: ParamCount, job: Job, layout: Layout) -> list[PipelineStage]:
    counts = stage_layer_counts(job.model.num_layers, layout)
    if counts is None:
        raise ValueError(f"no pipeline split for {layout.short()}")  # constraints reject this first
    result, start = [], 0
    for index, count in enumerate(counts):
        last = index == len(counts) - 1
        layers = params.layers[start : start + count] + (params.mtp_layers if last else ())
        result.append(PipelineStage(index, layers, first=index == 0, last=last))
        start += count
    return result


def stage_params(params: ParamCount, stage: PipelineStage, layout: Layout) -> StageParams:
    tp, expert_shards = layout.tp, layout.ep * layout.etp
    replicated = sum(layer.norms + layer.router for layer in stage.layers)
    sharded = sum(layer.non_expert - layer.norms - layer.router for layer in stage.layers)
    if stage.first:
        sharded += params.embedding
        replicated += params.position_embedding
    if stage.last:
        replicated += params.final_norm
        # With tied weights and PP>1 the last stage keeps its own copy of the word embeddings.
        sharded += params.output_layer or (params.embedding if layout.pp > 1 else 0)
    expert = sum(layer.experts_total for layer in stage.layers) / expert_shards
    return StageParams(dense=sharded / tp + replicated, expert=expert)
