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
