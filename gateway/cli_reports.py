"""``prefixgate report usage|requests``: reports through the admin API, every page of them.

CSV is written here from the JSON pages, as the gateway writes it (``tenancy.reports.rows_to_csv``:
formula-safe cells): a CSV file has no room for the cursor of its next page, so a CSV export that
stopped after its first page would end silently at ``--limit`` records.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from gateway.admin_client import AdminClient

HELD_BACK_RETRIES = 10  # asks for records held back by a usage write still open, HELD_BACK_PAUSE_S apart
HELD_BACK_PAUSE_S = 0.2


def usage_report(
    client: AdminClient, query: dict[str, Any], cursor: str | None, limit: int | None, output: str
) -> Any:
    """One page after ``cursor``, or (no cursor) the whole report, page after page."""
    from tenancy.reports import REPORT_FIELDS, rows_to_csv  # the CLI's other commands need no SQLAlchemy

    report = client.request("GET", "/reports/usage", query={**query, "cursor": cursor, "limit": limit})
    while cursor is None and report["has_more"]:
        page = client.request(
            "GET", "/reports/usage", query={**query, "cursor": report["next_cursor"], "limit": limit}
        )
        report = {**page, "data": report["data"] + page["data"]}
    return rows_to_csv(report["data"], REPORT_FIELDS) if output == "csv" else report


def request_export(
    client: AdminClient, query: dict[str, Any], cursor: str | None, limit: int, output: str
) -> Any:
    """JSON: one page after ``cursor`` (its ``next_cursor`` says where the next one starts). CSV: every
    page after ``cursor``, written as each arrives (an iterator of text)."""
    query = {**query, "format": "json", "limit": limit}
    if output == "json":
        return client.request("GET", "/reports/requests", query={**query, "cursor": cursor})
    return _export_csv(client, query, cursor)


def _export_csv(client: AdminClient, query: dict[str, Any], cursor: str | None) -> Iterator[str]:
    """The pages as CSV, the header first. Records held back by a usage write still open (the page has
    ``held_back`` and nothing new) are asked for again a few times; if they are still held back, the
    cursor to go on from is said on stderr (the export is not complete)."""
    from tenancy.reports import EXPORT_FIELDS, rows_to_csv

    header, num_waits = True, 0
    while True:
        page = client.request("GET", "/reports/requests", query={**query, "cursor": cursor})
        if page["data"] or header:
            yield rows_to_csv(page["data"], EXPORT_FIELDS, header=header)
        header, cursor = False, page["next_cursor"]
        if not page["has_more"]:
            return
        if page["data"]:
            num_waits = 0
        elif num_waits == HELD_BACK_RETRIES:
            print(
                f"prefixgate: later records wait for a usage write still open; go on with: --cursor {cursor}",
                file=sys.stderr,
            )
            return
        else:
            num_waits += 1
            time.sleep(HELD_BACK_PAUSE_S)
