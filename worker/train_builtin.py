"""Train the built-in demo model: a ~5M-parameter byte-level Llama that answers questions about Python.

The corpus exists on every machine that has Python: the reference topics that ship with CPython
(``pydoc_data.topics``) and the docstrings of standard-library modules. Each becomes a chat (a question
about the topic and the documentation as the answer) rendered with the built-in chat template, plus the
plain text. Nothing is downloaded.

    python -m worker.train_builtin --minutes 45 --out worker/builtin

The final loss and the command are recorded in docs/builtin-model.md.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from jinja2.sandbox import ImmutableSandboxedEnvironment
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from worker.model.loader import (
    BUILTIN_DIR,
    BUILTIN_MODEL_ID,
    LoadedModel,
    load_hf_dir,
    random_model,
    save_hf_dir,
)
from worker.tokenizer import BYTE_CHAT_TEMPLATE, TokenizerBundle

SYSTEM_PROMPT = "You are a helpful assistant that answers questions about Python."
QUESTIONS = (
    "What is {name}?",
    "Tell me about {name}.",
    "Explain {name} in Python.",
    "How does {name} work?",
    "What does {name} do?",
)
STDLIB_MODULES = (
    "builtins",
    "os",
    "os.path",
    "sys",
    "re",
    "json",
    "math",
    "random",
    "string",
    "collections",
    "itertools",
    "functools",
    "pathlib",
    "datetime",
    "time",
    "shutil",
    "subprocess",
    "typing",
    "dataclasses",
    "enum",
    "io",
    "csv",
    "textwrap",
    "heapq",
    "bisect",
    "statistics",
    "fractions",
    "decimal",
    "operator",
    "contextlib",
    "abc",
    "copy",
    "pprint",
    "argparse",
    "logging",
    "threading",
    "queue",
    "socket",
    "struct",
    "hashlib",
    "base64",
    "zlib",
    "gzip",
    "tempfile",
    "glob",
    "fnmatch",
    "difflib",
    "unittest",
    "inspect",
)


HELD_OUT_MODULES = (  # never in the training corpus: an honest test of what the model learned
    "email",
    "http.client",
    "sqlite3",
    "asyncio",
    "urllib.parse",
    "xml.etree.ElementTree",
    "zipfile",
    "tarfile",
    "configparser",
    "secrets",
)


def _first_paragraphs(text: str, limit: int) -> str:
    """Leading paragraphs of ``text`` up to about ``limit`` characters, cut on a paragraph boundary."""
    out = []
    total = 0
    for para in text.strip().split("\n\n"):
        para = para.strip()
        if not para:
            continue
        if out and total + len(para) > limit:
            break
        out.append(para)
        total += len(para) + 2
    return "\n\n".join(out)[: limit * 2]


def _documents() -> list[tuple[str, str]]:
    """(name, documentation) pairs from CPython's topics and standard-library docstrings."""
    import pydoc_data.topics

    docs = [
        (f"the {name} statement" if name.isalpha() and name.islower() else name, text)
        for name, text in pydoc_data.topics.topics.items()
    ]
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        if module.__doc__:
            docs.append((f"the {module_name} module", module.__doc__))
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (
                inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
            ):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                prefix = "" if module_name == "builtins" else f"{module_name}."
                docs.append((f"{prefix}{attr}", doc))
    return docs


def build_corpus(seed: int) -> bytes:
    """The training text: chats rendered with the built-in template, and the plain documentation."""
    rng = random.Random(seed)
    template = ImmutableSandboxedEnvironment().from_string(BYTE_CHAT_TEMPLATE)
    pieces = []
    for name, text in _documents():
        answer = _first_paragraphs(text, 700)
        for _ in range(2):
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": rng.choice(QUESTIONS).format(name=name)},
                {"role": "assistant", "content": answer},
            ]
            pieces.append(
                template.render(messages=messages, bos_token="<|bos|>", add_generation_prompt=False)
            )
        pieces.append("<|bos|>" + text.strip() + "\n")
    rng.shuffle(pieces)
    return "".join(pieces).encode()


def held_out_text() -> str:
    """Docstrings of standard-library modules the corpus does not include."""
    texts = []
    for module_name in HELD_OUT_MODULES:
        module = importlib.import_module(module_name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                texts.append(doc)
    return "\n\n".join(texts)


@torch.inference_mode()
def held_out_loss(loaded: LoadedModel, seq_len: int, max_windows: int = 24) -> float:
    """Mean next-byte loss (nats) on ``held_out_text`` in windows of ``seq_len`` bytes."""
    ids = torch.tensor(loaded.tokenizer.encode(held_out_text()), dtype=torch.long)
    windows = min(max_windows, (len(ids) - 1) // seq_len)
    losses = []
    for i in range(windows):
        chunk = ids[i * seq_len : (i + 1) * seq_len + 1]
        logits = loaded.model.forward_dense(chunk[None, :-1])[0]
        losses.append(F.cross_entropy(logits, chunk[1:]).item())
    return sum(losses) / len(losses)


def fp8_kv_noise(x: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """The fp8 disk/Redis codec's round trip on [B, T, heads, dim] keys or values, straight-through.

    Scales are per block of ``block_size`` positions and per head, exactly as ``worker.tiers.codec``
    stores them, so the model learns to tolerate what a lossy tier gives back.
    """
    batch, length, heads, dim = x.shape
    usable = length - length % block_size
    blocks = x[:, :usable].reshape(batch, usable // block_size, block_size, heads, dim)
    scale = (blocks.detach().abs().amax(dim=(2, 4), keepdim=True) / 448.0).clamp(min=1e-12)
    rounded = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    noisy = blocks + (rounded - blocks).detach()
    return torch.cat([noisy.reshape(batch, usable, heads, dim), x[:, usable:]], dim=1)


def _encode(tokenizer: TokenizerBundle, corpus: bytes) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(corpus.decode(), add_special_tokens=False), dtype=torch.long)


def train(
    *, minutes: float, seq_len: int, batch: int, lr: float, seed: int, init: Path | None, kv_noise: float
) -> tuple[LoadedModel, dict]:
    torch.manual_seed(seed)
    if init is not None:  # continue from a checkpoint (fine-tuning)
        loaded = load_hf_dir(init, dtype=torch.float32, device=torch.device("cpu"), model_id=BUILTIN_MODEL_ID)
    else:
        loaded = random_model("small", dtype=torch.float32, device=torch.device("cpu"), seed=seed)
    model = loaded.model.train()
    data = _encode(loaded.tokenizer, build_corpus(seed))
    split = int(len(data) * 0.98)
    train_ids, val_ids = data[:split], data[split:]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = minutes * 60
    warmup_s = min(60.0, budget_s * 0.05)
    gen = torch.Generator().manual_seed(seed)

    def batch_from(ids: torch.Tensor) -> torch.Tensor:
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
        return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])

    def loss_on(rows: torch.Tensor, *, noisy: bool = False) -> torch.Tensor:
        logits = model.forward_dense(rows[:, :-1], fp8_kv_noise if noisy else None)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))

    start = time.monotonic()
    step, tokens, ema = 0, 0, None
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as progress:
        task = progress.add_task("train", total=budget_s, info="")
        while (elapsed := time.monotonic() - start) < budget_s:
            frac = elapsed / budget_s
            scale = min(1.0, elapsed / warmup_s) * 0.5 * (1 + math.cos(math.pi * frac))
            for group in opt.param_groups:
                group["lr"] = lr * max(scale, 0.02)
            # A share of the batches see the fp8 cache tier's rounding of keys and values.
            loss = loss_on(batch_from(train_ids), noisy=bool(torch.rand((), generator=gen) < kv_noise))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens += batch * seq_len
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            progress.update(task, completed=elapsed, info=f"step {step} loss {ema:.3f} nats/byte")
    model.eval()
    with torch.no_grad():
        val = torch.stack([loss_on(batch_from(val_ids)) for _ in range(20)]).mean().item()
    stats = {
        "steps": step,
        "tokens": tokens,
        "train_loss_ema": round(ema or 0.0, 4),
        "val_loss": round(val, 4),
        "corpus_bytes": len(data),
        "params": loaded.config.num_params(),
        "minutes": minutes,
        "seq_len": seq_len,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "init": str(init) if init else None,
        "kv_noise": kv_noise,
    }
    return loaded, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=45.0, help="wall-clock training budget")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=BUILTIN_DIR)
    parser.add_argument("--init", type=Path, default=None, help="start from this checkpoint (fine-tune)")
    parser.add_argument("--kv-noise", type=float, default=0.0, help="share of batches with fp8 KV rounding")
    parser.add_argument(
        "--evaluate", type=Path, default=None, help="only report this model's held-out losses"
    )
    args = parser.parse_args()
    if args.evaluate is not None:
        model = load_hf_dir(args.evaluate, dtype=torch.float32, device=torch.device("cpu"))
        print(json.dumps({f"held_out_loss_{n}": round(held_out_loss(model, n), 4) for n in (512, 1536)}))
        return
    loaded, stats = train(
        minutes=args.minutes,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        init=args.init,
        kv_noise=args.kv_noise,
    )
    named = LoadedModel(
        model=loaded.model,
        config=loaded.config,
        tokenizer=loaded.tokenizer,
        model_id=BUILTIN_MODEL_ID,
        weights_digest=loaded.weights_digest,
    )
    save_hf_dir(named, args.out, dtype=torch.bfloat16)
    saved = load_hf_dir(args.out, dtype=torch.float32, device=torch.device("cpu"))
    stats |= {f"held_out_loss_{n}": round(held_out_loss(saved, n), 4) for n in (512, 1536)}
    (args.out / "training.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
