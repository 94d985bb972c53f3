"""Metrics against scikit-learn, in both F1 conventions."""
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings, strategies as st
from sklearn.metrics import accuracy_score, f1_score

from fglit.metrics import classification_scores, client_average, mean_std, select_round


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.data())
def test_scores_match_sklearn(num_classes, data):
    n = data.draw(st.integers(1, 60))
    y = data.draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n))
    p = data.draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n))
    s = classification_scores(torch.tensor(y), torch.tensor(p), num_classes)
    assert s["n"] == n and np.isclose(s["accuracy"], accuracy_score(y, p))
    assert np.isclose(s["f1_macro"], f1_score(y, p, labels=list(range(num_classes)), average="macro", zero_division=0))
    assert np.isclose(s["f1_macro_present"], f1_score(y, p, average="macro", zero_division=0))


def test_empty_split_is_nan_and_skipped():
    s = classification_scores(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), 3)
    assert s["n"] == 0 and np.isnan(s["accuracy"])
    assert client_average([s["accuracy"], 0.5], [0, 10]) == 0.5


def test_client_average_and_mean_std():
    assert client_average([1.0, 0.0, 0.5], [1, 3, 0]) == 0.25 and client_average([1.0, 0.0], [1, 3], "plain") == 0.5
    with pytest.raises(ValueError, match="weighting"):
        client_average([1.0], [1], "median")
    assert mean_std([0.5, 0.7]) == pytest.approx((0.6, 0.1))


def test_select_round():
    t = pd.DataFrame({"round": [1, 2, 3, 4], "val_accuracy": [0.1, 0.9, 0.9, 0.2]})
    assert select_round(t) == 2 and select_round(t, "last") == 4
    assert select_round(t.assign(val_accuracy=np.nan)) == 4


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 6), st.data())
def test_grouped_scores_equal_per_group_scores(groups, num_classes, data):
    from fglit.metrics import grouped_scores
    n = data.draw(st.integers(0, 50))
    g = torch.tensor(data.draw(st.lists(st.integers(0, groups - 1), min_size=n, max_size=n)), dtype=torch.long)
    y = torch.tensor(data.draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)), dtype=torch.long)
    p = torch.tensor(data.draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)), dtype=torch.long)
    for k, s in enumerate(grouped_scores(g, y, p, groups, num_classes)):
        ref = classification_scores(y[g == k], p[g == k], num_classes)
        assert s["n"] == ref["n"]
        for key in ("accuracy", "f1_macro", "f1_macro_present"):
            assert (np.isnan(s[key]) and np.isnan(ref[key])) or np.isclose(s[key], ref[key])
