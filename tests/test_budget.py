"""The token-budget cut the batcher and the engine share: arrival order, as much as fits, the first always."""

from __future__ import annotations

from pyscore.budget import count_within_budget


def test_takes_the_leading_pieces_that_fit():
    assert count_within_budget([3, 4, 2, 1], 9) == 3  # 3 + 4 + 2 = 9 fits; the 1 would not
    assert count_within_budget([3, 4, 2, 1], 10) == 4
    assert count_within_budget([5, 1, 1], 5) == 1  # no skipping ahead: arrival order is kept


def test_a_piece_over_the_budget_runs_alone():
    assert count_within_budget([20, 1], 8) == 1
    assert count_within_budget([1, 20], 8) == 1


def test_nothing_to_take():
    assert count_within_budget([], 8) == 0
    assert count_within_budget(iter([2, 2]), 8) == 2  # any iterable, read once
