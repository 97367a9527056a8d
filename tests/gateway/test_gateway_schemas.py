"""Whatever JSON a client sends, parsing ends in a request or in a 400, never in a crash."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "tools",
    "user",
    "prompt_cache_key",
    "n",
    "top_k",
    "logprobs",
    "presence_penalty",
    "ignore_eos",
    "echo",
    "suffix",
    "response_format",
    "tool_choice",
    "logit_bias",
    "top_logprobs",
    "frequency_penalty",
    "best_of",
    "store",
    "modalities",
    "service_tier",
    "metadata",
]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]), "content": json_values}
)


@settings(max_examples=150, deadline=None)
@given(bodies, st.lists(message, max_size=3))
def test_parse_never_crashes(body, messages):
    for candidate in (
        body,
        {**body, "model": "m", "messages": messages},
        {**body, "model": "m", "prompt": "p"},
    ):
        for parse, kind in ((parse_chat, ChatRequest), (parse_completion, CompletionRequest)):
            try:
                assert isinstance(parse(candidate), kind)
            except InvalidRequest as exc:
                assert exc.status == 400 and exc.message
