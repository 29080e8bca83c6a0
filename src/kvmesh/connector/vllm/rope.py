"""The model's RoPE parameters, read off vLLM's HF config, for the KV registration.

A storage node moves CacheBlend segments between positions by rotating their
keys (docs/blend.md, "Segments in a registered engine's blocks"); it can do
that only for an engine that registered how its model rotates them. A wrong
guess would corrupt every moved key silently, so parameters are sent only for
model types whose rotary embedding is known here, with plain RoPE (no
scaling); for any other model none are sent and segment calls on its engine
are refused with FAILED_PRECONDITION. Prefix caching never needs them.
"""

from __future__ import annotations

from typing import Any

from kvmesh.api.common.v1 import common_pb2

#: Model types whose vLLM implementation rotates every key with NEOX pairing
#: (HF ``rotate_half``); ``partial_rotary_factor`` is honoured.
NEOX_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite"})
#: Model types that pair dimensions GPT-J style over ``rotary_dim`` leading dimensions.
GPTJ_MODEL_TYPES = frozenset({"gptj"})
#: The RoPE base of a config that names none.
DEFAULT_BASE = 10000.0


def rope_parameters(hf_config: Any, head_dim: int) -> tuple[common_pb2.RopeParameters | None, str]:
    """``(parameters, "")``, or ``(None, why)`` when this model's rotation is not known here."""
    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type not in NEOX_MODEL_TYPES | GPTJ_MODEL_TYPES:
        return None, f"model type {model_type!r} is not one whose rotary embedding kvmesh knows"
    # transformers 5 keeps theta and the scaling type in rope_parameters; older
    # configs in rope_theta and rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = params or dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        return None, f"RoPE scaling {rope_type!r} is not plain RoPE"
    # A config without any theta (GPT-J's) means the default base, as in HF and vLLM.
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", DEFAULT_BASE))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        return None, f"rope_theta {theta!r} is not a positive number"
    if model_type in GPTJ_MODEL_TYPES:
        style = common_pb2.ROPE_STYLE_GPTJ
        rotary_dim = int(getattr(hf_config, "rotary_dim", None) or head_dim)
    else:
        style = common_pb2.ROPE_STYLE_NEOX
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1))
        rotary_dim = int(head_dim * float(factor or 1))
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        return None, f"rotary_dim {rotary_dim} does not fit head_dim {head_dim}"
    return common_pb2.RopeParameters(
        base=float(theta), rotary_dim=0 if rotary_dim == head_dim else rotary_dim, style=style
    ), ""
