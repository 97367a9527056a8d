"""The model's tokenizer (Hugging Face ``tokenizers`` JSON), its chat template, and streaming detokenization.

The built-in model uses a byte-level tokenizer: token id = byte value for ids 0–255, then a few special
tokens. It is written as an ordinary ``tokenizer.json`` so the gateway tokenizes it exactly like any
Hugging Face model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|end|>", "<|start|>")
BYTE_VOCAB_SIZE = 264  # 256 bytes + 3 specials, padded to a multiple of 8
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start|>tools\n{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}<|start|>{{ message['role'] }}"
    "{{ (' ' ~ message['tool_call_id']) if message['tool_call_id'] else '' }}\n"
    "{{ message['content'] if message['content'] is not none else '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '\\n' if loop.index > 1 else '' }}"
    "<tool_call>\n{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] if call['function']['arguments'] is string"
    " else call['function']['arguments'] | tojson }}{{ '}' }}\n</tool_call>{% endfor %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer whose ids 0–255 are the byte values, plus the special tokens."""
    to_char = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    return tok


def byte_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json of the built-in byte-level tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|end|>",
        "add_bos_token": True,
        "chat_template": BYTE_CHAT_TEMPLATE,
        "model_max_length": 4096,
    }


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


@dataclass(frozen=True, kw_only=True)
class TokenizerBundle:
    """A tokenizer with what the gateway needs to render and tokenize prompts the worker's way."""

    tokenizer: Tokenizer
    tokenizer_json: str
    chat_template: str
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool

    @classmethod
    def from_dir(cls, path: Path, *, generation_eos_ids: list[int] | None = None) -> TokenizerBundle:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (chat template) from a model directory."""
        tokenizer_json = (path / "tokenizer.json").read_text()
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template") or ""
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        template_file = path / "chat_template.jinja"
        if not template and template_file.exists():
            template = template_file.read_text()
        tokenizer = Tokenizer.from_str(tokenizer_json)
        eos = _token_text(config.get("eos_token"))
        eos_ids = set(generation_eos_ids or [])
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            eos_ids.add(tokenizer.token_to_id(eos))
        return cls(
            tokenizer=tokenizer,
            tokenizer_json=tokenizer_json,
            chat_template=template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=eos,
            eos_token_ids=tuple(sorted(eos_ids)),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @classmethod
    def byte_level(cls) -> TokenizerBundle:
        """The built-in byte-level tokenizer."""
        tokenizer = build_byte_tokenizer()
        config = byte_tokenizer_config()
        return cls(
            tokenizer=tokenizer,
            tokenizer_json=tokenizer.to_str(),
            chat_template=config["chat_template"],
            bos_token=config["bos_token"],
            eos_token=config["eos_token"],
            eos_token_ids=(tokenizer.token_to_id(config["eos_token"]),),
            add_bos_token=True,
        )

    def save(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into a model directory."""
        (path / "tokenizer.json").write_text(self.tokenizer_json)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token:
            bos_id = self.tokenizer.token_to_id(self.bos_token)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids = [bos_id, *ids]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: TokenizerBundle) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this are fully emitted and stable
        self._read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the newly completed text (may be empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""
