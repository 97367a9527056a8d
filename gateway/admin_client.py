"""A small synchronous client of the admin API, used by the ``prefixgate tenant|report|…`` commands
(and, with a tenant key, by ``prefixgate lint``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class AdminError(RuntimeError):
    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body  # the JSON error answer, when there was one (a partial purge reports in it)


class AdminClient:
    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._timeout_s = timeout_s

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, query: dict[str, Any] | None = None
    ) -> Any:
        """JSON (or text for non-JSON answers) of ``method /admin/v1{path}``; raises AdminError."""
        return self.call(method, "/admin/v1" + path, body, query)

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, query: dict[str, Any] | None = None
    ) -> Any:
        """Like ``request`` for any path of the gateway."""
        url = f"{self.base_url}{path}"
        params = {key: value for key, value in (query or {}).items() if value is not None}
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = None if body is None else json.dumps(body).encode()
        try:
            req = urllib.request.Request(url, data=data, method=method)
        except ValueError as exc:  # no scheme, a bad host…
            raise AdminError(0, f"bad URL {self.base_url!r}: {exc}") from None
        req.add_header("Authorization", f"Bearer {self._token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout_s) as response:
                payload = response.read().decode()
                if response.headers.get_content_type() == "application/json":
                    return json.loads(payload)
                return payload
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                answer = json.loads(text)
                message = answer["error"]["message"]
            except (ValueError, KeyError, TypeError):
                answer, message = None, text or exc.reason
            raise AdminError(exc.code, message, answer) from None
        except urllib.error.URLError as exc:
            raise AdminError(0, f"cannot reach {self.base_url}: {exc.reason}") from None
        except (ValueError, OSError) as exc:  # e.g. an unsupported scheme, a bad port, a reset connection
            raise AdminError(0, f"cannot reach {self.base_url}: {exc}") from None

    def resolve_tenant(self, ref: str, *, is_id: bool = False) -> str:
        """The id of the tenant ``ref`` names: with ``is_id``, ``ref`` is that id as is; else the one
        tenant whose id or name ``ref`` is. A name may look like an id (``tn_…``): a reference that is one
        tenant's id and another tenant's name is refused (409, asking for ``--id``) rather than guessed,
        since ``delete`` or ``purge`` would then erase the wrong tenant."""
        if is_id:
            return ref
        tenants = self.request("GET", "/tenants")["data"]
        matches = {tenant["id"] for tenant in tenants if ref in (tenant["id"], tenant["name"])}
        if len(matches) > 1:
            raise AdminError(
                409, f"{ref!r} is a tenant's id and another tenant's name: to mean the id, pass --id"
            )
        if not matches:
            raise AdminError(404, f"no tenant named {ref!r}, nor with that id")
        return matches.pop()
