"""A Hugging Face model folder as a TorchTitan model: its ``config.json`` mapped onto
TorchTitan's own model definitions, and the state-dict adapter that converts weights
between the two naming schemes.

TorchTitan's registries hold fixed flavours (Llama 3 8B, Qwen3 0.6B, ...); a run's model
is whatever folder ``model.name`` gives, so its configuration is built here from the same
building blocks the registries use (``make_gqa_config``, ``make_ffn_config``, the model
classes, their ``parallelize_fn`` and adapters), one builder per Hugging Face
``model_type``:

* ``llama`` (SmolLM2, Llama 2/3, the tiny model's ``llama`` flavour): ``Llama3Model``,
  complex RoPE (with Llama 3 frequency scaling when the config asks for it);
  ``Llama3StateDictAdapter`` permutes q/k between Hugging Face's rotate-half layout
  and TorchTitan's interleaved pairs.
* ``qwen2`` (the tiny model's default flavour): the same, plus biases on q/k/v (q/k
  biases permuted like their weights).
* ``qwen3`` (dense): ``Qwen3Model`` with its q/k norms and rotate-half RoPE, through
  ``Qwen3StateDictAdapter`` (no permutation).

Attention is SDPA, causal, without a mask: TorchTitan's flex and varlen kernels need CUDA
(flex has no CPU backward), and a causal mask is exact for right-padded rows (a real
token never attends to a padding one after it).

Anything these cannot express (another activation, RoPE scaling or attention layout,
sliding windows, MLP biases, mixture of experts) is refused as :class:`UnsupportedModel`,
one line naming what; see :func:`unsupported_reason`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forgerl.errors import ConfigError

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")


class UnsupportedModel(ConfigError):
    """The run's model has something TorchTitan's model definitions cannot express."""


def read_hf_config(folder: Path) -> dict[str, Any]:
    import json

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the model's config ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a Hugging Face model config (a JSON object)")
    return config


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """``rope_type``, ``rope_theta`` and the scaling fields, from a transformers 5 config
    (``rope_parameters``) or an older one (``rope_theta`` + ``rope_scaling``)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def unsupported_reason(hf: dict[str, Any]) -> str | None:
    """What in the Hugging Face config ``hf`` the builders here cannot express, or None."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        return f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_TYPES)})"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(hf.get(key), int) or hf[key] < 1:
            return f"{key} {hf.get(key)!r} (a positive integer is needed)"
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} (SwiGLU feed-forward needs silu)"
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:
        return f"{heads} attention heads over {kv} key/value heads (must divide)"
    rope = rope_parameters(hf)
    allowed = ("default", "llama3") if model_type != "qwen3" else ("default",)
    if rope["rope_type"] not in allowed:
        return f"RoPE scaling {rope['rope_type']!r} (supported: {', '.join(allowed)})"
    if hf.get("mlp_bias"):
        return "mlp_bias true (TorchTitan's feed-forward has no biases)"
    if model_type == "qwen3" and hf.get("attention_bias"):
        return "attention_bias true on a qwen3 model"
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        return "sliding-window attention layers (TorchTitan's SDPA path is full causal attention)"
    if model_type == "qwen3" and any(k in hf for k in ("num_experts", "moe_intermediate_size")):
        return "mixture-of-experts layers"
    return None


def model_spec(folder: Path) -> Any:
    """The TorchTitan ``ModelSpec`` of the Hugging Face model in ``folder``: model config,
    ``parallelize_fn`` and state-dict adapter. :class:`UnsupportedModel` when it cannot
    be expressed."""
    hf = read_hf_config(folder)
    reason = unsupported_reason(hf)
    if reason is not None:
        raise UnsupportedModel(f"the torchtitan trainer cannot express the model in {folder}: {reason}")
    from torchtitan.protocols.model_spec import ModelSpec

    if hf["model_type"] == "qwen3":
        from torchtitan.models.qwen3 import parallelize_qwen3
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        config, name, parallelize, adapter = _qwen3_config(hf), "qwen3", parallelize_qwen3, Qwen3StateDictAdapter
    else:
        from torchtitan.models.llama3 import parallelize_llama

        config, name, parallelize, adapter = _llama_config(hf), "llama3", parallelize_llama, _llama_adapter()
    return ModelSpec(
        name=name,
        flavor=f"hf:{hf['model_type']}",
        model=config,
        parallelize_fn=parallelize,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter,
    )


def fill_sharding_plan(spec: Any) -> None:
    """Write the tensor-parallel sharding plan into ``spec.model`` (no sequence
    parallelism, no expert parallelism), as the model config's ``update_from_config``
    would: that method also imports TorchTitan's whole pretraining ``Trainer`` (datasets,
    dataloaders, metric loggers), which training from forgerl does not need."""
    if spec.name == "qwen3":
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(spec.model, enable_sp=False, enable_ep=False)
    else:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(spec.model, enable_sp=False)


# ------------------------------------------------------------------------- builders

def _no_init() -> dict[str, Any]:
    # Every parameter is overwritten by the checkpoint right after the model is
    # materialised (a missing one is an error), so drawing random values would be waste.
    from torchtitan.models.common.param_init import skip_param_init

    return {"weight": skip_param_init, "bias": skip_param_init}


def _dims(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    dim = hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // heads
    return {
        "dim": dim,
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        # Only where it is not dim // heads: TorchTitan derives it otherwise.
        "head_dim": head_dim if head_dim * heads != dim else None,
        "rope_dim": head_dim,
        "eps": float(hf.get("rms_norm_eps", 1e-6)),
        "vocab": hf["vocab_size"],
        "max_len": int(hf.get("max_position_embeddings") or 2048),
        "tied": bool(hf.get("tie_word_embeddings", False)),
    }


def _decoder_parts(d: dict[str, Any]) -> dict[str, Any]:
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return {
        "dim": d["dim"],
        "vocab_size": d["vocab"],
        "enable_weight_tying": d["tied"],
        "tok_embeddings": Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["dim"], param_init=_no_init()),
        "norm": RMSNorm.Config(normalized_shape=d["dim"], eps=d["eps"], param_init=_no_init()),
        "lm_head": Linear.Config(in_features=d["dim"], out_features=d["vocab"], param_init=_no_init()),
    }


def _attention(d: dict[str, Any], rope: Any, qk_norm: Any = None) -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config

    return make_gqa_config(
        dim=d["dim"],
        n_heads=d["n_heads"],
        n_kv_heads=d["n_kv_heads"],
        head_dim=d["head_dim"],
        wqkv_param_init=_no_init(),
        wo_param_init=_no_init(),
        inner_attention=ScaledDotProductAttention.Config(),
        rope=rope,
        # Separate wq/wk/wv: their names are the adapter's, and tensor parallelism
        # shards each without the fused layout's head-group constraints.
        fuse_qkv=False,
        qk_norm=qk_norm,
    )


def _ffn(hf: dict[str, Any]) -> Any:
    from torchtitan.models.common.config_utils import make_ffn_config

    return make_ffn_config(
        dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"], w1_param_init=_no_init(), w2w3_param_init=_no_init()
    )


def _llama_config(hf: dict[str, Any]) -> Any:
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    d = _dims(hf)
    params = rope_parameters(hf)
    scaling = {}
    if params["rope_type"] == "llama3":
        scaling = {
            "scaling": "llama",
            "scaling_factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        }
    rope = ComplexRoPE.Config(dim=d["rope_dim"], max_seq_len=d["max_len"], theta=float(params["rope_theta"]), **scaling)
    # Qwen2 puts biases on q, k and v; Llama's attention_bias on all four projections.
    qkv_bias = hf["model_type"] == "qwen2" or bool(hf.get("attention_bias"))
    o_bias = hf["model_type"] == "llama" and bool(hf.get("attention_bias"))
    layers = []
    for _ in range(hf["num_hidden_layers"]):
        attention = _attention(d, rope)
        attention.qkv_linear.wq.bias = attention.qkv_linear.wkv.bias = qkv_bias
        attention.wo.bias = o_bias
        layers.append(
            Llama3TransformerBlock.Config(
                attention_norm=RMSNorm.Config(normalized_shape=d["dim"], eps=d["eps"], param_init=_no_init()),
                ffn_norm=RMSNorm.Config(normalized_shape=d["dim"], eps=d["eps"], param_init=_no_init()),
                attention=attention,
                feed_forward=_ffn(hf),
            )
        )
    return Llama3Model.Config(**_decoder_parts(d), layers=layers)


def _qwen3_config(hf: dict[str, Any]) -> Any:
    from torchtitan.models.common import CosSinRoPE, RMSNorm
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model import Qwen3TransformerBlock

    d = _dims(hf)
    rope = CosSinRoPE.Config(dim=d["rope_dim"], max_seq_len=d["max_len"], theta=float(rope_parameters(hf)["rope_theta"]))
    qk_norm = RMSNorm.Config(normalized_shape=d["rope_dim"], eps=d["eps"], param_init=_no_init())
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=d["dim"], eps=d["eps"], param_init=_no_init()),
            ffn_norm=RMSNorm.Config(normalized_shape=d["dim"], eps=d["eps"], param_init=_no_init()),
            attention=_attention(d, rope, qk_norm),
            feed_forward=_ffn(hf),
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    return Qwen3Model.Config(**_decoder_parts(d), layers=layers)


def _llama_adapter() -> type:
    """TorchTitan's Llama 3 adapter, taught the projection biases of Qwen2 (q/k/v) and
    of Llama's ``attention_bias`` (q/k/v/o). q and k biases are permuted like their
    weights' rows: the bias is added per output row, and RoPE pairs those rows."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    class BiasedLlamaAdapter(Llama3StateDictAdapter):  # type: ignore[misc]  # untyped upstream
        def __init__(self, model_config: Any, hf_assets_path: str | None) -> None:
            super().__init__(model_config, hf_assets_path)
            for hf_name, tt_name in (("q_proj", "qkv_linear.wq"), ("k_proj", "qkv_linear.wk"),
                                     ("v_proj", "qkv_linear.wv"), ("o_proj", "wo")):
                self.from_hf_map[f"model.layers.{{}}.self_attn.{hf_name}.bias"] = f"layers.{{}}.attention.{tt_name}.bias"

        def _heads(self) -> tuple[int, int]:
            attn = self.model_config.layers[0].attention
            return attn.n_heads, attn.n_kv_heads or attn.n_heads

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            n_heads, n_kv = self._heads()
            state = dict(hf_state_dict)
            for key, value in hf_state_dict.items():
                if key.endswith(("q_proj.bias", "k_proj.bias")):
                    heads = n_heads if key.endswith("q_proj.bias") else n_kv
                    state[key] = self._reverse_permute(value.unsqueeze(-1), heads, value.shape[0], 1).squeeze(-1)
            return super().from_hf(state)

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            n_heads, n_kv = self._heads()
            state = dict(state_dict)
            for key, value in state_dict.items():
                if key.endswith(("wq.bias", "wk.bias")):
                    heads = n_heads if key.endswith("wq.bias") else n_kv
                    state[key] = self._permute(value.unsqueeze(-1), heads, value.shape[0], 1).squeeze(-1)
            return super().to_hf(state)

    return BiasedLlamaAdapter
