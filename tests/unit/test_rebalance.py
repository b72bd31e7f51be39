import numpy as np
import pyarrow as pa
import pytest

from rayload.data import rebalance as rb


def labels(n_pos=1000, n_neg=9000):
    y = np.array([1.0] * n_pos + [0.0] * n_neg)
    u = np.random.default_rng(0).random(len(y))
    return y, u


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.25])
def test_downsample_reaches_target_ratio(ratio):
    y, u = labels()
    plan = rb.plan_rebalance("downsample", ratio, {1.0: 1000, 0.0: 9000})
    copies = rb.multiplicity(y, u, plan)
    pos, neg = copies[y == 1].sum(), copies[y == 0].sum()
    assert pos == 1000  # the minority is untouched
    assert abs(pos / neg - ratio) < 0.06 * ratio


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_upsample_repeats_the_minority(ratio):
    y, u = labels()
    plan = rb.plan_rebalance("upsample", ratio, {1.0: 1000, 0.0: 9000})
    copies = rb.multiplicity(y, u, plan)
    assert copies[y == 0].sum() == 9000
    assert abs(copies[y == 1].sum() / 9000 - ratio) < 0.03
    table = rb.apply(pa.table({"y": y}), y, u, plan)
    assert table.num_rows == copies.sum()


def test_class_weights_balance_the_loss():
    plan = rb.plan_rebalance("class_weights", 1.0, {1.0: 1000, 0.0: 9000})
    w = dict(plan.class_weights)
    assert w[1.0] * 1000 == pytest.approx(w[0.0] * 9000)
    assert w[1.0] * 1000 + w[0.0] * 9000 == pytest.approx(10_000)
    y, u = labels()
    assert (rb.multiplicity(y, u, plan) == 1).all()  # weights change the loss, not the rows


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_class_weights_reach_the_target_ratio_asked(ratio):
    """target_ratio was ignored: every class was weighted to 1:1, as with ratio 1.0."""
    w = dict(rb.plan_rebalance("class_weights", ratio, {1.0: 1000, 0.0: 9000}).class_weights)
    assert w[1.0] * 1000 == pytest.approx(ratio * w[0.0] * 9000)
    assert w[1.0] * 1000 + w[0.0] * 9000 == pytest.approx(10_000)
    # data already at least as balanced as asked keeps weights of 1 (never lightens the minority)
    assert dict(rb.plan_rebalance("class_weights", 0.5, {1.0: 600, 0.0: 1000}).class_weights) == pytest.approx({0.0: 1.0, 1.0: 1.0})


def test_already_balanced_data_is_left_alone():
    plan = rb.plan_rebalance("downsample", 0.5, {1.0: 600, 0.0: 1000})
    assert plan.method == "none"


def test_decisions_are_deterministic_per_row():
    y, u = labels()
    plan = rb.plan_rebalance("downsample", 1.0, {1.0: 1000, 0.0: 9000})
    a = rb.multiplicity(y, u, plan)
    b = np.concatenate([rb.multiplicity(y[:4000], u[:4000], plan), rb.multiplicity(y[4000:], u[4000:], plan)])
    np.testing.assert_array_equal(a, b)


def test_downsampling_that_would_keep_a_handful_of_rows_is_refused_naming_the_counts():
    """One positive among 342 negatives: downsampling kept each negative with probability 1/342, so
    with seed 6 none was kept, and the model trained on one row of one class without a word."""
    from rayload.errors import DataError

    with pytest.raises(DataError, match=r"rebalance.method downsample: the training split has 1 row\(s\) of label 1 and 342 of "
                                        r"label 0; keeping 1 / target_ratio 1 of the latter, .* keeps about 1.0, and none at all "
                                        r"with probability 36.7"):
        rb.plan_rebalance("downsample", 1.0, {1.0: 1, 0.0: 342})
    with pytest.raises(DataError, match=r"keeping 3 / target_ratio 0.5 of the latter, .* keeps about 6.0, and none at all with "
                                        r"probability 0.2"):
        rb.plan_rebalance("downsample", 0.5, {1.0: 3, 0.0: 342})
    assert rb.plan_rebalance("downsample", 1.0, {1.0: 10, 0.0: 342}).method == "downsample"  # 10 kept on average
    assert rb.plan_rebalance("downsample", 1.0, {1.0: 9, 0.0: 10}).method == "downsample"  # small but nearly balanced
    assert rb.plan_rebalance("class_weights", 1.0, {1.0: 1, 0.0: 342}).method == "class_weights"
