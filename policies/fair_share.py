"""Max-min fair shares of a capacity among owners that ask for part of it (water-filling).

Used for dedicated tenants' reservations in every tier: the device pool shares its reservable blocks,
the disk and the Redis tier their reservable bytes, so reservations together never exceed what a tier
lets be reserved, and one owner asking for more than the cap cannot starve one asking later.
"""

from __future__ import annotations

from collections.abc import Mapping


def max_min_shares(asks: Mapping[str, int], capacity: int) -> dict[str, int]:
    """Share ``capacity`` among ``asks`` (owner -> amount asked, > 0) max-min fairly.

    Smallest asks are served first; each gets what it asked or an equal part of what is left, whichever is
    less (what an equal division leaves over goes to the later, larger asks). Returns owner -> share for
    the owners whose share is positive; the shares sum to at most ``capacity``, each at most its ask.
    """
    shares: dict[str, int] = {}
    left = max(0, capacity)
    ordered = sorted(
        ((owner, asked) for owner, asked in asks.items() if asked > 0), key=lambda a: (a[1], a[0])
    )
    for k, (owner, asked) in enumerate(ordered):
        share = min(asked, left // (len(ordered) - k))
        left -= share
        if share:
            shares[owner] = share
    return shares
