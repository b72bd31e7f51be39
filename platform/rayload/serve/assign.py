"""Sticky arm assignment: a stable hash of (salt, unit_id) picks one of 10,000 buckets.

The layout makes ramps safe. The champion owns every bucket no challenger holds; challenger i
(of k) owns the first `weight * 10,000` buckets of its own slot, the buckets from
i * 10,000 / k on. Raising a challenger's weight therefore only moves units from the
champion to that challenger, never between challengers and never back, and the same unit
lands in the same arm in every replica, process and restart (blake2b, not Python's hash()).
The slots follow the challengers' order with the champion left out, so a change of champion
(a promote, or set-weights naming another) lays the buckets out anew: units may change arms
then, as in a new experiment, whatever their arms' weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..ab_spec import BUCKETS


def bucket(salt: str, unit_id: str) -> int:
    digest = hashlib.blake2b(f"{salt}\x1f{unit_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


@dataclass(frozen=True)
class Layout:
    """Bucket ranges per arm for one set of weights."""

    champion: str
    ranges: tuple[tuple[str, int, int], ...]  # (challenger, first bucket, end bucket)

    @classmethod
    def build(cls, weights: dict[str, float], champion: str, order: list[str]) -> "Layout":
        challengers = [a for a in order if a != champion]
        slot = BUCKETS // max(1, len(challengers))
        ranges = []
        for i, arm in enumerate(challengers):
            start = i * slot
            ranges.append((arm, start, start + min(slot, round(weights.get(arm, 0.0) * BUCKETS))))
        return cls(champion, tuple(ranges))

    def arm_of(self, b: int) -> str:
        for arm, start, end in self.ranges:
            if start <= b < end:
                return arm
        return self.champion

    def assign(self, salt: str, unit_id: str) -> str:
        return self.arm_of(bucket(salt, unit_id))
