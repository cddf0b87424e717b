"""The hf backend's prefill: a new row's prompt into its KV slot, its shared leading ids (a cloned voice's reference
turn) copied from a store of prefixes computed once.

`HFPrefill` is a layer of HFBackend (hf.py), over its model (hf_model.py); HFBackend's `__init__` creates the store.
"""

from __future__ import annotations

import collections
import threading

import torch

from .hf_model import HFModel

PrefixKey = tuple[str | None, tuple[int, ...]]  # a stored prefix: (its adapter, its ids)
PrefixKV = tuple[list[torch.Tensor], list[torch.Tensor]]  # keys and values per layer, (kv head, position, head_dim)


class PrefixStore:
    """Shared prefixes' keys and values by (adapter, prefix ids), an LRU of `size` (any thread: it locks)."""

    def __init__(self, size: int):
        self.size = size
        # An adapter's keys and values differ from the base model's, hence the adapter in the key; most recently
        # used last.
        self._kv: collections.OrderedDict[PrefixKey, PrefixKV] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _kv (forget comes from any thread)

    def get(self, key: PrefixKey) -> PrefixKV | None:
        """The stored keys and values of `key` (now the most recently used), or None."""
        with self._lock:
            kv = self._kv.get(key)
            if kv is not None:
                self._kv.move_to_end(key)
            return kv

    def put(self, key: PrefixKey, kv: PrefixKV) -> None:
        """Store `kv` under `key`, dropping the least recently used beyond `size`."""
        with self._lock:
            self._kv[key] = kv
            while len(self._kv) > self.size:
                self._kv.popitem(last=False)

    def forget(self, ids: tuple[int, ...]) -> None:
        """Drop prefix `ids` of every adapter, if stored."""
        with self._lock:
            for key in [k for k in self._kv if k[1] == ids]:
                del self._kv[key]

    def clear(self) -> None:
        with self._lock:
            self._kv.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kv)


class HFPrefill(HFModel):
    """Prefill of a slot through the prefix store (`self._prefixes`)."""

    _prefixes: PrefixStore  # set by HFBackend.__init__

    def _prefill(self, slot: int, ids: tuple[int, ...], shared: int, adapter: str | None = None) -> None:
        """Put the keys and values of `ids` in `slot` (whose adapter is `adapter`), its first `shared` ids from the
        prefix store (computed and stored if absent), the rest by a forward."""
        start = 0
        if 0 < shared <= len(ids):
            key = (adapter, ids[:shared])
            kv = self._prefixes.get(key)
            if kv is None:
                self._counters["prefix_misses"] += 1
                self.forward(torch.tensor([ids[:shared]], device=self.device), [slot], [0])
                kv = (
                    [k[slot, :, :shared].clone() for k in self.k_cache],
                    [v[slot, :, :shared].clone() for v in self.v_cache],
                )
                self._prefixes.put(key, kv)
            else:
                self._counters["prefix_hits"] += 1
                for cache, stored in zip((*self.k_cache, *self.v_cache), (*kv[0], *kv[1]), strict=True):
                    cache[slot, :, :shared] = stored
            start = shared
        if len(ids) > start:
            self.forward(torch.tensor([ids[start:]], device=self.device), [slot], [start])

    def forget_prefix(self, ids: tuple[int, ...]) -> None:
        """Free the stored keys and values of prefix `ids` (of every adapter), if stored (any thread; a voice was
        removed)."""
        self._prefixes.forget(tuple(ids))
