"""The KV cache the lean engine keeps between generate calls of one rollout.

A multi-turn rollout calls generate once per turn, and every prompt of a turn is an earlier
sequence (its prompt and the reply the engine produced) extended by new tokens: the environment's
observation and the template's glue. The engine keeps, per model, the keys and values of every
sequence the last call produced; the next call looks each prompt up, copies the longest kept prefix
into its cache and feeds only the rest. A tree's children extend their parent's sequence: each
child copies it (copy on branch), so a tree of depth T computes each history once.

- Lookup is by token prefix, never by position or episode: whatever shares a prefix with a kept
  sequence reuses it (episodes, tree nodes, a prompt a transition rebuilt that starts the same), and
  the reused part is verified token by token, so a hash collision cannot mix up two sequences.
- A model's kept sequences are replaced by those of its next call: a sequence no prompt extended
  (a finished episode, a closed branch) is freed then.
- The cache is only kept inside the engine's rollout block (the weights cannot change there) and
  only while every parameter of the model is the one it was (``weight_version``).
- A call's cache is kept as it is (its rows' sequences point into it: nothing is copied until the
  next call takes a prefix). ``budget`` bytes cap what is kept across all models: a cache larger
  than the room left is kept as copies of its sequences, in row order while they fit; a sequence
  that does not fit is not kept and its next turn re-reads its history (the same tokens and
  log-probs, at the cost of the re-read). Nothing fails for want of room.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
"""Prefixes are looked up in blocks of this many tokens (the rest is matched token by token within
the kept sequence found): a prompt shares up to BLOCK - 1 fewer tokens than it could."""


@dataclass
class Kept:
    """One sequence's keys and values: row ``row`` of ``k`` / ``v`` (``[layers, rows, kv_heads, slots,
    head_dim]``, a generate call's whole cache, shared by its rows, or a copy of one row), token j at
    the j-th slot of ``slots`` (ranges of slots, in order), RoPE at position j."""

    tokens: list[int]
    k: torch.Tensor
    v: torch.Tensor
    row: int = 0
    slots: tuple[tuple[int, int], ...] = ()

    def write(self, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The first ``n`` tokens' keys and values into ``k`` / ``v`` (``[layers, kv_heads, n, head_dim]``)."""
        at = 0
        for start, end in self.slots:
            if at == n:
                break
            take = min(end - start, n - at)
            k[:, :, at : at + take] = self.k[:, self.row, :, start : start + take]
            v[:, :, at : at + take] = self.v[:, self.row, :, start : start + take]
            at += take

    def copy(self) -> "Kept":
        """This sequence alone (its own tensors, no other row's)."""
        n = len(self.tokens)
        k, v = (self.k.new_empty(self.k.shape[0], 1, self.k.shape[2], n, self.k.shape[4]) for _ in range(2))
        self.write(n, k[:, 0], v[:, 0])
        return Kept(self.tokens, k, v, 0, ((0, n),))


def _chain(tokens: list[int], blocks: int):
    """The hash of each of the first ``blocks`` whole blocks with everything before it."""
    h = 0
    for j in range(blocks):
        h = hash((h, tuple(tokens[j * BLOCK : (j + 1) * BLOCK])))
        yield h


class _Store:
    """One model's kept sequences and their block index."""

    def __init__(self, version: tuple, entries: list[Kept]):
        self.version, self.entries = version, entries
        self.index: dict[int, Kept] = {}
        for entry in entries:
            for h in _chain(entry.tokens, len(entry.tokens) // BLOCK):
                self.index.setdefault(h, entry)

    def match(self, prompt: list[int]) -> tuple[Kept | None, int]:
        """The kept sequence sharing the longest prefix with ``prompt`` and how many tokens it
        shares, at most ``len(prompt) - 1`` (the last token is always fed: its output samples)."""
        limit = len(prompt) - 1
        best, shared = None, 0
        for j, h in enumerate(_chain(prompt, limit // BLOCK)):
            entry = self.index.get(h)
            if entry is None:
                break
            best, shared = entry, (j + 1) * BLOCK
        if best is None or best.tokens[:shared] != prompt[:shared]:  # nothing, or a hash collision
            return None, 0
        low, high = shared, min(limit, len(best.tokens))
        while low < high:  # the longest run past the blocks on which the two agree
            mid = (low + high + 1) // 2
            if best.tokens[shared:mid] == prompt[shared:mid]:
                low = mid
            else:
                high = mid - 1
        return best, low


class KeptCache:
    """Per model (a key the engine chooses) the sequences its last call produced, under ``budget``
    bytes in all."""

    def __init__(self, budget: int):
        self.budget = budget
        self.stores: dict[object, _Store] = {}

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor the kept sequences hold (a call's cache shared by its rows, once)."""
        tensors = {id(t): t for store in self.stores.values() for e in store.entries for t in (e.k, e.v)}
        return sum(t.nbytes for t in tensors.values())

    def take(self, key, version: tuple, prompts: list[list[int]]) -> list[tuple[Kept | None, int]]:
        """Each prompt's longest kept prefix (``(None, 0)``: none), the model's kept sequences then
        released (the caller copies what it reuses before it computes the new ones)."""
        store = self.stores.pop(key, None)
        if store is None or store.version != version:
            return [(None, 0)] * len(prompts)
        return [store.match(p) if p else (None, 0) for p in prompts]

    def put(self, key, version: tuple, entries: list[Kept]) -> None:
        """Keep ``entries`` (rows of one call's cache) for the model's next call: the whole cache where
        it fits in the budget (no copy), else a copy of each sequence, in order, while they fit."""
        room = self.budget - self.nbytes
        shared = {id(t): t for e in entries for t in (e.k, e.v)}
        if sum(t.nbytes for t in shared.values()) <= room:
            self.stores[key] = _Store(version, entries)
            return
        kept = []
        for entry in entries:
            size = 2 * entry.k[:, :1, :, :1].nbytes * len(entry.tokens)
            if size <= room:
                kept.append(entry.copy())
                room -= size
        self.stores[key] = _Store(version, kept)
