"""The chat request ``bench.gateway_overhead`` sends: a system prompt with a timestamp, one tool, three turns.

The timestamp is what canonicalization moves (``on``) or reports (``report``); the tool is sorted.
"""

from __future__ import annotations

CANONICALIZATION_MODES = ("off", "report", "on")
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by id and return its status.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["order_id"],
            },
        },
    }
]
CHAT_MESSAGES = [
    {
        "role": "system",
        "content": "You are the support assistant of an online shop. Current time: 2026-12-01T03:12:59Z. "
        "Answer briefly and politely; call lookup_order when the user gives an order id.",
    },
    {"role": "user", "content": "Hello, my parcel has not arrived yet."},
    {"role": "assistant", "content": "Sorry to hear that. What is your order id?"},
    {"role": "user", "content": "It is A-1234, placed last Monday."},
]
