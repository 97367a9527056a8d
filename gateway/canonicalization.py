"""Canonicalization in the gateway: the tenant's policy applied before rendering, and the prompt lint.

The decisions live in ``policies.canonicalize`` and ``policies.prompt_lint`` (pure code); this module
compiles each tenant's policy once, converts between ``ChatRequest`` and the plain request those
functions take, and injects the model's chat template and tokenizer into the lint.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from gateway.errors import InvalidRequest
from gateway.model import ModelRuntime, TemplateError
from gateway.pipeline import PromptEdit
from gateway.schemas import ChatRequest
from policies.canonicalize import MODES, CanonicalizationPolicy, canonicalize_request
from policies.prompt_lint import lint_prompt
from tenancy.policy import TenantPolicy, canonicalization_policy

log = logging.getLogger(__name__)

MAX_CACHED_POLICIES = 4096  # distinct tenant settings kept compiled; the cache starts over past it


def _plain(request: ChatRequest) -> dict[str, Any]:
    """The fields canonicalization reads, as an OpenAI-style request (lists, shared, not copied)."""
    return {"messages": list(request.messages), "tools": list(request.tools) if request.tools else None}


class CanonicalizationStep:
    """``PromptStep``: the tenant's mode (``off``, ``report``, ``on``) applied to a chat request.

    Compiled policies are cached by the tenant's settings (most tenants share the default one), so a
    request never compiles a pattern; a tenant's PATCH gives new settings and so a new entry.
    """

    def __init__(self) -> None:
        self._policies: dict[tuple[Any, ...], CanonicalizationPolicy] = {}

    def policy(self, tenant: TenantPolicy) -> CanonicalizationPolicy:
        key = (
            tenant.canonicalization,
            tenant.canonicalization_patterns,
            tenant.canonicalization_disabled_rules,
            tenant.canonicalization_note_role,
        )
        policy = self._policies.get(key)
        if policy is None:
            try:
                policy = canonicalization_policy(tenant)
            except ValueError as exc:
                # Validated when stored; only a later change of the built-in rules can get here.
                log.warning("tenant %s: canonicalization settings ignored: %s", tenant.tenant_id, exc)
                policy = CanonicalizationPolicy(mode=tenant.canonicalization)
            if len(self._policies) >= MAX_CACHED_POLICIES:
                self._policies.clear()
            self._policies[key] = policy
        return policy

    def apply(self, tenant: TenantPolicy, request: ChatRequest) -> PromptEdit:
        policy = self.policy(tenant)
        mode = MODES[policy.mode]
        if not mode.scans:
            return PromptEdit(request=request)
        canonical = canonicalize_request(_plain(request), policy)
        report = canonical.report
        if not mode.rewrites:
            return PromptEdit(request=request, num_reported=len(report.fragments))
        tools = canonical.request.get("tools")
        request = replace(
            request, messages=tuple(canonical.request["messages"]), tools=tuple(tools) if tools else None
        )
        return PromptEdit(request=request, num_moved=report.num_moved)

    def lint(self, tenant: TenantPolicy, model: ModelRuntime, request: ChatRequest) -> dict[str, Any]:
        """The ``POST /v1/prompt-lint`` answer: what canonicalization would change and what it costs.

        Contains the tenant's own prompt text: answer that tenant only, never log it.
        """

        def render(plain: dict[str, Any]) -> str:
            return model.render_chat(plain["messages"], plain.get("tools"), add_generation_prompt=False)

        def token_starts(text: str) -> list[int]:
            return [start for start, _ in model.tokenize_chat(text).offsets]

        try:
            report = lint_prompt(
                _plain(request), policy=self.policy(tenant), render=render, token_starts=token_starts
            )
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages", code="invalid_value") from exc
        return {"object": "prompt_lint", "model": model.model_id, **report.to_json()}
