"""Our decoder against transformers' reference forward pass on tiny random checkpoints (fp32, 1e-4)."""

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from worker.layers.attention import AttentionMetadata, PrefillSpan  # noqa: E402
from worker.model.loader import load_hf_dir  # noqa: E402
from worker.tokenizer import TokenizerBundle  # noqa: E402

TOL = 1e-4
BLOCK = 16


def _write_checkpoint(path: Path, family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "llama3-rope":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        cfg = transformers.LlamaConfig(**common, rope_scaling=rope)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():  # default init leaves biases and norms trivial; make every weight matter
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.eval().save_pretrained(path)
    TokenizerBundle.byte_level().save(path)
    return model


def _paged_logits(model, ids: torch.Tensor, split: int, num_decode: int) -> torch.Tensor:
    """Prefill [0, split) and [split, n - num_decode) as two chunks (the second attends to cached KV),
    then decode the remaining tokens one by one; returns logits for every position."""
    cfg = model.config
    n = len(ids)
    num_blocks = math.ceil(n / BLOCK) + 1
    kv = torch.zeros(num_blocks, cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    table = torch.arange(num_blocks - 1, -1, -1)[: math.ceil(n / BLOCK)]  # non-trivial block ids
    rows = []

    def run(start: int, end: int, decode: bool) -> None:
        pos = torch.arange(start, end)
        meta = AttentionMetadata(slot_blocks=table[pos // BLOCK], slot_offsets=pos % BLOCK)
        if decode:
            meta.num_decode = 1
            used = end // BLOCK + (1 if end % BLOCK else 0)
            meta.decode_block_tables = table[:used][None, :]
            meta.decode_mask = (torch.arange(used * BLOCK) < end)[None, None, None, :]
        else:
            meta.prefills = [
                PrefillSpan(
                    query_start=0,
                    query_len=end - start,
                    context_len=end,
                    block_table=table[: math.ceil(end / BLOCK)],
                )
            ]
        hidden = model(ids[start:end], pos, meta, kv)
        rows.append(model.logits(hidden))

    run(0, split, decode=False)
    run(split, n - num_decode, decode=False)
    for p in range(n - num_decode, n):
        run(p, p + 1, decode=True)
    return torch.cat(rows)


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "qwen2", "mistral"])
def test_logits_match_transformers(tmp_path, family):
    reference = _write_checkpoint(tmp_path, family)
    ours = load_hf_dir(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        dense = ours.model.forward_dense(ids[None])[0]
        paged = _paged_logits(ours.model, ids, split=21, num_decode=5)
    assert (dense - expected).abs().max().item() < TOL
    assert (paged - expected).abs().max().item() < TOL
    assert ours.config.attention_bias == (family == "qwen2")


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_hf_dir(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
