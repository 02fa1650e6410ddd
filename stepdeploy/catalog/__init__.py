"""The catalog: model architectures and GPU/link specifications, each value with its source."""

from stepdeploy.catalog.hardware import GIB, MIB, Efficiency, GpuSpec, Hardware, LinkSpec
from stepdeploy.catalog.loader import gpu, link, load_hardware, load_model, model_names, model_slug, parse_model
from stepdeploy.catalog.model import LayerShape, ModelSpec, MoeSpec, TrainingDefaults

__all__ = [
    "GIB",
    "MIB",
    "Efficiency",
    "GpuSpec",
    "Hardware",
    "LayerShape",
    "LinkSpec",
    "ModelSpec",
    "MoeSpec",
    "TrainingDefaults",
    "gpu",
    "link",
    "load_hardware",
    "load_model",
    "model_names",
    "model_slug",
    "parse_model",
]
