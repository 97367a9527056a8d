"""``python -m worker.export_hf OUT [--model builtin]``: write a model as a Hugging Face checkpoint.

The directory holds what ``AutoModelForCausalLM`` and ``AutoTokenizer`` read offline: ``config.json``
(``LlamaForCausalLM``), ``generation_config.json`` (greedy by default, our EOS ids), ``model.safetensors``
and the tokenizer files with the chat template. Third-party servers (``transformers serve``) then serve the
same weights, tokenizer and template as our worker, so their greedy outputs can be compared token for token
(tests/worker/test_export_hf.py). Nothing is downloaded; the weights come from the package.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from worker.model.loader import load_model, save_hf_dir


def export_hf(out: Path, *, model: str = "builtin", dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model`` (``builtin``, ``random-<preset>`` or a checkpoint directory) to ``out``; returns it.

    The weights are stored in ``dtype``; the built-in model is trained and shipped in bf16, so the default
    export is bit-identical to ``worker/builtin/model.safetensors``.
    """
    loaded = load_model(model, dtype=torch.float32, device=torch.device("cpu"))
    save_hf_dir(loaded, out, dtype=dtype)
    bos = loaded.tokenizer.tokenizer.token_to_id(loaded.tokenizer.bos_token or "")
    generation = {
        "bos_token_id": bos,
        "eos_token_id": sorted(loaded.tokenizer.eos_token_ids),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker.export_hf", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--model", default="builtin", help="builtin, random-<preset> or a checkpoint dir")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    out = export_hf(args.out, model=args.model, dtype=getattr(torch, args.dtype))
    print(out)


if __name__ == "__main__":
    main()
