"""Load a model: the built-in one, a random preset, or a local Hugging Face directory.

Weights are read from ``*.safetensors`` with Hugging Face names and fused into our layout (q/k/v into one
projection, gate/up into one); ``save_hf_dir`` writes the reverse, so the built-in model is an ordinary
Hugging Face checkpoint that ``transformers`` can load too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker.model.config import ModelConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.presets import RANDOM_PRESETS
from worker.tokenizer import TokenizerBundle

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTIN_MODEL_ID = "prefixgate-tiny"


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: TokenizerBundle
    model_id: str
    weights_digest: bytes  # blake3 of the weights (file bytes for checkpoints, tensor bytes for presets)


def _hf_to_ours(name: str) -> tuple[str, str | None]:
    """Map a HF tensor name to (our parameter name, fused part or None)."""
    name = name.removeprefix("model.")
    for part in ("q_proj", "k_proj", "v_proj"):
        if f"self_attn.{part}." in name:
            return name.replace(part, "qkv_proj"), part
    for part in ("gate_proj", "up_proj"):
        if f"mlp.{part}." in name:
            return name.replace(part, "gate_up_proj"), part
    return name, None


def _load_state(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    offsets = {
        "q_proj": (0, q),
        "k_proj": (q, kv),
        "v_proj": (q + kv, kv),
        "gate_proj": (0, inter),
        "up_proj": (inter, inter),
    }
    seen: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in tensors:
            if "rotary_emb" in hf_name:
                continue
            name, part = _hf_to_ours(hf_name)
            if name not in params:
                raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
            target = params[name]
            if part is None:
                target.copy_(tensor)
            else:
                start, size = offsets[part]
                target[start : start + size].copy_(tensor)
            seen.add(hf_name)
    if cfg.tie_word_embeddings:
        seen.add("lm_head.weight")
    missing = {n for n in params if not any(_hf_to_ours(s)[0] == n for s in seen)}
    if missing:
        raise ValueError(f"checkpoint is missing tensors for {sorted(missing)}")


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, handle.get_tensor(key)


def _digest_files(files: list[Path]) -> bytes:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for file in files:
        hasher.update(file.name.encode())
        hasher.update_mmap(str(file))
    return hasher.digest()


def load_hf_dir(
    path: Path, *, dtype: torch.dtype, device: torch.device, model_id: str | None = None
) -> LoadedModel:
    """Load a local Llama / Qwen2 / Mistral checkpoint directory."""
    raw = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    generation_path = path / "generation_config.json"
    eos_ids: list[int] = []
    for source in (raw, json.loads(generation_path.read_text()) if generation_path.exists() else {}):
        eos = source.get("eos_token_id")
        eos_ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    tokenizer = TokenizerBundle.from_dir(path, generation_eos_ids=eos_ids)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    model.rotary.reset()
    _load_state(model, _iter_safetensors(path))
    model = model.to(device=device, dtype=dtype).eval()
    files = [*sorted(path.glob("*.safetensors")), path / "config.json"]
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        model_id=model_id or path.name,
        weights_digest=_digest_files(files),
    )


def random_model(preset: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    """A model with seeded random weights and the byte-level tokenizer (tests and benchmarks)."""
    try:
        cfg = RANDOM_PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown random preset {preset!r}; known: {sorted(RANDOM_PRESETS)}") from None
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    hasher = blake3.blake3(f"random:{preset}:{seed}".encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    hasher.update(json.dumps(cfg.to_hf(), sort_keys=True).encode())
    return LoadedModel(
        model=model.to(device=device, dtype=dtype).eval(),
        config=cfg,
        tokenizer=TokenizerBundle.byte_level(),
        model_id=f"random-{preset}",
        weights_digest=hasher.digest(),
    )


def load_model(spec: str, *, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """``builtin``, ``random-<preset>`` or a path to a Hugging Face directory."""
    if spec == "builtin":
        return load_hf_dir(BUILTIN_DIR, dtype=dtype, device=device, model_id=BUILTIN_MODEL_ID)
    if spec.startswith("random-"):
        return random_model(spec.removeprefix("random-"), dtype=dtype, device=device)
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{spec!r} is neither 'builtin', 'random-<preset>' nor a model directory")
    return load_hf_dir(path, dtype=dtype, device=device)


def hf_state_dict(model: LlamaForCausalLM) -> Mapping[str, torch.Tensor]:
    """Our parameters under Hugging Face names, fused projections split back."""
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        full = name if name == "lm_head.weight" else f"model.{name}"
        if "qkv_proj" in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                out[full.replace("qkv_proj", part)] = chunk.contiguous()
        elif "gate_up_proj" in name:
            for part, chunk in zip(("gate_proj", "up_proj"), tensor.split([inter, inter]), strict=True):
                out[full.replace("gate_up_proj", part)] = chunk.contiguous()
        else:
            out[full] = tensor.contiguous()
    return out


def save_hf_dir(loaded: LoadedModel, path: Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json, model.safetensors and the tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    config = loaded.config.to_hf()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["bos_token_id"] = loaded.tokenizer.tokenizer.token_to_id(loaded.tokenizer.bos_token or "")
    config["eos_token_id"] = list(loaded.tokenizer.eos_token_ids)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().to("cpu", dtype) for k, v in hf_state_dict(loaded.model).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    loaded.tokenizer.save(path)
