"""Lookups derived from a fitted state (a dict of its vocabulary, its lists as numpy arrays),
built once per process instead of once per transform call, and never pickled or serialised."""

from __future__ import annotations


class Memo:
    """Mixin for the fitted-state dataclasses. `_memo(build, *sources)` returns build()'s result,
    rebuilt only when one of `sources` (the state's lists) has been replaced since."""

    def _memo(self, build, *sources):
        cached = self.__dict__.get("_memo_cache")
        if cached is None or len(cached[0]) != len(sources) or any(a is not b for a, b in zip(cached[0], sources)):
            cached = (sources, build())
            self.__dict__["_memo_cache"] = cached
        return cached[1]

    def __getstate__(self) -> dict:  # Ray ships states to workers: the cache is rebuilt there
        return {k: v for k, v in self.__dict__.items() if k != "_memo_cache"}
