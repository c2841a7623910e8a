"""Hugging Face checkpoints (Llama, Mistral, Qwen2; config.json + safetensors) in and out of our model.

HF keeps q/k/v and gate/up as separate matrices; our model fuses them, so a fused parameter is
filled from several checkpoint tensors, each into its own row range:

    qkv_proj.weight rows   [0, q) <- q_proj   [q, q+kv) <- k_proj   [q+kv, q+2kv) <- v_proj
    gate_up_proj.weight    [0, I) <- gate_proj   [I, 2I) <- up_proj
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_INDEX_FILE = "model.safetensors.index.json"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A directory that is not a checkpoint we can load, with the reason."""


def is_checkpoint_dir(path: str | Path) -> bool:
    """True for a directory holding config.json and at least one safetensors file."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def load_checkpoint(
    path: str | Path, device: torch.device | str, dtype: torch.dtype
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Read config.json and the safetensors weights of an HF Llama/Mistral/Qwen2 directory.

    Raises CheckpointError (a ValueError) for a missing directory, an unsupported architecture or
    feature, missing or unexpected tensors, or a tensor of the wrong shape.
    """
    cfg = read_model_config(path)
    files = _weight_files(Path(path))
    with torch.device("meta"):  # no random init of weights that are overwritten next
        model = LlamaForCausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor
    model.rotary.reset_tables()
    with torch.no_grad():
        _load_weights(model, files)
    return cfg, model.eval()


def read_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig from an HF config.json; unsupported features raise CheckpointError."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{str(p)!r} has no config.json: not a Hugging Face checkpoint")
    hf = json.loads((p / "config.json").read_text())
    arch = (hf.get("architectures") or ["<none>"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    _check_features(hf, arch)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        name=p.resolve().name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_model_len=_max_model_len(hf),
        rope_theta=float(_rope(hf).get("rope_theta") or hf.get("rope_theta") or 10000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM",  # Qwen2 always has q/k/v biases (and no o_proj bias)
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
    )


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The HF config.json fields that describe `cfg` (Qwen2 when it has q/k/v biases, else Llama)."""
    arch = "Qwen2ForCausalLM" if cfg.attention_bias else "LlamaForCausalLM"
    return {
        "architectures": [arch],
        "model_type": "qwen2" if cfg.attention_bias else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_model_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our weights under HF names, fused matrices split back (the inverse of loading)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        parts = _fused_parts(name, model.config)
        if not parts:
            out[name] = tensor
        for hf_name, (start, end) in parts.items():
            out[hf_name] = tensor[start:end]
    return out


def _check_features(hf: dict, arch: str) -> None:
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise CheckpointError(f"activation {act!r} is not supported (only silu)")
    rope_type = _rope(hf).get("rope_type") or _rope(hf).get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"rope scaling {rope_type!r} is not supported (only default rotary embeddings)")
    if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise CheckpointError("Llama checkpoints with attention_bias or mlp_bias are not supported")


def _rope(hf: dict) -> dict:
    # transformers >= 5 writes `rope_parameters`; older configs have `rope_theta` and `rope_scaling`.
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _max_model_len(hf: dict) -> int:
    max_len = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window")
    sliding = hf.get("use_sliding_window", hf.get("model_type") == "mistral") or any(
        t != "full_attention" for t in hf.get("layer_types") or []
    )
    # We attend over the full context: cap the length where that equals sliding-window attention.
    return min(max_len, int(window)) if sliding and window else max_len


def _first_id(value: int | list[int] | None) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _weight_files(path: Path) -> list[Path]:
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{str(path)!r} has no *.safetensors weights (pytorch .bin files are not supported)"
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{str(path)!r} is missing weight shards {missing}")
    return files


def _fused_parts(our_name: str, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """For a fused parameter: HF name -> its row range in ours. Empty for a one-to-one parameter."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if ".qkv_proj." in our_name:
        prefix, suffix = our_name.split(".qkv_proj.")
        spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    elif ".gate_up_proj." in our_name:
        prefix, suffix = our_name.split(".gate_up_proj.")
        spans = {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
    else:
        return {}
    return {f"{prefix}.{part}.{suffix}": span for part, span in spans.items()}


def _checkpoint_targets(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of our parameter it fills."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        parts = _fused_parts(name, model.config)
        if not parts:
            targets[name] = param
        for hf_name, (start, end) in parts.items():
            targets[hf_name] = param[start:end]
    return targets


def _load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    targets = _checkpoint_targets(model)
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
                    continue
                if name not in targets:
                    raise CheckpointError(f"unexpected tensor {name!r} in {file.name}")
                tensor = f.get_tensor(name)
                if tensor.shape != targets[name].shape:
                    shape = tuple(targets[name].shape)
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
                    )
                targets[name].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
