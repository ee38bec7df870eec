"""The batched first-difference compare (`grouping._first_differences_blocks`) against one slice
compare per pair, where its windows stay inside the row and where they reach past its end."""

import numpy as np
import pytest
from patchgen.kernels.shared_prefix import grouping
from patchgen.kernels.shared_prefix.rows import Arena


def pairs_of(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    first = np.arange(len(seqs) - 1, dtype=np.int64)
    return ids, cu, first, first + 1


def one_slice_each(ids, cu, first, second, skip):
    out = []
    for a, b in zip(first.tolist(), second.tolist()):
        x, y = ids[cu[a] + skip : cu[a + 1]], ids[cu[b] + skip : cu[b + 1]]
        n = min(len(x), len(y))
        differs = np.flatnonzero(x[:n] != y[:n])
        out.append(int(differs[0]) if len(differs) else n)
    return out


@pytest.mark.parametrize("last_length", [64 + 64, 64 + 64 + 128 + 256 + 3, 64 + 10])
def test_windows_that_reach_past_the_row_end_compare_as_slices(last_length):
    """The last pair ends where the row does: its windows fit exactly, or run past the end
    (then the rows are copied with room after them); either way each pair's first difference."""
    rng = np.random.default_rng(last_length)
    shared = rng.integers(1, 4, 700).tolist()
    seqs = [shared[: rng.integers(64, 700)] + rng.integers(1, 4, rng.integers(1, 40)).tolist() for _ in range(9)]
    seqs += [shared[:last_length], shared[:last_length]]  # identical to the end of the row
    ids, cu, first, second = pairs_of(seqs)
    n = np.minimum(cu[first + 1] - cu[first], cu[second + 1] - cu[second])
    got = grouping._first_differences_blocks(ids, None, cu, first, second, 64, n, Arena(np.empty(1 << 16, np.int64)))
    assert got.tolist() == one_slice_each(ids, cu, first, second, 64)


def test_the_row_is_read_in_place_while_every_window_ends_inside_it():
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 1000, 100).tolist()
    # every pair parts in its first block, far from the end of the row
    seqs = [prompt + rng.integers(1, 1000, 30).tolist() for _ in range(6)] + [rng.integers(1, 1000, 400).tolist()]
    ids, cu, first, second = pairs_of(seqs[:-1])
    ids = np.concatenate([ids, np.asarray(seqs[-1], dtype=np.int64)])
    n = np.minimum(cu[first + 1] - cu[first], cu[second + 1] - cu[second])
    scratch = Arena(np.empty(1 << 16, np.int64))
    got = grouping._first_differences_blocks(ids, None, cu, first, second, 64, n, scratch)
    assert got.tolist() == one_slice_each(ids, cu, first, second, 64) == [36] * 5
    assert scratch.used == 0  # no copy of the row
