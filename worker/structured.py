"""Constrained decoding with llguidance: a request's grammar masks its logits, token by token.

A generate request may carry ``sampling.grammar``: ``{"type": "json_object"}``, ``{"type":
"json_schema", "schema": {...}}`` or ``{"type": "lark", "grammar": "..."}`` (the gateway builds the
last one for tool calls). ``GrammarCompiler`` turns it into a per-request ``LLMatcher``; before
sampling, ``mask_logits`` sets the logits of every token the grammar forbids to -inf; after sampling,
``advance`` feeds the token to the matcher, and a matcher that is stopped (the grammar is complete and
allows nothing more) ends the request with ``finish_reason: "stop"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import torch

from worker.tokenizer import TokenizerBundle

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_BYTES = 256 << 10


class GrammarError(ValueError):
    """A grammar (JSON schema, Lark) that cannot be compiled: a 400 naming ``grammar``."""


def grammar_text(spec: Mapping[str, Any]) -> str:
    """llguidance's grammar for a request's ``grammar`` object."""
    kind = spec.get("type")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("grammar.schema must be a JSON schema object")
        if len(json.dumps(schema)) > MAX_GRAMMAR_BYTES:
            raise GrammarError("grammar.schema is too large")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "lark":
        lark = spec.get("grammar")
        if not isinstance(lark, str) or len(lark) > MAX_GRAMMAR_BYTES:
            raise GrammarError("grammar.grammar must be a Lark grammar string")
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise GrammarError("grammar.type must be 'json_object', 'json_schema' or 'lark'")


class GrammarCompiler:
    """Builds matchers for one model's tokenizer (the llguidance tokenizer is made once, on first use)."""

    def __init__(self, tokenizer: TokenizerBundle, vocab_size: int) -> None:
        self._tokenizer_json = tokenizer.tokenizer_json
        self._eos_token_ids = list(tokenizer.eos_token_ids)
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos_token_ids or None
            )
        return self._ll_tokenizer

    def matcher(self, spec: Mapping[str, Any]) -> llguidance.LLMatcher:
        """A fresh matcher for one request; raises GrammarError for a grammar that does not compile."""
        grammar = grammar_text(spec)
        tokenizer = self._tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"invalid grammar: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return matcher


def mask_logits(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor:
    """Forbid, in place, the tokens each row's grammar does not allow next (rows without one: as is)."""
    for row, matcher in enumerate(matchers):
        if matcher is None or matcher.is_error():
            continue
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        width = min(allowed.numel(), logits.shape[-1])
        if not bool(allowed[:width].any()):
            # Nothing allowed (should not happen: a complete grammar stops the request): leave the row
            # as is rather than sample from all -inf; ``advance`` then ends the request, alone.
            continue
        forbidden = torch.ones(logits.shape[-1], dtype=torch.bool)
        forbidden[:width] = allowed[:width] == 0
        logits[row].masked_fill_(forbidden.to(logits.device), float("-inf"))
    return logits


def advance(matcher: llguidance.LLMatcher | None, token: int) -> bool:
    """Feed a sampled token; True when the grammar is complete (the request must stop)."""
    if matcher is None:
        return False
    matcher.consume_token(token)
    return matcher.is_stopped() or matcher.is_error()
