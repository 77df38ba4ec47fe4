"""The columns of one snapshot's largest device trace, built one at a time in process (CPU ms, best of a few
runs): where ``trace/build.py``'s time goes (docs/benchmarks.md). Usage::

    python benchmarks/trace_columns.py SNAPSHOT.pickle
"""

from __future__ import annotations

import gc
import sys
import time
from itertools import chain, repeat
from operator import itemgetter

import numpy as np

from oomdoctor.trace import build, reader


def best_ms(name: str, f, rep: int = 3):
    best, out = float("inf"), None
    for _ in range(rep):
        t = time.process_time()
        out = f()
        best = min(best, time.process_time() - t)
    print(f"{name:24s} {best * 1000:8.1f} ms")
    return out


def main() -> None:
    path = sys.argv[1]
    gc.disable()  # as trace/load.py does while it builds
    obj = reader.decode(path, reader.read_file(path))
    entries = max(obj["device_traces"], key=len)
    n = len(entries)
    t = build._Tables()
    names = best_ms("action names", lambda: list(map(itemgetter("action"), entries)))
    best_ms("action column", lambda: np.fromiter(map(build.ACTION_CODES.__getitem__, names), np.int8, count=n))
    best_ms("addr/size/stream/time", lambda: np.fromiter(chain.from_iterable(
        map(itemgetter("addr", "size", "stream", "time_us"), entries)), np.int64, count=4 * n))
    best_ms("device_free", lambda: np.fromiter(map(dict.get, entries, repeat("device_free"), repeat(-1)),
                                               np.int64, count=n))
    frame_lists = list(map(dict.get, entries, repeat("frames"), repeat(())))
    best_ms("stack", lambda: build._stack_col(path, frame_lists, t))
    for key, intern, is_default in (("pool_id", t.pool, lambda v: v is None),
                                    ("user_metadata", t.string, lambda v: v in build._NO_STRING),
                                    ("compile_context", t.string, lambda v: v in build._NO_STRING)):
        best_ms(key, lambda key=key, intern=intern, d=is_default: build._table_col(
            build._field(entries, key, None, set()), intern, d))
    best_ms("annotations", lambda: build._annotations(obj.get("external_annotations"), {0: []}, []), rep=1)
    best_ms("key counts (the same keys?)", lambda: set(map(len, entries)))
    best_ms("whole build_trace", lambda: build.build_trace(path, obj), rep=2)


if __name__ == "__main__":
    main()
