"""Loading a large pickled snapshot without holding all of its trace entries as Python objects.

``pickle.load`` of a snapshot builds one dict per trace entry (about 6x the file's size in memory,
measured in ``docs/simulate.md``). Here the same restricted unpickler (:mod:`.reader`: no global, no
persistent id) reads the file through a counting reader; every :data:`DRAIN_BYTES` read, the trace
lists being filled are drained into event columns (:meth:`.build.Drained.drain`), so the entries never
pile up. Entries the pickle memo still holds are shrunk in place (the memo cannot be edited during a
load: CPython's ``Unpickler.memo`` setter resets the next memo index).

Only framed pickles (protocol >= 4, what ``torch.cuda.memory._dump_snapshot`` writes) stream: the
unpickler then reads whole frames of about 64 KiB, so the reader is called a few times per MiB.
Compressed files stream through their decompressor.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, BinaryIO, cast

from ..errors import SnapshotError, UnsafeSnapshotError
from .build import Drained
from .reader import (
    BinaryReader,
    ProgressFn,
    _PlainDataUnpickler,
    check_ratio,
    compression_of,
    open_decompressed,
)

#: Files at least this large on disk (compressed: a quarter of it) are streamed.
STREAM_MIN_BYTES = 256 << 20
#: Drain the trace lists after every this many (decompressed) bytes.
DRAIN_BYTES = 32 << 20
_PIECE = 4 << 20  # large reads go through in pieces of this size


def should_stream(path: str) -> bool:
    """Whether :func:`load_streaming` should read ``path``: a framed pickle (protocol >= 4) of at least
    :data:`STREAM_MIN_BYTES` (a compressed one of a quarter of that). Never raises."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return False
    kind = compression_of(head)
    if kind is None:
        return size >= STREAM_MIN_BYTES and head[:1] == b"\x80" and head[1:2] >= b"\x04"
    return size >= STREAM_MIN_BYTES // 4 and kind in ("gzip", "xz", "bzip2", "zstd")


class _Counting:
    """The file the unpickler reads: counts bytes, reports progress, drains every ``every`` bytes, and
    refuses a decompression bomb (``reader.check_ratio``: ``raw`` is the compressed file under it)."""

    def __init__(self, stream: BinaryReader, raw: BinaryIO, kind: str | None, path: str, on_drain: Any, every: int,
                 progress: ProgressFn | None, total: int) -> None:
        self.stream, self.raw, self.kind, self.path = stream, raw, kind, path
        self.on_drain, self.every = on_drain, every
        self.progress, self.total = progress, total
        self.done = 0
        self.next = every

    def _count(self, n: int) -> None:
        self.done += n
        if self.done >= self.next:
            self.next += self.every
            if self.kind is not None:
                check_ratio(self.path, self.kind, self.done, self.raw.tell())
            self.on_drain()
            if self.progress is not None:
                self.progress(min(self.raw.tell(), self.total), self.total)

    def read(self, n: int = -1) -> bytes:
        if 0 <= n <= _PIECE:
            data = self.stream.read(n)
            self._count(len(data))
            return data
        # a large read (a declared 100 GB string): a piece at a time, so a bomb is refused on the way
        parts: list[bytes] = []
        got = 0
        while n < 0 or got < n:
            piece = self.stream.read(_PIECE if n < 0 else min(_PIECE, n - got))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
            self._count(len(piece))
            if self.kind is not None:
                check_ratio(self.path, self.kind, self.done, self.raw.tell())
        return b"".join(parts)

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(view):
            k = self.stream.readinto(view[got:got + _PIECE])
            if not k:
                break
            got += k
            self._count(k)
            if self.kind is not None and len(view) > _PIECE:
                check_ratio(self.path, self.kind, self.done, self.raw.tell())
        return got

    def readline(self) -> bytes:
        line = self.stream.readline()
        self._count(len(line))
        return line


def _is_trace_list(v: Any) -> bool:
    return v.__class__ is list and bool(v) and v[0].__class__ is dict and "action" in v[0]


def load_streaming(path: str, progress: ProgressFn | None = None, every: int = DRAIN_BYTES) -> tuple[Any, Drained]:
    """Unpickle ``path`` (plain data only), draining trace entries into columns as they arrive.

    Returns the decoded object (its trace lists hold only the entries after the last drain) and the
    :class:`~.build.Drained` columns; :func:`.build.build_trace` joins the two.

    Raises:
        UnsafeSnapshotError: the pickle asks for a global; nothing from it was executed.
        SnapshotError: unreadable, truncated or corrupt data, or entries of the wrong shape.
    """
    with open(path, "rb") as f:
        kind = compression_of(f.read(8))
    drained = Drained(path)
    lists: list[list] = []  # trace lists found so far
    box: list[pickle.Unpickler] = []  # the unpickler, once made

    def drain() -> None:
        grew = False
        for lst in lists:
            grew |= drained.drain(lst) > 0
        if not grew:  # the list we knew is finished (or none found yet): look for a newer one
            # an index -> object dict (typeshed gives it the Pickler memo's (index, object) values)
            memo = cast("dict[int, Any]", box[0].memo.copy())
            for v in memo.values():
                if _is_trace_list(v) and all(v is not k for k in lists):
                    lists.append(v)
                    drained.drain(v)

    total = os.path.getsize(path)
    try:
        with open(path, "rb") as raw, (open_decompressed(raw, kind) if kind else raw) as stream:
            reader = _Counting(stream, raw, kind, path, drain, every, progress, total)
            box.append(_PlainDataUnpickler(reader, path))  # type: ignore[arg-type]
            obj = box[0].load()
            box.clear()
    except (UnsafeSnapshotError, SnapshotError):
        raise
    except EOFError:
        raise SnapshotError(path, "pickle data is truncated (ended before its STOP opcode)") from None
    except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError, AttributeError, MemoryError,
            OverflowError, UnicodeDecodeError, RecursionError) as e:
        raise SnapshotError(path, f"is not a valid pickle ({type(e).__name__}: {str(e)[:120]})") from None
    except Exception as e:  # noqa: BLE001 - OSError, LZMAError, zlib.error, zstandard.ZstdError, ...
        raise SnapshotError(path, f"cannot be read or decompressed ({type(e).__name__}: {str(e)[:120]})") from None
    if progress is not None:
        progress(total, total)
    return obj, drained
