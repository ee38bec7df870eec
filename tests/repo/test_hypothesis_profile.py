"""The property tests draw the same examples on every run (issue 14: seed the property tests)."""

import os

from hypothesis import given, settings
from hypothesis import strategies as st

drawn: list[int] = []


@given(st.integers(0, 10**9))
@settings(max_examples=5)
def _draw(value):
    drawn.append(value)


def test_default_profile_is_derandomized_without_a_database():
    if os.environ.get("HYPOTHESIS_PROFILE", "patchgen") == "patchgen":
        assert settings().derandomize is True and settings().database is None


def test_two_runs_draw_the_same_examples():
    drawn.clear()
    _draw()
    first = list(drawn)
    drawn.clear()
    _draw()
    assert drawn == first and len(first) == 5
