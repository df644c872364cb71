"""Whether the vLLM runner can hand a model's RoPE table to the methods that un-rotate keys.

Compactor, ExpectedAttention and ``kara-retain`` score keys before their RoPE rotation
(``Method.reads_rope``). The runner finds vLLM's rotary layer in the loaded model and
hands its table over only in the neox layout (dimension ``i`` paired with ``i + r/2``;
:mod:`kvllm.methods.rope`). The model is loaded in the worker, after the process that
accepts requests has checked them, so that process predicts the layout from the model's
config: vLLM's model classes fix ``is_neox_style`` per architecture, and a few of them
rotate interleaved pairs (GPT-J's ``rotate_every_two``). A prediction that is wrong the
other way is still safe: the round fails in the worker, and a failed round is contained
to its request (:mod:`kvllm.vllm.runner`).
"""

from __future__ import annotations

from typing import Any

# model_type -> why: vLLM builds these models' rotary layers with is_neox_style=False
# (vllm/model_executor/models: gpt_j, glm4, commandr, cohere2_moe, ernie45).
INTERLEAVED = {
    "gptj": "GPT-J",
    "glm4": "GLM-4",
    "cohere": "Command R",
    "cohere2": "Command R7B",
    "cohere2_moe": "Command A",
    "ernie4_5": "ERNIE 4.5",
    "ernie4_5_moe": "ERNIE 4.5 MoE",
}
# Config fields that hold a RoPE's parameters, under the names transformers' configs use.
ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "partial_rotary_factor")


def rope_problem(hf_config: Any) -> str | None:
    """Why the runner cannot give methods this model's RoPE table, or ``None`` if it can."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type in INTERLEAVED:
        name = INTERLEAVED[model_type]
        return f"this model ({name}, model_type {model_type!r}) rotates interleaved pairs, GPT-J-style"
    if model_type == "chatglm" and getattr(hf_config, "original_rope", True):
        return "this model (ChatGLM with original_rope) rotates interleaved pairs, GPT-J-style"
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if isinstance(params, dict) and ("mrope_section" in params or "mrope_section" in params.get("default", {})):
        return "this model uses multimodal RoPE (M-RoPE), whose sections rotate by several position ids"
    if not any(getattr(hf_config, field, None) is not None for field in ROPE_FIELDS):
        return "this model's config names no RoPE (its positions may be learned or ALiBi)"
    return None
