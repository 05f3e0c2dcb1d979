"""The KV-cache block pool of one instance (vLLM's paged KV cache, Kwon et al., SOSP'23).

Capacity is counted in blocks of `block_tokens` tokens; a sequence holding n tokens of KV holds
ceil(n / block_tokens) blocks. Three kinds of holding:

- `used`: blocks physically allocated (running sequences, prompts being prefilled, KV in flight
  to this instance, and the idle KV of sessions kept between rounds). Never above `capacity`:
  `take` refuses, it does not clip, so an over-admission is an error, not a silent overbooking.
- `idle`: the part of `used` held by sessions between rounds (multi-round KV retention), in LRU
  order. It is a cache: `evict_idle` frees the least recently used first when an allocation
  needs room, and the session's next round then recomputes its history.
- `reserved`: a dispatcher's promise (MAPS, arXiv 2609.15359 Alg. 1: B_res), not physical. A
  dispatcher sees `effective = free - reserved` (MAPS's B_eff); admission looks at `free` only.
"""

from __future__ import annotations

from collections import OrderedDict


class KVPool:
    __slots__ = ("capacity", "block_tokens", "used", "reserved", "idle", "peak")

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.capacity = capacity_tokens // block_tokens
        if self.capacity < 1:
            raise ValueError(f"KV capacity {capacity_tokens} tokens is less than one block of "
                             f"{block_tokens}")
        self.block_tokens = block_tokens
        self.used = 0
        self.reserved = 0
        self.idle: OrderedDict[int, int] = OrderedDict()  # session id -> blocks, LRU first
        self.peak = 0

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def effective(self) -> int:
        """Free blocks minus dispatcher reservations (MAPS's B_eff = B_free - B_res)."""
        return self.capacity - self.used - self.reserved

    def take(self, n: int) -> None:
        """Allocate n blocks, all or nothing; refusing is the caller's bug, so it raises."""
        if n < 0 or n > self.capacity - self.used:
            raise RuntimeError(f"KV over-admission: take {n} blocks with {self.free} free of "
                               f"{self.capacity}")
        self.used += n
        if self.used > self.peak:
            self.peak = self.used

    def give(self, n: int) -> None:
        if n < 0 or n > self.used:
            raise RuntimeError(f"KV accounting: give {n} blocks with {self.used} used")
        self.used -= n

    def evict_idle(self, need: int, keep: int | None = None) -> list[int]:
        """Free idle session KV, least recently used first, until `need` blocks are free or no
        idle KV is left; session `keep` (the one being admitted) is spared. Returns the
        evicted session ids."""
        evicted = []
        for sid in list(self.idle):
            if self.capacity - self.used >= need:
                break
            if sid != keep:
                self.used -= self.idle.pop(sid)
                evicted.append(sid)
        return evicted
