"""``simulate/scale.py``: ``scaled`` and ``fits_at`` on a small trace built in code (issue 35 item 3)."""

import numpy as np
from builder import SnapBuilder

from oomdoctor.simulate.capacity import Capacity
from oomdoctor.simulate.config import parse_config
from oomdoctor.simulate.replay import prepare
from oomdoctor.simulate.scale import fits_at, scaled
from oomdoctor.trace.load import load

MiB = 1 << 20


def one_block(tmp_path):
    """A 12 MiB segment, a 12 MiB block in it allocated (event 1) and freed."""
    b = SnapBuilder()
    s = b.segment(12 * MiB)
    b.free(b.alloc(s, 0, 12 * MiB))
    return prepare(load(b.write(tmp_path / "one.pickle")))


def test_scaled_grows_the_marked_requests_rounded_up(tmp_path):
    p = one_block(tmp_path)
    marked = np.zeros(p.device.num_events, dtype=bool)
    marked[1] = True
    assert p.requests[1] == 12 * MiB
    s = scaled(p, marked, 1.0 + 1 / (12 * MiB) / 2)  # half a byte more: rounded up to one
    assert s.requests[1] == 12 * MiB + 1 and s is not p and p.requests[1] == 12 * MiB
    assert scaled(p, ~marked, 3.0).requests.tolist() == p.requests.tolist()  # only marked requests grow
    assert (scaled(p, marked | True, 0.5).requests == np.where(p.requests > 0, p.requests // 2, 0)).all()


def test_fits_at_keeps_the_margin_free_and_the_capacitys_source(tmp_path):
    p = one_block(tmp_path)
    marked = np.zeros(p.device.num_events, dtype=bool)
    marked[1] = True
    cap = Capacity(limit_bytes=30 * MiB, kind="fraction", source="fallbacks", certainty="bounded",
                   lower_bytes=30 * MiB, upper_bytes=40 * MiB, evidence="fallbacks", source_values={"runs": 2})
    r = fits_at(p, marked, 2.0, cap, margin_bytes=6 * MiB)  # 24 MiB under 24 MiB: fits, at the edge
    assert r.capacity == Capacity(limit_bytes=24 * MiB, kind="fraction", source="fallbacks",
                                  source_values={"runs": 2})
    assert (r.oom, r.peak_reserved_bytes, r.validation) == (None, 24 * MiB, None)
    assert fits_at(p, marked, 2.0, cap, margin_bytes=6 * MiB + 1).oom is not None  # one byte less: it does not
    r = fits_at(p, marked, 2.0, cap)
    assert r.capacity is cap and r.oom is None
    unlimited = Capacity(limit_bytes=None, kind="none", source="no-evidence")
    assert fits_at(p, marked, 10.0, unlimited, margin_bytes=6 * MiB).capacity is unlimited
    es = parse_config("expandable_segments:True")
    assert fits_at(p, marked, 1.0, cap, es).config == es and fits_at(p, marked, 1.0, cap).config == p.recorded_config
