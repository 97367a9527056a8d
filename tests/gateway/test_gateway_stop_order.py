"""End to end (real OpenAI SDK, real worker): the stop that occurs first cuts the output whatever its
place in the ``stop`` list (review r3, D1). On the bundled byte-level model a multi-character delta
appears where an invalid UTF-8 byte is followed by a character (the detokenizer releases "\\ufffdK" at
once); the test finds such a delta in a greedy answer and lists its two parts as stops, the later first."""

from __future__ import annotations

import pytest

PROMPT = [{"role": "user", "content": "Tell me a long story about the sea and the ships."}]
ARGS = dict(model="random-tiny", messages=PROMPT, max_tokens=48, temperature=0, seed=1)


async def deltas_of(sdk, **extra) -> list[str]:
    chunks = await sdk.chat.completions.create(**ARGS, stream=True, **extra)
    return [c.choices[0].delta.content or "" async for c in chunks if c.choices]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_listed_second_but_occurring_first_cuts_the_output(sdk, stream):
    deltas = [d for d in await deltas_of(sdk) if d]
    text = "".join(deltas)
    offset, pick = 0, None
    for delta in deltas:
        if len(delta) >= 2 and text.find(delta[0]) == offset and text.find(delta[1:]) == offset + 1:
            pick = (text[:offset], delta[0], delta[1:])
            break
        offset += len(delta)
    assert pick is not None, f"the greedy answer has no multi-character delta any more: {deltas!r}"
    expected, first, rest = pick
    stops = [rest, first]  # ``rest`` is listed first but begins one character after ``first``
    if stream:
        got = "".join(await deltas_of(sdk, stop=stops))
    else:
        got = (await sdk.chat.completions.create(**ARGS, stop=stops)).choices[0].message.content
    assert first not in got, f"stop {first!r} is in the output {got!r} (stops {stops!r})"
    assert got == expected
