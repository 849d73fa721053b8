"""DP's gradient buckets, one definition for the engine and the live prediction (core/buckets.py)."""

from core.buckets import FIRST_BUCKET_BYTES, plan_buckets


def test_buckets_fill_in_reverse_order_one_per_group_the_first_small():
    mib = 1024 * 1024
    params = [("a", 3 * mib, "dp"), ("b", 1 * mib, "dp"), ("e1", 2 * mib, "dp+cp"), ("c", 2 * mib, "dp"),
              ("solo", 5 * mib, None), ("d", 1 * mib, "dp")]
    plan = plan_buckets(params, bucket_bytes=3 * mib)
    # backward order d, solo (no replica: in no bucket), c, e1, b, a; dp's first bucket closes at 1 MiB (d),
    # its next ones at 3 MiB (c + b = 3, then a); dp+cp's first and only one at e1 (2 MiB >= 1 MiB)
    assert FIRST_BUCKET_BYTES == mib
    assert plan == [("dp", ["d"]), ("dp+cp", ["e1"]), ("dp", ["c", "b"]), ("dp", ["a"])]


def test_a_partly_filled_bucket_closes_at_the_end_in_group_order():
    plan = plan_buckets([("x", 10, "dp"), ("y", 10, "ep"), ("z", 10, "dp")], bucket_bytes=1000)
    assert plan == [("dp", ["z", "x"]), ("ep", ["y"])]
