"""Stop strings cut the output where the EARLIEST one begins, whatever their order in the ``stop`` list.

A real BPE tokenizer (trained here, a few hundred tokens) makes multi-character tokens, so one token
can complete two stop strings at once (review r3, D1)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.output import append_token, take_text_delta
from worker.sequence import SamplingParams, Sequence, Timings
from worker.tokenizer import IncrementalDetokenizer, TokenizerBundle


@pytest.fixture(scope="module")
def bpe_bundle() -> TokenizerBundle:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tokenizer.train_from_iterator(["Hello world, the weather is fine. " * 50], trainer=trainer)
    return TokenizerBundle(
        tokenizer=tokenizer,
        tokenizer_json=tokenizer.to_str(),
        chat_template="",
        bos_token=None,
        eos_token="<eos>",
        eos_token_ids=(tokenizer.token_to_id("<eos>"),),
        add_bos_token=False,
    )


def generate(bundle: TokenizerBundle, text: str, stop: tuple[str, ...]) -> tuple[list[str], str | None]:
    """Feed ``text``'s tokens as if sampled; return the streamed deltas and the finish reason."""
    seq = Sequence(
        request_id="r",
        prompt_token_ids=[1],
        sampling=SamplingParams(max_tokens=64, stop=stop),
        segments=(),
        use_cache=False,
        detokenizer=IncrementalDetokenizer(bundle),
        timings=Timings(arrival_s=0.0),
    )
    deltas, reason = [], None
    for token in bundle.encode(text):
        reason = append_token(seq, token, eos_token_ids=bundle.eos_token_ids, max_model_len=4096)
        deltas.append(take_text_delta(seq, finished=reason is not None))
        if reason:
            break
    return deltas, reason


def test_the_tokenizer_has_multi_character_tokens(bpe_bundle):
    pieces = [bpe_bundle.tokenizer.decode([i]) for i in bpe_bundle.encode("Hello world")]
    assert "Hello" in pieces, pieces  # "llo" and "e" both complete inside this one token


@pytest.mark.parametrize("stop", [("llo", "e"), ("e", "llo")])
def test_the_earliest_stop_cuts_whatever_its_place_in_the_list(bpe_bundle, stop):
    deltas, reason = generate(bpe_bundle, "Hello world", stop=stop)
    assert reason == "stop"
    assert "".join(deltas) == "H"


@pytest.mark.parametrize("stop", [("lo w", "llo"), ("llo", "lo w")])
def test_a_stop_found_later_still_loses_to_an_earlier_one(bpe_bundle, stop):
    # "llo" completes in the first token; "lo w" would begin later: the cut is at "llo".
    deltas, reason = generate(bpe_bundle, "Hello world", stop=stop)
    assert reason == "stop" and "".join(deltas) == "He"


@pytest.mark.parametrize("stop", [("wor", "wo"), ("wo", "wor")])
def test_stops_beginning_at_the_same_place_cut_there(bpe_bundle, stop):
    deltas, reason = generate(bpe_bundle, "Hello world", stop=stop)
    assert reason == "stop" and "".join(deltas) == "Hello "


def test_streaming_never_sends_the_start_of_a_stop_string(bpe_bundle):
    # ", the" spans tokens: the hold-back keeps ", th" until the stop completes, so no delta leaks it.
    deltas, reason = generate(bpe_bundle, "Hello world, the weather", stop=("zzzz", ", the"))
    assert reason == "stop" and "".join(deltas) == "Hello world"
    assert all("," not in d for d in deltas), deltas
