"""engine.batch: the bucket a size rounds up to, and the refusal past the largest."""

import pytest

from qwen35_lib.engine.batch import bucket


def test_bucket_is_the_smallest_that_holds_n():
    buckets = (1, 4, 16, 64)
    assert [bucket(n, buckets) for n in (0, 1, 2, 4, 5, 16, 17, 64)] == [1, 1, 4, 4, 16, 16, 64, 64]
    with pytest.raises(ValueError, match="65 exceeds the largest bucket 64"):
        bucket(65, buckets)
