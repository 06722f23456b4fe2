"""The package's one kind of per-process cache: a bounded map that forgets the least
recently used entry (``Lru``). Every cache of computed answers (cost models, trace shards,
stage programs, simulated plans, planners' answers and mappings) is one, keyed by
everything its value depends on (content hashes, not names), so a hit is the same answer
computed again; tests check each key (``tests/test_caches.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lru(Generic[K, V]):
    """At most ``size`` entries; reading or storing one makes it the most recent."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a cache holds at least one entry, got {size}")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The entry for ``key``, or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Store ``value`` for ``key``; the oldest entry goes past ``size``."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def remember(self, key: K, make: Callable[[], V]) -> V:
        """The entry for ``key``, made by ``make()`` on first use."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        return self.put(key, make())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
