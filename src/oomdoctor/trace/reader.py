"""Reading snapshot bytes safely: decompression by magic bytes, a restricted unpickler, JSON.

Snapshots are untrusted input. :func:`decode` never executes anything from a file: the unpickler
refuses every global (``find_class``) and persistent id, so only the plain data types that pickle
builds natively (dict, list, tuple, str, bytes, int, float, bool, None, set) can come out.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any, BinaryIO, Callable, Protocol

from ..errors import SnapshotError, UnsafeSnapshotError

ProgressFn = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``, called while a file is read."""


class BinaryReader(Protocol):
    """What the loaders read a snapshot through: a file opened ``"rb"``, or a decompressor's stream
    (:func:`open_decompressed`: gzip's, lzma's, bz2's, zstandard's), used in a ``with`` block."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int: ...

    def readline(self, size: int = -1, /) -> bytes: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any, /) -> Any: ...

_CHUNK = 4 << 20

_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
)


def read_file(path: str, progress: ProgressFn | None = None) -> bytes:
    """Read ``path`` whole, reporting progress. Raises :class:`SnapshotError` if it cannot be read
    or is empty."""
    try:
        total = os.path.getsize(path)
        with open(path, "rb") as f:
            if progress is None:
                data = f.read()
            else:
                parts, done = [], 0
                progress(0, total)
                while chunk := f.read(_CHUNK):
                    parts.append(chunk)
                    done += len(chunk)
                    progress(done, total)
                data = b"".join(parts)
    except FileNotFoundError:
        raise SnapshotError(path, "no such file") from None
    except IsADirectoryError:
        raise SnapshotError(path, "is a directory, not a snapshot file") from None
    except OSError as e:
        raise SnapshotError(path, f"cannot be read ({e.strerror or e})") from None
    if not data:
        raise SnapshotError(path, "is empty (0 bytes); a snapshot dump that failed or was interrupted leaves such files")
    return data


def compression_of(data: bytes) -> str | None:
    """The compression format named by the magic bytes at the start of ``data``, or None."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    return None


#: Decompressed bytes per compressed byte above which a file is refused as a decompression bomb. Snapshots
#: compress about 20-25x with xz (``shared/snapshots/large``: 28 MB in 1.2 MB); 256x leaves room for
#: repetitive traces and stops a stream of zeros (about 1000x and more) before it fills the memory.
MAX_COMPRESSION_RATIO = 256
#: Below this many decompressed bytes the ratio is not checked (tiny files compress oddly).
RATIO_FREE_BYTES = 64 << 20
# first decompressed bytes of a pickle (protocol 2+, then 0/1) or of JSON
_DATA_STARTS = (b"\x80", b"(", b"]", b"}", b"I", b"N", b"S", b"V", b"{", b"[", b" ", b"\n", b"\r", b"\t")


def check_ratio(path: str, kind: str, produced: int, consumed: int) -> None:
    """Refuse a decompression bomb: more than :data:`MAX_COMPRESSION_RATIO` bytes out per byte in, past
    :data:`RATIO_FREE_BYTES`.

    Raises:
        SnapshotError: the ratio is exceeded (the message names the file and the ratio).
    """
    if produced > RATIO_FREE_BYTES and produced > MAX_COMPRESSION_RATIO * max(consumed, 1):
        raise SnapshotError(path, f"{kind}-compressed data expands more than {MAX_COMPRESSION_RATIO}x "
                                  f"({produced} bytes from {consumed}): refused as a decompression bomb")


def open_decompressed(raw: BinaryIO, kind: str) -> BinaryReader:
    """The decompressed stream of ``raw`` (a binary file object holding ``kind``-compressed data).
    Concatenated streams (multi-member gzip, xz, bzip2, zstd frames) are followed; reading past a
    truncated end raises EOFError."""
    # each decompressor's module is imported for its own files only (start-up: docs/benchmarks.md)
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(raw, "rb")
    if kind == "bzip2":
        import bz2

        return bz2.BZ2File(raw, "rb")
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)


def _chunks(kind: str, data: bytes):
    """Decompressed pieces of ``data`` (at most 4 MiB each) with the compressed bytes consumed so far."""
    src = io.BytesIO(data)
    with open_decompressed(src, kind) as stream:
        while piece := stream.read(4 << 20):
            yield piece, src.tell()


def decompress(path: str, data: bytes) -> bytes:
    """Undo gzip/xz/zstd/bzip2 compression detected by magic bytes (never by file name), a piece at a
    time: data that does not start like a pickle or JSON is refused after its first piece, and a
    decompression bomb once it passes :data:`MAX_COMPRESSION_RATIO` (:func:`check_ratio`).

    Raises:
        SnapshotError: truncated or corrupt data, no data, not a snapshot, or a bomb.
    """
    kind = compression_of(data)
    if kind is None:
        return data
    parts: list[bytes] = []
    produced = 0
    try:
        for piece, consumed in _chunks(kind, data):
            if not parts and piece and piece.lstrip()[:1] not in _DATA_STARTS and piece.lstrip():
                raise SnapshotError(path, f"{kind}-compressed data is neither a pickle nor JSON (its first bytes: "
                                          f"{piece[:8].hex(' ')})")
            produced += len(piece)
            check_ratio(path, kind, produced, consumed)
            if piece:
                parts.append(piece)
    except SnapshotError:
        raise
    except Exception as e:  # OSError, EOFError, LZMAError, zlib.error, zstandard.ZstdError, MemoryError, ...
        raise SnapshotError(path, f"{kind}-compressed data is truncated or corrupt ({e})") from None
    if not produced:
        raise SnapshotError(path, f"{kind}-compressed file holds no data")
    return b"".join(parts)


class _PlainDataUnpickler(pickle.Unpickler):
    """Admits only what pickle builds without importing anything."""

    def __init__(self, file: io.BytesIO, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle hook
        raise UnsafeSnapshotError(self._path, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeSnapshotError(self._path, f"persistent id {str(pid)[:40]!r}")


def unpickle(path: str, data: bytes) -> Any:
    """Unpickle plain data only. Raises :class:`UnsafeSnapshotError` on any global and
    :class:`SnapshotError` on truncated or corrupt bytes."""
    try:
        return _PlainDataUnpickler(io.BytesIO(data), path).load()
    except UnsafeSnapshotError:
        raise
    except EOFError:
        raise SnapshotError(path, "pickle data is truncated (ended before its STOP opcode)") from None
    except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            MemoryError, OverflowError, UnicodeDecodeError, RecursionError) as e:
        raise SnapshotError(path, f"is not a valid pickle ({type(e).__name__}: {str(e)[:120]})") from None


_SNIFF_BYTES = 1 << 20
# opcodes that import or call: a snapshot (plain dicts, lists, strings, numbers) never holds one
_OBJECT_OPCODES = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX",
                             "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


def _head_decompressed(head: bytes) -> bytes | None:
    """Up to 1 MiB of the decompressed start of ``head``, or None when it cannot be had cheaply."""
    kind = compression_of(head)
    try:
        if kind is None:
            return head
        if kind == "gzip":
            import zlib

            return zlib.decompressobj(wbits=31).decompress(head, _SNIFF_BYTES)
        if kind == "xz":
            import lzma

            return lzma.LZMADecompressor().decompress(head, max_length=_SNIFF_BYTES)
        if kind == "bzip2":
            import bz2

            return bz2.BZ2Decompressor().decompress(head, max_length=_SNIFF_BYTES)
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(head)[:_SNIFF_BYTES]
    except Exception:  # noqa: BLE001 - corrupt or cut off: the full load says what is wrong
        return None


SNIFF_WALK_MIN_BYTES = 64 << 20
OBJECTS_PICKLE = "a pickle of Python objects"
"""How :func:`sniff`'s reason for a pickle that imports or calls begins (unpickling it would run code)."""


def no_segments(obj: dict) -> str:
    """Why a dict without ``segments`` is no snapshot, naming its first keys (a metrics or ground-truth JSON)."""
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    return f"is not a memory snapshot: no 'segments' key (keys: {keys})"


def sniff(path: str, walk: bool = True) -> str | None:
    """Why ``path`` is plainly not a snapshot, read from its first MiB only (after decompression), or None
    when it may be one. Used on the files a directory holds beside the snapshots (checkpoints, metrics,
    logs), so that a multi-gigabyte ``torch.save`` file is not read whole to be refused.

    A zip archive is told by its magic bytes. With ``walk``, :mod:`pickletools` also walks the first MiB's
    opcodes (nothing is unpickled) for one that imports or calls; that costs about 0.1 s, so callers
    walk only files above :data:`SNIFF_WALK_MIN_BYTES`, where reading the whole file would cost more.

    Raises:
        SnapshotError: the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise SnapshotError(path, f"cannot be read ({e.strerror or e})") from None
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a torch.save checkpoint?)"
    if len(head) < _SNIFF_BYTES and head.lstrip()[:1] == b"{":  # a small JSON file, read whole: is it one?
        try:
            obj = json.loads(head)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None  # the load says what is wrong with it
        if isinstance(obj, dict) and "segments" not in obj:  # as trace/build.py refuses it
            return no_segments(obj)
    if not walk:
        return None
    data = _head_decompressed(head)
    if not data or data[:1] not in (b"\x80", b"(", b"]", b"}"):
        return None
    import pickletools  # only where a head is walked

    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in _OBJECT_OPCODES:
                what = f" {str(arg)[:60]!r}" if op.name in ("GLOBAL", "INST") and arg else ""
                return f"{OBJECTS_PICKLE} ({op.name}{what}), not plain data"
            if op.name == "STOP":
                break
    except Exception:  # noqa: BLE001 - the first MiB ends mid-opcode, or the bytes are not a pickle
        pass
    return None


def decode(path: str, data: bytes) -> Any:
    """Turn file bytes (possibly compressed) into plain Python data: a pickle, or the JSON form that
    pytorch.org/memory_viz accepts."""
    data = decompress(path, data)
    if data[:1] == b"\x80":  # pickle protocol >= 2
        return unpickle(path, data)
    head = data[:64].lstrip()
    if head[:1] in (b"{", b"["):
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SnapshotError(path, f"looks like JSON but does not parse ({str(e)[:120]})") from None
        except RecursionError:
            raise SnapshotError(path, "JSON is nested too deeply to be a snapshot") from None
    if head[:1] in (b"(", b"]", b"}", b"I", b"N", b"S", b"V"):  # pickle protocol 0/1
        return unpickle(path, data)
    raise SnapshotError(path, "is neither a pickle nor JSON (unrecognised first bytes "
                              f"{data[:8].hex(' ')}); expected a torch.cuda.memory._dump_snapshot() file")
