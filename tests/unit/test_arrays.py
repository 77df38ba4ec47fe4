"""analysis/arrays: the sort-based ``distinct``/``distinct_columns`` give exactly what ``np.unique`` gives for the
integer arrays the analyses pass (random cases, empty and one-element arrays included)."""

from __future__ import annotations

import numpy as np
import pytest

from oomdoctor.analysis.arrays import distinct, distinct_columns


@pytest.mark.parametrize("seed", range(20))
def test_distinct_is_np_unique(seed):
    rng = np.random.default_rng(seed)
    for dtype in (np.int64, np.int32, np.int8):
        a = rng.integers(-5, 6, size=int(rng.integers(0, 40))).astype(dtype)
        got, want = distinct(a), np.unique(a, return_counts=True)[0]
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
    a = rng.integers(-3, 4, size=(2, int(rng.integers(0, 30))))
    got, want = distinct_columns(a), np.unique(a, axis=1, return_counts=True)[0]
    assert got.shape == want.shape and got.tolist() == want.tolist()


def test_distinct_of_a_list_and_of_nothing():
    assert distinct([3, 1, 3]).tolist() == [1, 3]
    assert distinct(np.zeros(0, np.int64)).size == 0
    assert distinct_columns(np.zeros((2, 0), np.int64)).shape == (2, 0)
    assert distinct_columns(np.array([[1], [2]])).tolist() == [[1], [2]]


def test_stable_argsort_is_numpys_stable_argsort():
    """Equal to ``np.argsort(kind="stable")`` on ties, negatives, small dtypes, spans that do and do not fit one
    word with the positions (the key sort and the fallback), and lengths 0 to 2."""
    from oomdoctor.analysis.arrays import stable_argsort

    rng = np.random.default_rng(7)
    cases = [rng.integers(0, 5, 1000), rng.integers(-50, 50, 999).astype(np.int8),
             rng.integers(-(1 << 40), 1 << 40, 5000), rng.integers(-(1 << 62), 1 << 62, 3000),
             rng.integers(0, 1 << 20, 777).astype(np.int32), np.array([], dtype=np.int64), np.array([3]),
             np.array([2, 2]), np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, 0, 0]),
             np.array([5, 1, 5, 1], dtype=np.uint64), 140566998286336 + 512 * rng.integers(0, 1 << 20, 4096)]
    for a in cases:
        got = stable_argsort(a)
        assert got.dtype == np.int64 and np.array_equal(got, np.argsort(a, kind="stable")), a.dtype
