"""A served model as the gateway sees it: the worker's tokenizer and chat template, compiled once.

Built from the worker's ``GET /v1/info`` so that rendering, tokenizing and hashing match the worker
exactly. No torch here: the `tokenizers` library is Rust, Jinja renders the template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, Tokenizer

from gateway.tool_calls import template_tool_style


class TemplateError(ValueError):
    """The chat template refused the messages (e.g. ``raise_exception('roles must alternate')``)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson: no HTML escaping (unlike Jinja's built-in), non-ASCII kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers marks assistant spans): render the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def template_uses_tools(source: str) -> bool:
    """Whether a chat template renders ``tools`` at all (Hugging Face templates without tool support
    never read the variable: tools sent to them would be dropped silently)."""
    return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(source))


def template_renders_tool_calls(source: str) -> bool:
    """Whether a chat template reads a message's ``tool_calls`` (``message.tool_calls`` or
    ``message['tool_calls']``); one that does not would drop an assistant's earlier calls silently."""
    tree = _environment().parse(source)
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem)):
        key = node.attr if isinstance(node, jinja2.nodes.Getattr) else getattr(node.arg, "value", None)
        if key == "tool_calls":
            return True
    return False


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a Hugging Face chat template in a sandbox (templates come from model files)."""
    return _environment().from_string(source)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    """The fields of a worker's ``/v1/info`` that the gateway uses."""

    model_id: str
    model_fingerprint: str  # hex
    block_size: int
    max_model_len: int
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    prefill_tokens_per_s: float | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelInfo:
        return cls(
            model_id=str(data["model_id"]),
            model_fingerprint=str(data["model_fingerprint"]),
            block_size=int(data["block_size"]),
            max_model_len=int(data["max_model_len"]),
            tokenizer_json=data["tokenizer_json"],
            chat_template=data.get("chat_template"),
            bos_token=data.get("bos_token"),
            eos_token=data.get("eos_token"),
            add_bos_token=bool(data.get("add_bos_token", False)),
            prefill_tokens_per_s=data.get("prefill_tokens_per_s"),
        )


class ModelRuntime:
    """Renders and tokenizes prompts for one model exactly as its workers expect."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.model_id = info.model_id
        self.block_size = info.block_size
        self.max_model_len = info.max_model_len
        self.fingerprint = bytes.fromhex(info.model_fingerprint)
        self._tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self._template = compile_chat_template(info.chat_template) if info.chat_template else None
        self.supports_tools = bool(info.chat_template) and template_uses_tools(info.chat_template or "")
        self.renders_tool_calls = bool(info.chat_template) and template_renders_tool_calls(
            info.chat_template or ""
        )
        self.tool_style = template_tool_style(info.chat_template)  # how its answers call tools
        self.bos_token_id = self._tokenizer.token_to_id(info.bos_token) if info.bos_token else None
        # Texts the tokenizer turns into single added (control) tokens, longest first.
        self.added_token_texts: tuple[str, ...] = tuple(
            sorted(
                {t.content for t in self._tokenizer.get_added_tokens_decoder().values()},
                key=len,
                reverse=True,
            )
        )
        self._literal_tokenizer: Tokenizer | None = None  # built on first use
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """Most characters one token can cover (its vocabulary string's length, at least 1): a text
        of N non-blank characters has at least N // max_token_chars tokens, known without tokenizing."""
        if self._max_token_chars is None:
            vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            self._max_token_chars = max([1, *map(len, vocab)])
        return self._max_token_chars

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of a conversation, ending with the assistant's generation prompt unless
        ``add_generation_prompt`` is false (the prompt lint measures the conversation alone)."""
        if self._template is None:
            raise TemplateError(f"model {self.model_id!r} has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.info.bos_token or "",
                eos_token=self.info.eos_token or "",
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            # Also the template's own Python errors on odd values (tojson of an undefined: TypeError).
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt (its special tokens are already in the text)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_chat(self, text: str) -> Encoding:
        """The tokenizer's full answer for a rendered chat prompt: ``.ids`` as ``encode_chat``, and the
        character ``.offsets`` that hot-prefix promotion reads (only for tenants that opted in)."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode_literal(self, text: str) -> Encoding:
        """``text`` tokenized as plain text: special-token text becomes ordinary tokens, never control
        tokens (tenant message content; ``gateway.special_tokens``)."""
        if self._literal_tokenizer is None:
            self._literal_tokenizer = Tokenizer.from_str(self.info.tokenizer_json)
            self._literal_tokenizer.encode_special_tokens = True
        return self._literal_tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt, with the BOS token when the model wants one."""
        return self.with_bos(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def with_bos(self, token_ids: list[int]) -> list[int]:
        if self.info.add_bos_token and self.bos_token_id is not None and token_ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *token_ids]
        return token_ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
