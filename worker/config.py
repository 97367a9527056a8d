"""Worker configuration: command-line flags and ``PREFIXGATE_WORKER_*`` environment variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    model: str = "builtin"  # "builtin", "random-<preset>" or a Hugging Face model directory
    host: str = "127.0.0.1"
    port: int = 8100
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    threads: int = 0  # CPU threads for torch (0: PyTorch's default, one per core)
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20  # L1 budget; num_blocks overrides it
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per engine step: decode tokens + prefill chunk
    max_waiting_requests: int = 128  # requests waiting for blocks; beyond: 503 + Retry-After (0: no bound)
    max_waiting_tokens: int = 256 << 10  # their prompt tokens; beyond: 503 + Retry-After (0: no bound)
    max_wait_s: float = 2.0  # a request waiting this long is no longer overtaken by later ones
    watchdog_timeout_s: float = 10.0  # /healthz is 503 after this long without progress with work pending
    eviction_policy: str = "default"
    data_dir: Path | None = None  # holds the disk tier (data_dir/kv) unless l3_dir is given
    l2_bytes: int = 512 << 20  # host DRAM tier budget (0: off)
    prefetch_bytes: int = 512 << 20  # host memory for blocks prefetched (L3, Redis) for waiting requests
    l3_dir: Path | None = None  # disk tier directory (default: data_dir/kv; none without a data dir)
    l3_bytes: int = 4 << 30
    l3_codec: str = "none"  # none | fp8 | int4
    l3_min_free_bytes: int = 256 << 20  # the disk tier stops writing below this much free disk
    remote_url: str | None = None  # redis://… shared by workers (off when unset)
    remote_bytes: int = 1 << 30
    remote_ttl_s: int = 3600
    remote_timeout_ms: int = 250  # per Redis call; 50 ms tripped on a busy host (issue 9)
    remote_pause_s: float = 5.0  # the remote tier is skipped this long after an error or timeout
    remote_codec: str = "none"
    # A dedicated owner's reservation is released after this long without a request (0: never); its
    # Redis blocks unread that long have expired anyway (remote_ttl_s).
    reservation_idle_s: float = 3600.0
    kv_events_capacity: int = 1 << 17  # KV events kept for consumers to replay (worker.kv_events)
    flush_on_stop: bool = True  # write cached blocks to the disk tier on a clean shutdown
    shared_secret: str | None = field(default=None, repr=False)  # bearer the gateways send (worker.auth)
    at_rest_key: str | None = field(default=None, repr=False)  # AES-GCM for L3/Redis (tiers.at_rest)

    def disk_dir(self) -> Path | None:
        if self.l3_dir is not None:
            return self.l3_dir
        return self.data_dir / "kv" if self.data_dir is not None else None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported dtype {self.dtype!r}; use one of {sorted(_DTYPES)}") from None


class ContextDoesNotFit(ValueError):
    """The model's context window is longer than the KV cache can hold: the worker refuses to start."""


def context_that_fits(
    config: WorkerConfig, *, model_context_tokens: int, num_blocks: int, bytes_per_block: int
) -> int:
    """The context window served: ``max_model_len`` (default: the model's) when one whole request of
    that length fits the KV cache; otherwise ``ContextDoesNotFit`` naming what to set (as vLLM does,
    instead of silently serving a shorter context than the model's)."""
    wanted = min(config.max_model_len or model_context_tokens, model_context_tokens)
    capacity_tokens = (num_blocks - 1) * config.block_size  # one block is kept free for the scheduler
    if wanted <= capacity_tokens:
        return wanted
    needed_blocks = -(-wanted // config.block_size) + 1
    budget = (
        f"--num-blocks {num_blocks}" if config.num_blocks else f"--kv-cache-bytes {config.kv_cache_bytes}"
    )
    raise ContextDoesNotFit(
        f"the context window of {wanted} tokens "
        f"({'--max-model-len' if config.max_model_len else 'the model'}'s) does not fit the KV cache: "
        f"{budget} holds {capacity_tokens} tokens ({num_blocks} blocks of {config.block_size}). "
        f"Set --max-model-len {capacity_tokens} (PREFIXGATE_WORKER_MAX_MODEL_LEN) or less, or raise "
        f"--kv-cache-bytes to {needed_blocks * bytes_per_block} (PREFIXGATE_WORKER_KV_CACHE_BYTES) "
        f"or --num-blocks to {needed_blocks}."
    )


def _boolean(raw: str) -> bool:
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {raw!r}")


def _env_default(name: str, default: object) -> object:
    raw = os.environ.get(f"PREFIXGATE_WORKER_{name.upper()}")
    return default if raw is None else raw


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    defaults = WorkerConfig()
    parser = argparse.ArgumentParser(prog="prefixgate worker", description="prefixgate inference worker")
    for f in fields(WorkerConfig):
        default = getattr(defaults, f.name)
        kind = {"int": int, "int | None": int, "float": float, "Path | None": Path, "bool": _boolean}.get(
            str(f.type), str
        )
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=_env_default(f.name, default))
    args = parser.parse_args(argv)
    values = {}
    for f in fields(WorkerConfig):
        value = getattr(args, f.name)
        if isinstance(value, str) and str(f.type) in ("int", "int | None"):  # from the environment
            value = int(value)
        elif isinstance(value, str) and str(f.type) == "float":
            value = float(value)
        elif isinstance(value, str) and str(f.type) == "Path | None":
            value = Path(value)
        elif isinstance(value, str) and str(f.type) == "bool":
            value = _boolean(value)
        values[f.name] = value
    return WorkerConfig(**values)
