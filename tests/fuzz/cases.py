"""Inputs for the fuzz suite, all generated in code from a seed.

- :func:`malicious`: pickles that would import or call if anything unpickled them freely: every opcode
  family that can (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ``, ``REDUCE``, ``BUILD``, ``NEWOBJ``,
  ``NEWOBJ_EX``, ``EXT1/2/4``, ``PERSID``, ``BINPERSID``), at the top and inside segments, frames, settings
  and trace entries, for protocols 0-5. The payload touches a canary file: if it exists after a case,
  something was executed.
- :func:`truncations`, :func:`compressed`: cut and compressed variants of real snapshots.
- :func:`bombs`: declared lengths of 100 GB, deep nesting, decompression bombs.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import pickle
import random
import struct

import zstandard


class _Call:
    """Pickles as a call of ``func(*args)`` (``__reduce__``), the shape of every pickle exploit."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _canary_call(canary: str) -> list:
    import builtins
    import subprocess
    return [_Call(os.system, f"touch {canary}"), _Call(builtins.exec, f"open({canary!r}, 'w').close()"),
            _Call(builtins.eval, f"open({canary!r}, 'w')"), _Call(subprocess.call, ["touch", canary]),
            _Call(builtins.open, canary, "w")]


def malicious(canary: str) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of hand-written opcode streams and of exploit objects placed in snapshot fields."""
    touch = f"touch {canary}".encode()
    raw = [
        ("GLOBAL+REDUCE p0", b"cos\nsystem\n(S'" + touch + b"'\ntR."),
        ("INST p0", b"(S'" + touch + b"'\nios\nsystem\n."),
        ("OBJ p1", b"(cos\nsystem\nS'" + touch + b"'\no."),
        ("STACK_GLOBAL p4", b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(touch)]) + touch + b"\x85R."),
        ("NEWOBJ p2", b"\x80\x02cbuiltins\nobject\n)\x81."),
        ("NEWOBJ_EX p4", b"\x80\x04\x8c\x08builtins\x8c\x06object\x93)}\x92."),
        ("BUILD p2", b"\x80\x02}(K\x01K\x02u}(X\x08__dict__K\x01ub."),
        ("EXT1 p2", b"\x80\x02\x82\x01."),
        ("EXT2 p2", b"\x80\x02\x83\x01\x00."),
        ("EXT4 p2", b"\x80\x02\x84\x01\x00\x00\x00."),
        ("PERSID p0", b"P" + touch + b"\n."),
        ("BINPERSID p2", b"\x80\x02X" + struct.pack("<I", len(touch)) + touch + b"Q."),
        ("GLOBAL getattr chain p0", b"cbuiltins\ngetattr\n(cos\nsystem\nS'__call__'\ntR(S'" + touch + b"'\ntR."),
    ]
    out = list(raw)
    for i, call in enumerate(_canary_call(canary)):
        for proto in range(6):
            places = {
                "top": call,
                "segments": {"segments": [call], "device_traces": []},
                "frame": {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512, "stream": 0,
                                                             "frames": [call]}]]},
                "settings": {"segments": [], "device_traces": [], "allocator_settings": {"x": call}},
                "action": {"segments": [], "device_traces": [[{"action": call}]]},
            }
            for where, obj in places.items():
                if (i + proto) % 2 and where not in ("top", "frame"):
                    continue  # every placement, every protocol, every call, without all combinations
                out.append((f"{call.func.__name__} in {where} p{proto}", pickle.dumps(obj, protocol=proto)))
    return out


def compress_all(name: str, data: bytes) -> list[tuple[str, bytes]]:
    return [(f"{name}.gz", gzip.compress(data)), (f"{name}.xz", lzma.compress(data)),
            (f"{name}.bz2", bz2.compress(data)), (f"{name}.zst", zstandard.ZstdCompressor().compress(data))]


def truncations(name: str, data: bytes, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    cuts = sorted({0, 1, 2, len(data) - 1} | {rng.randrange(1, len(data)) for _ in range(n)})
    return [(f"{name}[:{c}]", data[:c]) for c in cuts]


def bombs() -> list[tuple[str, bytes]]:
    big = 100 << 30
    deep = 200_000
    return [
        ("BINBYTES8 100 GB", b"\x80\x04\x8e" + struct.pack("<Q", big) + b"xx."),
        ("BINUNICODE8 100 GB", b"\x80\x04\x8d" + struct.pack("<Q", big) + b"xx."),
        ("LONG4 2 GB", b"\x80\x02\x8b" + struct.pack("<i", 2**31 - 1) + b"\x01."),
        ("FRAME 100 GB", b"\x80\x04\x95" + struct.pack("<Q", big) + b"}."),
        ("nested lists", b"\x80\x04" + b"]" * deep + b"a" * (deep - 1) + b"."),
        ("nested dicts", b"\x80\x04" + b"}" * deep + b"."),
        ("MARK flood", b"\x80\x04" + b"(" * deep + b"."),
        ("JSON nesting", b"[" * deep + b"]" * deep),
        ("xz of zeros", lzma.compress(b"\x00" * (160 << 20), preset=1)),
        ("xz of a 200 MB BINBYTES8", lzma.compress(b"\x80\x04\x8e" + struct.pack("<Q", 200 << 20)
                                                   + b"\x00" * (200 << 20) + b".", preset=1)),
        ("gzip of a 160 MB list", gzip.compress(b"\x80\x04]" + b"N" * (160 << 20) + b".", 1)),
    ]
