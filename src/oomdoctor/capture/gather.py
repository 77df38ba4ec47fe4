"""Gathering one small JSON payload per rank on rank 0, without collectives, with a deadline.

A collective (``gather_object``) would hang until NCCL's timeout when a rank has died, and needs a
process group that training scripts often destroy before exit. Instead every rank ``set``\\ s its
payload under its own key in a key-value store, and rank 0 polls for the keys until a deadline,
then names the ranks that never answered. The store is ``torch.distributed``'s own (a ``TCPStore``
under torchrun, hosted by the launcher's agent so it outlives the workers), kept from the moment the
process group was seen, or a fresh client of ``MASTER_ADDR:MASTER_PORT``; without either, a shared
directory (one host, or a shared filesystem) serves as the store.

Any object with ``set(key, bytes)``, ``check([key]) -> bool`` and ``get(key) -> bytes`` is a store,
which is how the logic is tested without torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .files import atomic_write_bytes


class Store(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...


class DirectoryStore:
    """A store made of files ``<dir>/.<key>`` (slashes become ``__``), written atomically."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, "." + key.replace("/", "__"))

    def set(self, key: str, value: bytes) -> None:
        atomic_write_bytes(self._path(key), value)

    def check(self, keys: list[str]) -> bool:
        return all(os.path.exists(self._path(k)) for k in keys)

    def get(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except OSError:
            pass


@dataclass
class Gathered:
    """On rank 0: ``payloads[rank]`` for every rank that answered, ``missing`` the others, and the
    seconds waited."""

    payloads: dict[int, bytes] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    waited_s: float = 0.0


def payload_key(prefix: str, rank: int) -> str:
    return f"{prefix}/rank{rank}"


def gather_payloads(store: Store, prefix: str, rank: int, world_size: int, payload: bytes, *,
                    timeout_s: float = 120.0, poll_s: float = 0.2,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> Gathered | None:
    """Publish this rank's payload; on rank 0, collect every rank's until ``timeout_s`` has passed.

    Returns:
        On rank 0, the :class:`Gathered` payloads (its own included); elsewhere None, at once.
    """
    store.set(payload_key(prefix, rank), payload)
    if rank != 0:
        return None
    got = Gathered()
    waiting = set(range(world_size))
    start = clock()
    while True:
        for r in sorted(waiting):
            key = payload_key(prefix, r)
            if store.check([key]):
                got.payloads[r] = store.get(key)
                waiting.discard(r)
        if not waiting or clock() - start >= timeout_s:
            break
        sleep(poll_s)
    got.missing = sorted(waiting)
    got.waited_s = clock() - start
    return got
