"""A dataset's three splits, and how a split missing from the source is carved from the train data."""

from __future__ import annotations

from train.errors import DataError

SPLITS = ("train", "val", "test")


def split_ranges(n: int, test_fraction: float, val_fraction: float, test_first: bool = True) -> dict[str, range]:
    """Contiguous test/val/train ranges in PDEBench's order for the family's style.

    test_first (single-file): test is the FIRST share, val follows, train is the rest.
    Otherwise (group-per-seed): test is the LAST share, val is just before it, train is the front.
    A positive test fraction keeps at least one test sample; a zero one (the test split comes from its own
    file) takes none, so no training sample is lost.
    """
    n_test = max(1, round(n * test_fraction)) if test_fraction > 0 else 0
    n_val = round(n * val_fraction)
    n_train = n - n_test - n_val
    if n_train < 1:
        raise DataError(f"{n} samples are too few to split into test={n_test}, val={n_val} and a training set")
    if test_first:
        return {"test": range(0, n_test), "val": range(n_test, n_test + n_val), "train": range(n_test + n_val, n)}
    return {"train": range(0, n_train), "val": range(n_train, n_train + n_val), "test": range(n_train + n_val, n)}
