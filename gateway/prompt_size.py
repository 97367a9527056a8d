"""The prompt-size check, run before any rendering: cheap counts over the request as parsed.

A 4 MB chat body rendered, canonicalized and tokenized only to learn that it does not fit stalled every
tenant for seconds. Two bounds are known without tokenizing:

- ``max_prompt_chars`` (config): characters of the messages' texts plus the tools' JSON, or of the
  completion prompt; more is 413 ``request_too_large``;
- the context window: every non-blank character belongs to some token and a token covers at most
  ``model.max_token_chars`` characters, so ``non-blank // max_token_chars`` is a lower bound of the
  prompt's tokens; above ``max_model_len`` it is 400 ``context_length_exceeded``. Blanks are left out
  because canonicalization may collapse runs of them.
"""

from __future__ import annotations

import orjson

from gateway.errors import ContextLengthExceeded, PayloadTooLarge
from gateway.model import ModelRuntime
from gateway.schemas import ChatRequest, CompletionRequest
from policies.chat_text import iter_texts

BLANKS = " \t\n\r"


def _num_solid(text: str) -> int:
    return len(text) - sum(text.count(blank) for blank in BLANKS)


def check_prompt_size(
    request: ChatRequest | CompletionRequest,
    model: ModelRuntime,
    *,
    max_prompt_chars: int,
    context_window: bool = True,
) -> None:
    """Raise ``PayloadTooLarge`` or ``ContextLengthExceeded`` for a prompt that cannot be served."""
    if isinstance(request, ChatRequest):
        texts = [text for _, _, text in iter_texts(request.messages)]
        num_chars = sum(map(len, texts)) + (len(orjson.dumps(request.tools)) if request.tools else 0)
        num_solid = sum(map(_num_solid, texts))
        param = "messages"
    elif isinstance(request.prompt, str):
        num_chars, num_solid, param = len(request.prompt), _num_solid(request.prompt), "prompt"
    else:
        return  # token ids: the context-window check after parsing is exact and cheap
    if max_prompt_chars and num_chars > max_prompt_chars:
        raise PayloadTooLarge(
            f"the prompt has {num_chars} characters; this gateway accepts at most {max_prompt_chars}",
            param=param,
        )
    min_tokens = num_solid // model.max_token_chars
    if context_window and min_tokens > model.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {model.max_model_len} tokens. However, your "
            f"prompt has {num_solid} non-blank characters, at least {min_tokens} tokens. "
            "Please reduce the length of the prompt.",
            param=param,
        )
