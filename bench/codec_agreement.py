"""fp8 / int4 greedy agreement on models that were not trained against the codecs.

The built-in model was fine-tuned to be fp8-tolerant (``docs/builtin-model.md``), so its agreement is a
best case. The same measure (``worker.tiers.accuracy.codec_accuracy``: teacher-forced greedy tokens after
a 512-token context restored through the codec) is also taken on:

- ``random-small``: the built-in model's shape with seeded random weights (never trained at all);
- ``hf-checkpoint``: the same random weights written as a Hugging Face checkpoint (bf16 safetensors,
  ``config.json``, tokenizer files) and loaded back through ``load_hf_dir``, the path real checkpoints
  take. No real pretrained checkpoint is available offline here (nothing may download weights), so
  this is the closest stand-in; pass ``--hf-dir`` to measure a real one.

    python -m bench.codec_agreement [--quick] [--hf-dir PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from worker.model.loader import LoadedModel, load_hf_dir, load_model, save_hf_dir
from worker.tiers.accuracy import codec_accuracy

CODECS = ("fp8", "int4")
CONTEXT_TEXT = (
    "You are a helpful assistant that answers questions about Python.\n"
    "Lists are mutable sequences, typically used to store collections of homogeneous items. "
    "Tuples are immutable sequences, typically used to store collections of heterogeneous data. "
    "Dictionaries map hashable keys to arbitrary objects and keep insertion order. "
) * 4


def agreement(loaded: LoadedModel, codec: str, *, quick: bool) -> tuple[float, float]:
    """Greedy agreement of ``codec`` against the exact cache (512-token context), and the largest logit
    error: a random model's flat logits can agree on every token while its logits move a lot."""
    context = loaded.tokenizer.encode(CONTEXT_TEXT, add_special_tokens=True)[:512]
    result = codec_accuracy(loaded.model, context, codec=codec, continuation_tokens=64 if quick else 256)
    return result.greedy_agreement, result.max_logit_error


def models(hf_dir: Path | None, scratch: Path) -> dict[str, LoadedModel]:
    """The models to measure, by label (the built-in one first)."""
    cpu, f32 = torch.device("cpu"), torch.float32
    out = {
        "builtin": load_model("builtin", dtype=f32, device=cpu),
        "random-small": load_model("random-small", dtype=f32, device=cpu),
    }
    if hf_dir is None:
        hf_dir = scratch / "hf-checkpoint"
        save_hf_dir(out["random-small"], hf_dir)
        out["hf-checkpoint"] = load_hf_dir(hf_dir, dtype=f32, device=cpu)
    else:
        out[f"hf:{hf_dir.name}"] = load_hf_dir(hf_dir, dtype=f32, device=cpu)
    return out


def measure(*, quick: bool, hf_dir: Path | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """``{model label: {codec: (greedy agreement, max logit error)}}``."""
    with tempfile.TemporaryDirectory(prefix="pg-codec-") as scratch:
        loaded = models(hf_dir, Path(scratch))
        return {
            label: {codec: agreement(m, codec, quick=quick) for codec in CODECS}
            for label, m in loaded.items()
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 continuation tokens instead of 256")
    parser.add_argument("--hf-dir", type=Path, help="a local Hugging Face checkpoint to measure too")
    args = parser.parse_args()
    results = measure(quick=args.quick, hf_dir=args.hf_dir)
    table = Table(title="greedy agreement with the exact cache (512-token context)")
    for column in ("model", *CODECS):
        table.add_column(column, justify="right")
    for label, by_codec in results.items():
        table.add_row(
            label, *(f"{by_codec[c][0]:.4f} (max logit error {by_codec[c][1]:.3f})" for c in CODECS)
        )
    Console().print(table)
    print(
        json.dumps(
            {
                "greedy_agreement": {
                    k: {c: round(v[0], 4) for c, v in d.items()} for k, d in results.items()
                },
                "max_logit_error": {k: {c: round(v[1], 4) for c, v in d.items()} for k, d in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
