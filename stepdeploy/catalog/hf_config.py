"""A Hugging Face `config.json` as a ModelSpec: the architectures the megatron engine builds, nothing else.

Accepted model_types: the Llama-style dense family (llama, mistral, qwen2, qwen3) and the MoE models built from
the same layers (mixtral, qwen2_moe, qwen3_moe). Whatever the engine cannot express -- DeepSeek's multi-head
latent attention, sliding windows on every layer, rope scalings other than llama3's, biases megatron-core cannot
place, the Qwen2-MoE shared-expert gate, routers that do not renormalize their top-k -- is refused by name
(BadInput, exit 2), all reasons in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepdeploy import safeio
from stepdeploy.catalog.model import ModelSpec, parse_model
from stepdeploy.errors import BadInput

MAX_CONFIG_BYTES = 1024 * 1024  # a config.json is a few KiB
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
DEFAULT_SEQ = 4096  # training defaults of a model given by its config (plan/render take --seq, --gbs)
DEFAULT_GBS = 256
REFUSAL_HINT = ("state the architecture field by field in a model YAML of the catalog's schema "
                "(stepdeploy/data/models/*.yaml) and pass its path to --model, if the engine's variant will do")
ENGINE_NORM_EPS = 1e-5  # megatron-core's layernorm_epsilon, which the megatron engine leaves at its default


def read_hf_config(path: Path) -> tuple[dict[str, Any], Path]:
    """The JSON object of `path` (a config.json, or a directory holding one) and the file it came from."""
    file = path / "config.json" if path.is_dir() else path
    data = safeio.read_json(file, "Hugging Face config", limit=MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise BadInput(f"{file}: a Hugging Face config.json is a JSON object, not a {type(data).__name__}")
    return data, file


class _Fields:
    """Typed reads of a config's fields, each error naming the file and the field."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def fail(self, message: str, hint: str | None = None) -> BadInput:
        return BadInput(f"{self.source}: {message}", hint=hint)

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.cfg.get(key, default)
        if value is None:
            raise self.fail(f"missing field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"{key} must be an integer >= {minimum}, not {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.cfg.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(f"{key} must be a positive number, not {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{key} must be true or false, not {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(f"{key} must be a list of layer indexes, not {value!r}")
        return value


def spec_from_hf_config(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    """The ModelSpec of a Hugging Face config (`source` names the file in errors and in the spec's sources)."""
    f = _Fields(cfg, source)
    model_type = _model_type(f, cfg)
    refused: list[str] = []
    layers = f.integer("num_hidden_layers")
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    head_dim = _head_dim(f, cfg, hidden, heads)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        refused.append(f"hidden_act {act!r} (the engine's gated MLP is SwiGLU: silu)")
    if f.flag("mlp_bias", False):
        refused.append("mlp_bias (megatron-core biases the MLP only together with every other linear)")
    qwen2_family = model_type in ("qwen2", "qwen2_moe")
    if not qwen2_family and f.flag("attention_bias", False):
        refused.append("attention_bias (biases on q, k, v and o: megatron-core biases q, k, v alone or every linear)")
    if model_type == "qwen2_moe" and f.flag("qkv_bias", True) is False:
        refused.append("qkv_bias false (qwen2_moe without q/k/v biases)")
    window, every = _attention_pattern(f, model_type, layers, refused)
    rope = _rope(f, refused)
    spec: dict[str, Any] = {
        "name": name,
        "description": _description(cfg, model_type, f.number("rms_norm_eps", ENGINE_NORM_EPS)),
        "sources": [f"{source} (Hugging Face config.json, model_type {model_type}; stepdeploy/catalog/hf_config.py)"],
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": f.integer("num_key_value_heads", heads),
        "kv_channels": head_dim,
        "ffn_hidden_size": f.integer("intermediate_size"),
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("max_position_embeddings"),
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": qwen2_family,  # Qwen2 (and Qwen2-MoE) attention: q, k, v with biases, o without
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),  # per-head RMSNorm of q and k
        "position_embedding_type": "rope",
        "untie_embeddings_and_output_weights": not f.flag("tie_word_embeddings", False),
        "rope": rope,
        "sliding_window": window,
        "full_attention_every": every,
        "moe": _moe(f, model_type, layers, refused) if model_type in MOE_TYPES else None,
        "training": {"seq_length": min(DEFAULT_SEQ, f.integer("max_position_embeddings")),
                     "global_batch_size": DEFAULT_GBS},
    }
    if refused:
        raise f.fail(f"model_type {model_type}: the megatron engine cannot build {'; '.join(refused)}",
                     hint=REFUSAL_HINT)
    return parse_model(spec, origin=source)


def _model_type(f: _Fields, cfg: dict[str, Any]) -> str:
    """The config's model_type, if it is one the megatron engine builds (else BadInput naming why)."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise f.fail("no model_type: not a Hugging Face config.json")
    if model_type in MLA_TYPES or "kv_lora_rank" in cfg or "q_lora_rank" in cfg:
        raise f.fail(f"model_type {model_type}: multi-head latent attention (kv_lora_rank) is not something the "
                     "megatron engine builds (it runs grouped-query attention only)", hint=REFUSAL_HINT)
    if model_type not in DENSE_TYPES + MOE_TYPES:
        raise f.fail(f"model_type {model_type} is not one the megatron engine builds; accepted: "
                     f"{', '.join(DENSE_TYPES + MOE_TYPES)}", hint=REFUSAL_HINT)
    return model_type


def _head_dim(f: _Fields, cfg: dict[str, Any], hidden: int, heads: int) -> int:
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        return f.integer("head_dim")
    if hidden % heads:
        raise f.fail(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim given")
    return hidden // heads


def _description(cfg: dict[str, Any], model_type: str, eps: float) -> str:
    arch = cfg.get("architectures")
    what = arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else model_type
    text = f"{what} from a Hugging Face config.json"
    if isinstance(cfg.get("_name_or_path"), str) and cfg["_name_or_path"]:
        text += f" ({cfg['_name_or_path']})"
    if eps != ENGINE_NORM_EPS:
        text += f"; rms_norm_eps {eps:g} (the megatron engine normalizes with megatron-core's {ENGINE_NORM_EPS:g})"
    return text


def _attention_pattern(f: _Fields, model_type: str, layers: int, refused: list[str]) -> tuple[int | None, int]:
    """(sliding_window, full_attention_every): full attention everywhere, or a window on all but every k-th
    layer (layer 0 full) as ModelSpec expresses it; anything else is refused."""
    cfg = f.cfg
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if model_type in QWEN_TYPES and not f.flag("use_sliding_window", False):
        window = None  # Qwen configs carry a sliding_window that only use_sliding_window turns on
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise f.fail(f"layer_types must list one type per layer ({layers}), not {types!r}")
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
        other = sorted({kind for kind in types if kind not in ("full_attention", "sliding_attention")}, key=str)
        if other:
            refused.append(f"layer_types {', '.join(map(str, other))}")
            return None, 1
        if not sliding:
            return None, 1
        if window is None:
            raise f.fail("layer_types has sliding_attention layers but no sliding_window")
        size = f.integer("sliding_window")
        every = next((i for i in range(1, layers) if i not in sliding), layers)
        if any((i % every != 0) != (i in sliding) for i in range(layers)):
            refused.append(f"sliding-window layers {sliding[:8]}{'...' if len(sliding) > 8 else ''} (the engine "
                           "runs a window on all but every k-th layer, layer 0 full)")
            return None, 1
        return size, every
    if window is None:
        return None, 1
    size = f.integer("sliding_window")
    if size >= f.integer("max_position_embeddings"):
        return None, 1  # a window as long as the longest sequence is full causal attention
    where = "layers >= max_window_layers" if model_type in QWEN_TYPES else "every layer"
    refused.append(f"sliding_window {size} on {where} (the engine keeps layer 0 and every k-th layer full)")
    return None, 1


def _rope(f: _Fields, refused: list[str]) -> dict[str, Any]:
    cfg = f.cfg
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    scaling = params if params is not None else cfg.get("rope_scaling")
    theta = (params or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise f.fail(f"rope_theta must be a positive number, not {theta!r}")
    rope: dict[str, Any] = {"theta": float(theta), "rotary_percent": f.number("partial_rotary_factor", 1.0)}
    if scaling is None:
        return rope
    if not isinstance(scaling, dict):
        raise f.fail(f"rope_scaling must be an object or null, not {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if key not in scaling]
        if missing:
            raise f.fail(f"rope_scaling llama3 lacks {', '.join(missing)}")
        rope["llama3_scaling"] = {key: scaling[key] for key in keys}
    elif kind != "default":
        refused.append(f"rope_scaling {kind!r} (the engine scales RoPE the llama3 way only)")
    return rope


def _moe(f: _Fields, model_type: str, layers: int, refused: list[str]) -> dict[str, Any] | None:
    """MoeSpec fields of mixtral / qwen2_moe / qwen3_moe (None when no layer has experts)."""
    cfg = f.cfg
    topk = f.integer("num_experts_per_tok")
    aux = cfg.get("router_aux_loss_coef")
    moe: dict[str, Any] = {"topk": topk, "score_function": "softmax"}
    if isinstance(aux, int | float) and not isinstance(aux, bool) and aux >= 0:
        moe["aux_loss_coeff"] = float(aux)
    if model_type == "mixtral":
        # Mixtral's experts are intermediate_size wide on every layer; its top-k weights are the softmax over the
        # chosen logits, megatron's topk-then-softmax.
        if cfg.get("router_jitter_noise"):
            refused.append(f"router_jitter_noise {cfg['router_jitter_noise']} (the engine's router adds no noise)")
        return moe | {"num_experts": f.integer("num_local_experts"), "ffn_hidden_size": f.integer("intermediate_size")}
    experts = f.integer("num_experts", minimum=0)
    step = f.integer("decoder_sparse_step", 1)
    dense_only = set(f.int_list("mlp_only_layers"))
    sparse = [i for i in range(layers) if experts > 0 and i not in dense_only and (i + 1) % step == 0]
    if not sparse:
        return None
    first = sparse[0]
    if sparse != list(range(first, layers)):
        dense = sorted(set(range(first, layers)) - set(sparse))
        refused.append(f"dense layers {dense[:8]}{'...' if len(dense) > 8 else ''} between MoE layers "
                       "(decoder_sparse_step / mlp_only_layers; the engine runs dense layers first, then MoE)")
    if not f.flag("norm_topk_prob", False):
        refused.append("norm_topk_prob false (top-k weights from a softmax over all experts, not renormalized: "
                       "megatron's moe_router_pre_softmax, which the engine does not set)")
    shared = f.integer("shared_expert_intermediate_size", 0, minimum=0) if model_type == "qwen2_moe" else 0
    if shared:
        refused.append("the shared expert's sigmoid gate (qwen2_moe shared_expert_gate; the engine adds the shared "
                       "expert ungated)")
    return moe | {"num_experts": experts, "ffn_hidden_size": f.integer("moe_intermediate_size"),
                  "shared_expert_ffn_hidden_size": shared, "first_dense_layers": first}
