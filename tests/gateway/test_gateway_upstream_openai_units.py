"""The openai upstream's pure parts: configuration (TOML, env, CLI), isolation fields per flavour,
rendezvous routing over an upstream's URLs, error mapping and the billing form of an upstream's usage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway import cli
from gateway.config import OpenAIUpstreamConfig, load_config
from gateway.errors import InvalidRequest, NotFoundError, Unavailable, UpstreamError
from gateway.upstream_openai import FLAVOURS, affinity_key, map_upstream_error, rendezvous_order
from gateway.upstream_serve import billing_usage

VLLM = {"name": "vllm", "urls": ["http://a:8000/v1/", "http://b:8000/v1"], "models": {"llama": "meta/llama"}}


def test_upstreams_from_toml_env_and_cli(tmp_path: Path):
    config_file = tmp_path / "prefixgate.toml"
    config_file.write_text(
        "[gateway]\nworker_urls = []\n"
        "[[gateway.openai_upstreams]]\n"
        'name = "vllm"\nurls = ["http://a:8000/v1/", "http://b:8000/v1"]\nflavour = "vllm"\n'
        'api_key_env = "VLLM_KEY"\n'
        '[gateway.openai_upstreams.models]\nllama = "meta/llama"\n'
    )
    config = load_config(config_file=config_file, env={"VLLM_KEY": "sk-secret"})
    (upstream,) = config.openai_upstreams
    assert config.worker_urls == ()
    assert upstream.urls == ("http://a:8000/v1", "http://b:8000/v1")
    assert upstream.models == (("llama", "meta/llama"),) and upstream.upstream_model("llama") == "meta/llama"
    assert upstream.flavour == "vllm" and upstream.api_key == "sk-secret"
    assert "sk-secret" not in repr(config) and "sk-secret" not in repr(upstream)

    env = {"PREFIXGATE_OPENAI_UPSTREAMS": json.dumps([{**VLLM, "flavour": "sglang", "api_key": "k"}])}
    (from_env,) = load_config(env=env).openai_upstreams
    assert from_env.flavour == "sglang" and from_env.api_key == "k" and from_env.urls[0] == "http://a:8000/v1"

    args = cli.build_parser().parse_args(
        [
            "gateway",
            "--openai-upstream",
            '{"url": "http://o/v1", "models": ["gpt-4o-mini"], "flavour": "openai"}',
        ]
    )
    (from_cli,) = load_config(env={}, overrides=cli._server_overrides(args)).openai_upstreams
    assert from_cli.models == (("gpt-4o-mini", "gpt-4o-mini"),) and from_cli.flavour == "openai"
    assert from_cli.name == "upstream-0" and from_cli.api_key is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**VLLM, "flavor": "vllm"}, "unknown openai_upstreams key"),
        ({**VLLM, "flavour": "tgi"}, "flavour must be one of"),
        ({"models": ["m"]}, "needs 'url'"),
        ({"url": "http://a/v1"}, "needs 'models'"),
        ([VLLM, {**VLLM, "name": "other"}], "more than one openai upstream: llama"),
    ],
)
def test_bad_upstream_config_is_an_error(raw, message):
    with pytest.raises(ValueError, match=message):
        load_config(env={"PREFIXGATE_OPENAI_UPSTREAMS": json.dumps(raw)})


def test_isolation_fields_per_flavour_are_per_tenant_and_never_the_clients():
    alpha, beta = b"\x01" * 32, b"\x02" * 32
    for flavour in ("vllm", "sglang"):
        salt = FLAVOURS[flavour]
        assert salt("up", alpha, None) == salt("up", alpha, "client-key")  # the client's key plays no part
        assert salt("up", alpha, None) != salt("up", beta, None)
        assert salt("up", alpha, None) != salt("other-upstream", alpha, None)  # unlinkable across upstreams
        assert alpha.hex() not in salt("up", alpha, None)["cache_salt"]  # the namespace key is not sent
    key = FLAVOURS["openai"]
    # The client's prompt_cache_key only splits its own tenant's namespace: the same key from two
    # tenants gives two different values, and no client key can produce another tenant's value.
    assert key("up", alpha, "k") != key("up", beta, "k")
    assert key("up", alpha, "k") != key("up", alpha, None) != key("up", beta, None)
    assert set(key("up", alpha, "k")) == {"prompt_cache_key"}
    assert FLAVOURS["none"]("up", alpha, "k") == {}


def test_rendezvous_is_stable_per_head_and_spreads_heads():
    urls = tuple(f"http://u{i}/v1" for i in range(4))
    namespace = b"\x07" * 32
    key = affinity_key(namespace, b'{"messages":[{"content":"system prompt"', None)
    assert rendezvous_order(key, urls) == rendezvous_order(key, tuple(reversed(urls)))
    assert rendezvous_order(key, urls)[0] == rendezvous_order(key, urls[:3] + urls[3:])[0]
    firsts = {
        rendezvous_order(affinity_key(namespace, f"head {i}".encode(), None), urls)[0] for i in range(40)
    }
    assert firsts == set(urls)
    # Another tenant with the same head gets its own key: heads are hashed inside the namespace.
    assert affinity_key(b"\x08" * 32, b"head", None) != affinity_key(namespace, b"head", None)


def test_upstream_errors_map_to_tenant_errors():
    body = json.dumps(
        {"error": {"message": "bad max_tokens", "code": "invalid_value", "param": "max_tokens"}}
    )
    error = map_upstream_error("up", 400, body.encode(), {})
    assert isinstance(error, InvalidRequest) and error.status == 400
    assert (error.message, error.code, error.param) == ("bad max_tokens", "invalid_value", "max_tokens")
    unprocessable = map_upstream_error("up", 422, b'{"detail": "Unexpected fields: top_k"}', {})
    assert unprocessable.status == 400 and "top_k" in unprocessable.message
    assert isinstance(map_upstream_error("up", 404, b"no such model", {}), NotFoundError)
    for status in (401, 403):
        auth = map_upstream_error("up", status, b"{}", {})
        assert isinstance(auth, UpstreamError) and auth.status == 502 and auth.code == "upstream_auth"
    busy = map_upstream_error("up", 429, b"{}", {"Retry-After": "7"})
    assert isinstance(busy, Unavailable) and busy.retry_after_s == 7
    assert map_upstream_error("up", 500, b"<html>oops</html>", {}).status == 502


def test_billing_usage_never_invents_counts():
    usage = {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 64}}
    assert billing_usage(usage) == {
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "cached_tokens": 64,
        "cached_tokens_reported": True,
    }
    unreported = billing_usage({"prompt_tokens": 100, "completion_tokens": 5})
    assert unreported["cached_tokens"] == 0 and unreported["cached_tokens_reported"] is False
    assert billing_usage(None) is None and billing_usage({}) is None
    assert billing_usage({"prompt_tokens": "100"}) is None
    assert billing_usage({"prompt_tokens": True}) is None  # a bool is not a count


def test_billing_usage_clamps_counts_that_cannot_be_true(caplog):
    more_cached = {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert billing_usage(more_cached)["cached_tokens"] == 10
    negative = {"prompt_tokens": -5, "completion_tokens": -1, "prompt_tokens_details": {"cached_tokens": -3}}
    assert billing_usage(negative) == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "cached_tokens_reported": True,
    }
    huge = {"prompt_tokens": 10**30, "completion_tokens": 10**30}
    billed = billing_usage(huge, max_completion_tokens=16)
    assert billed["prompt_tokens"] == 2**31 - 1 and billed["completion_tokens"] == 16  # n × max_tokens
    assert "upstream usage clamped" in caplog.text


def test_upstream_config_is_frozen_and_hides_its_key():
    upstream = OpenAIUpstreamConfig(name="u", urls=("http://u/v1",), models=(("m", "m"),), api_key="sk-x")
    assert "sk-x" not in repr(upstream)
    with pytest.raises(AttributeError):
        upstream.api_key = "other"  # type: ignore[misc]


def _relay(include_usage: bool, max_completion_tokens: int | None = None):
    from gateway.billing import TenantCall
    from gateway.schemas import parse_chat
    from gateway.upstream_serve import ForwardedRequest, _Relay
    from tenancy.policy import TenantPolicy

    call = TenantCall(
        tenant=TenantPolicy(tenant_id="tn_a", name="a"),
        endpoint="chat.completions",
        request_id="req_1",
        completion_id="chatcmpl-ours",
        usage_key="u1",
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    forwarded = ForwardedRequest(
        request=parse_chat(body),
        upstream=None,
        route=None,
        path="/chat/completions",
        body={},
        num_limit_tokens=1,
        num_prompt_estimate=7,
        max_completion_tokens=max_completion_tokens,
    )
    return call, _Relay(call, forwarded)


def test_a_stream_without_usage_is_recorded_as_unreported_and_billed_nothing():
    from gateway.billing import usage_event
    from tenancy.usage_types import ZERO_PRICES

    call, relay = _relay(include_usage=True)
    chunk = {
        "id": "theirs",
        "object": "chat.completion.chunk",
        "model": "x",
        "choices": [{"delta": {"content": "a"}}],
    }
    sent = json.loads(relay.chunk(chunk).removeprefix(b"data: "))
    assert (sent["id"], sent["model"], sent["usage"]) == ("chatcmpl-ours", "m", None)
    relay.sent()
    assert relay.finish() == b""  # no usage chunk made up
    event = usage_event(call, ZERO_PRICES)
    assert (event.outcome, event.prompt_tokens, event.completion_tokens) == ("usage_unreported", 0, 0)


def test_per_chunk_usage_bills_a_cut_stream_what_was_sent():
    from gateway.billing import usage_event
    from tenancy.usage_types import OUTCOME_CLIENT_CANCELLED, ZERO_PRICES

    call, relay = _relay(include_usage=False)
    for n in (1, 2, 3):  # vLLM's continuous_usage_stats: cumulative counts on every chunk
        usage = {"prompt_tokens": 50, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 32}}
        data = relay.chunk({"choices": [{"delta": {"content": "x"}}], "usage": usage})
        assert b'"usage"' not in data  # the client did not ask for usage
        relay.sent()
    call.outcome = OUTCOME_CLIENT_CANCELLED
    event = usage_event(call, ZERO_PRICES)
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (50, 32, 3)


def test_a_cut_stream_without_usage_is_billed_an_estimate_of_what_was_relayed():
    from gateway.billing import usage_event
    from tenancy.usage_types import OUTCOME_CANCELLED_ESTIMATED, ZERO_PRICES

    call, relay = _relay(include_usage=True)
    relay.chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]})  # no token in it
    relay.sent()
    for _ in range(3):
        relay.chunk({"choices": [{"delta": {"content": "x"}}, {"index": 1, "delta": {"content": "y"}}]})
        relay.sent()
    relay.chunk({"choices": [{"delta": {"content": "never written"}}]})  # the client left meanwhile
    relay.cut(lambda: 42)
    event = usage_event(call, ZERO_PRICES)
    assert (event.outcome, event.prompt_tokens, event.completion_tokens) == (
        OUTCOME_CANCELLED_ESTIMATED,
        42,
        6,
    )
    call, relay = _relay(include_usage=True)
    relay.cut(lambda: 42)  # nothing relayed: nothing billed
    assert call.outcome is None and usage_event(call, ZERO_PRICES).prompt_tokens == 0


def test_circuit_breaker_opens_cools_down_with_jitter_and_probes_one_at_a_time():
    from gateway.upstream_health import CLOSED, HALF_OPEN, OPEN, CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(
        ("a", "b"), failure_threshold=2, cooldown_s=10, jitter=0.5, probe_window_s=1,
        clock=lambda: now[0], rng=lambda: 1.0,
    )  # fmt: skip
    assert breaker.allow("a") and not breaker.failure("a", "refused") and breaker.state("a") == CLOSED
    breaker.success("a")  # consecutive failures only
    assert not breaker.failure("a", "refused") and breaker.failure("a", "timeout")
    assert breaker.state("a") == OPEN and not breaker.allow("a") and breaker.allow("b")
    now[0] = 14.9  # cool-down 10 × (1 + 0.5 × 1.0) = 15 s
    assert breaker.state("a") == OPEN
    now[0] = 15.0
    assert breaker.state("a") == HALF_OPEN
    assert breaker.allow("a") and not breaker.allow("a")  # one probe at a time
    now[0] = 16.0  # that probe never reported (cancelled): another one may go
    assert breaker.allow("a")
    assert breaker.failure("a", "refused") and breaker.state("a") == OPEN  # re-opened at once
    now[0] = 40.0
    assert breaker.allow("a")
    breaker.success("a")
    assert breaker.state("a") == CLOSED and breaker.healthy("a")
    assert breaker.snapshot()["a"] == {
        "state": CLOSED, "consecutive_failures": 0, "times_opened": 2, "last_error": "refused",
    }  # fmt: skip


def test_circuit_breaker_settings_parse(tmp_path: Path):
    raw = {**VLLM, "failure_threshold": 3, "probe_interval_s": 2.5, "down_s": 7}
    config = load_config(env={"PREFIXGATE_OPENAI_UPSTREAMS": json.dumps(raw)})
    (upstream,) = config.openai_upstreams
    assert (upstream.failure_threshold, upstream.probe_interval_s, upstream.down_s) == (3, 2.5, 7.0)
