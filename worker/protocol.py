"""Parsing and validation of the worker API's request bodies (docs/worker-api.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.hashing import NamespaceKey, NamespaceSegment, validate_segments
from worker.sequence import SamplingParams

MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
MAX_NAMESPACE_ID_CHARS = 128
# A namespace id names a directory of the disk tier and sits inside Redis keys and their purge pattern:
# no path separators or dot names, no glob characters, no ':' (the key separator), bounded length.
_NAMESPACE_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAMESPACE_ID_CHARS - 1}}}")


class BadRequest(ValueError):
    """Malformed or invalid input: HTTP 400 with an OpenAI-style error."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    segments: list[NamespaceSegment]
    sampling: SamplingParams
    stream: bool
    use_cache: bool
    x_request_id: str = ""  # the gateway's client-facing request id, for log lines
    owner: str = ""  # the gateway's tag of the tenant (prefetch lane and budget share); "": the namespace


def _require(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise BadRequest(f"missing required field {name!r}", param=name)
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadRequest(
            f"field {name!r} must be of type {' or '.join(k.__name__ for k in kinds)}", param=name
        )
    return value


def _optional(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    if body.get(name) is None:
        return default
    return _require(body, name, kind)


def _float(raw: Mapping[str, Any], name: str, default: float) -> float:
    """An optional JSON number as a float; an integer too large for one (10**400) is a BadRequest."""
    try:
        return float(_optional(raw, name, (int, float), default))
    except OverflowError:
        raise BadRequest(f"{name} is out of range", param=name) from None


def parse_namespace_id(value: Any, param: str = "namespace_id") -> str:
    """A namespace id as sent by the gateway (``global``, ``promoted``, ``t-<hex>``), or a BadRequest."""
    if not isinstance(value, str) or _NAMESPACE_ID.fullmatch(value) is None:
        raise BadRequest(
            f"{param!r} must be 1 to {MAX_NAMESPACE_ID_CHARS} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            param=param,
        )
    return value


def parse_segments(raw: Any, block_size: int) -> list[NamespaceSegment]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'namespace' must be a non-empty list of segments", param="namespace")
    segments = []
    for item in raw:
        if not isinstance(item, dict):
            raise BadRequest("each namespace segment must be an object", param="namespace")
        key_hex = _require(item, "key", str)
        try:
            key = bytes.fromhex(key_hex)
        except ValueError:
            raise BadRequest("namespace key must be hex", param="namespace") from None
        if len(key) < 16:
            raise BadRequest("namespace key must be at least 16 bytes", param="namespace")
        segments.append(
            NamespaceSegment(
                start_token=_require(item, "start_token", int),
                namespace_id=parse_namespace_id(_require(item, "namespace_id", str)),
                key=NamespaceKey(key),
                reserved_blocks=max(0, _optional(item, "reserved_blocks", int, 0)),
            )
        )
    try:
        validate_segments(segments, block_size)
    except ValueError as exc:
        raise BadRequest(str(exc), param="namespace") from None
    return segments


def parse_sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest("'sampling' must be an object", param="sampling")
    temperature = _float(raw, "temperature", 1.0)
    top_p = _float(raw, "top_p", 1.0)
    # NaN and infinities (Python's json accepts them) fail these range checks too.
    if not 0.0 <= temperature <= 100.0:
        raise BadRequest("temperature must be in [0, 100]", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest("top_p must be in (0, 1]", param="top_p")
    stop = _optional(raw, "stop", (list, str), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of non-empty strings", param="stop")
    stop_ids = _optional(raw, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers", param="stop_token_ids")
    seed = _optional(raw, "seed", int, None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise BadRequest(f"seed must be in [{SEED_MIN}, {SEED_MAX}]", param="seed")
    top_k = _optional(raw, "top_k", int, 0)
    if top_k < 0:
        raise BadRequest("top_k must be 0 (off) or positive", param="top_k")
    max_tokens = _optional(raw, "max_tokens", int, 16)
    if max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    logprobs = _optional(raw, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(_optional(raw, "ignore_eos", bool, False)),
        presence_penalty=_penalty(raw, "presence_penalty"),
        frequency_penalty=_penalty(raw, "frequency_penalty"),
        logit_bias=_logit_bias(raw),
        logprobs=logprobs,
        grammar=_optional(raw, "grammar", dict, None),
    )


def _penalty(raw: Mapping[str, Any], name: str) -> float:
    value = _float(raw, name, 0.0)
    if not -2.0 <= value <= 2.0:
        raise BadRequest(f"{name} must be in [-2, 2]", param=name)
    return value


def _logit_bias(raw: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` as sorted (id, bias) pairs; ids are checked against the vocabulary later."""
    bias = _optional(raw, "logit_bias", dict, {})
    pairs = []
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() also takes "²" and "①", which int() refuses.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise BadRequest("logit_bias keys must be token ids", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise BadRequest("logit_bias values must be numbers in [-100, 100]", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def parse_generate(body: Any, block_size: int) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompt = _require(body, "prompt_token_ids", list)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadRequest("prompt_token_ids must be a list of integers", param="prompt_token_ids")
    request_id = _require(body, "request_id", str)
    if not request_id or len(request_id) > 256:
        raise BadRequest("request_id must be 1 to 256 characters", param="request_id")
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        segments=parse_segments(body.get("namespace"), block_size),
        sampling=parse_sampling(body.get("sampling")),
        stream=bool(_optional(body, "stream", bool, False)),
        use_cache=bool(_optional(body, "cache", bool, True)),
        x_request_id=str(_optional(body, "x_request_id", str, ""))[:128],
        owner="" if body.get("owner") is None else parse_namespace_id(body["owner"], "owner"),
    )
