"""Metrics against scikit-learn, in both F1 conventions."""
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings, strategies as st
from sklearn.metrics import accuracy_score, f1_score

from fglit.metrics import classification_scores, client_average, client_averages, mean_std, select_round


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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["val", "test"]), st.integers(0, 5),
                          st.one_of(st.floats(0, 1), st.just(float("nan"))), st.one_of(st.floats(0, 1), st.just(float("nan")))),
                min_size=1, max_size=40),
       st.sampled_from(["nodes", "plain"]))
def test_client_averages_is_client_average_per_group(rows, weighting):
    "The grouped form (what `SeedRun.per_round` uses) gives, in every group, what `client_average` gives on that group's rows."
    frame = pd.DataFrame(rows, columns=["round", "split", "n", "accuracy", "auc"])
    got = client_averages(frame, ["round", "split"], ["accuracy", "auc"], weighting)
    groups = frame.groupby(["round", "split"], sort=True)
    assert list(got.index) == list(groups.groups)
    for key, g in groups:
        for col in ("accuracy", "auc"):
            want = client_average(g[col], g["n"], weighting)
            assert (np.isnan(want) and np.isnan(got.loc[key, col])) or got.loc[key, col] == pytest.approx(want, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="weighting"):
        client_averages(frame, ["round"], ["accuracy"], "median")


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


# -- ROC AUC ---------------------------------------------------------------------------------------------------

from sklearn.metrics import roc_auc_score

from fglit.metrics import grouped_roc_auc, roc_auc


def _labels_and_levels(data, num_classes, min_n=0, max_n=40, levels=5):
    "Labels and integer-level scores `[n, C]` (few levels, so ties are common)."
    n = data.draw(st.integers(min_n, max_n))
    y = torch.tensor(data.draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)), dtype=torch.long)
    s = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, levels - 1), min_size=num_classes, max_size=num_classes),
                                        min_size=n, max_size=n)), dtype=torch.float64).reshape(n, num_classes)
    return y, s


def _brute_force_auc(y: torch.Tensor, s: torch.Tensor, num_classes: int) -> float:
    "Pairwise count: over (positive, negative) pairs, 1 if the positive scores higher, 1/2 on a tie; binary: class 1, else macro OvR over defined classes."
    per_class = []
    for c in range(num_classes):
        pos, neg = s[y == c, c].tolist(), s[y != c, c].tolist()
        if not pos or not neg:
            per_class.append(float("nan")); continue
        per_class.append(sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg) / (len(pos) * len(neg)))
    if num_classes == 2:
        return per_class[1]
    defined = [a for a in per_class if not np.isnan(a)]
    return float(np.mean(defined)) if defined else float("nan")


def _same(a: float, b: float) -> bool:
    return (np.isnan(a) and np.isnan(b)) or bool(np.isclose(a, b, rtol=0, atol=1e-12))


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5), st.data())
def test_auc_equals_brute_force_pairwise_count(num_classes, data):
    y, s = _labels_and_levels(data, num_classes)
    assert _same(roc_auc(y, s, num_classes), _brute_force_auc(y, s, num_classes))


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.data())
def test_auc_invariant_under_strictly_increasing_transform(num_classes, data):
    "Map the score levels through any strictly increasing sequence of floats: the same AUC (only the order counts)."
    y, s = _labels_and_levels(data, num_classes, levels=6)
    values = sorted(data.draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=6, max_size=6, unique=True)))
    t = torch.tensor(values, dtype=torch.float64)[s.long()]
    assert _same(roc_auc(y, t, num_classes), roc_auc(y, s, num_classes))
    assert _same(roc_auc(y, torch.exp(s / 2) * 3 - 7, num_classes), roc_auc(y, s, num_classes))


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.data())
def test_auc_is_one_for_separating_scores_and_zero_reversed(num_classes, data):
    y, _ = _labels_and_levels(data, num_classes, min_n=2)
    onehot = torch.nn.functional.one_hot(y, num_classes).double() * data.draw(st.floats(0.1, 10)) + data.draw(st.floats(-5, 5))
    defined = not np.isnan(_brute_force_auc(y, onehot, num_classes))
    assert np.isnan(roc_auc(y, onehot, num_classes)) != defined
    if defined:
        assert roc_auc(y, onehot, num_classes) == 1.0 and roc_auc(y, -onehot, num_classes) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_binary_auc_of_swapped_labels_is_one_minus(data):
    y, s = _labels_and_levels(data, 2)
    a, b = roc_auc(y, s, 2), roc_auc(1 - y, s, 2)
    assert (np.isnan(a) and np.isnan(b)) or np.isclose(a + b, 1.0)
    assert _same(roc_auc(y, s[:, 1], 2), a)                       # a 1-D score is class 1's score


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.data())
def test_auc_matches_sklearn(num_classes, data):
    "scikit-learn as an oracle: binary on class 1's probability; multiclass OvR macro (sklearn needs every class present)."
    y, s = _labels_and_levels(data, num_classes, min_n=1, levels=4)
    p = torch.softmax(s, 1)
    ours = roc_auc(y, p, num_classes)
    present = len(set(y.tolist()))
    if present < 2 or (num_classes > 2 and present < num_classes):
        if present < 2: assert np.isnan(ours)
        return
    ref = roc_auc_score(y.numpy(), p[:, 1].numpy()) if num_classes == 2 else \
        roc_auc_score(y.numpy(), p.numpy(), multi_class="ovr", average="macro", labels=list(range(num_classes)))
    assert np.isclose(ours, ref)


def test_auc_undefined_is_nan():
    assert np.isnan(roc_auc(torch.empty(0, dtype=torch.long), torch.empty(0, 3), 3))
    assert np.isnan(roc_auc(torch.tensor([2, 2, 2]), torch.rand(3, 3), 3))          # one class only
    assert np.isnan(roc_auc(torch.tensor([0, 0]), torch.rand(2, 2), 2))
    assert np.isnan(roc_auc(torch.tensor([0, 1]), torch.tensor([[0.5, 0.5], [float("nan"), float("nan")]]), 2))
    assert roc_auc(torch.tensor([0, 1]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]), 2) == 0.5   # one tie: 1/2


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 5), st.data())
def test_grouped_auc_and_scores_equal_per_group(groups, num_classes, data):
    from fglit.metrics import grouped_scores
    y, s = _labels_and_levels(data, num_classes, max_n=50)
    g = torch.tensor(data.draw(st.lists(st.integers(0, groups - 1), min_size=len(y), max_size=len(y))), dtype=torch.long)
    p = s.argmax(1)
    auc = grouped_roc_auc(g, y, s, groups, num_classes)
    rows = grouped_scores(g, y, p, groups, num_classes, scores=s)
    for k in range(groups):
        ref = classification_scores(y[g == k], p[g == k], num_classes, scores=s[g == k])
        assert _same(float(auc[k]), ref["auc"]) and _same(rows[k]["auc"], ref["auc"])
        assert _same(ref["auc"], _brute_force_auc(y[g == k], s[g == k], num_classes))


def test_classification_scores_keeps_its_keys_and_adds_auc_only_with_scores():
    y, p = torch.tensor([0, 1, 1, 2, 0]), torch.tensor([0, 1, 2, 2, 1])
    probs = torch.softmax(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), 1)
    plain, with_auc = classification_scores(y, p, 3), classification_scores(y, p, 3, scores=probs)
    assert set(plain) == {"n", "accuracy", "f1_macro", "f1_macro_present"}
    assert with_auc == {**plain, "auc": roc_auc(y, probs, 3)}
    assert np.isnan(classification_scores(y[:0], p[:0], 3, scores=probs[:0])["auc"])


def test_the_selection_rule_used_is_named_when_there_is_no_validation_split():
    import pandas as pd
    from fglit.metrics import select_round, selection_used
    no_val = pd.DataFrame({"round": [1, 2, 3], "val_accuracy": [float("nan")] * 3})
    assert select_round(no_val, "best_val") == 3 and selection_used(no_val, "best_val").startswith("last (no validation")
    with_val = pd.DataFrame({"round": [1, 2, 3], "val_accuracy": [0.1, 0.5, 0.2]})
    assert select_round(with_val, "best_val") == 2 and selection_used(with_val, "best_val") == "best_val"
    assert selection_used(no_val, "last") == "last"


@settings(max_examples=60, deadline=None, derandomize=True)
@given(m=st.integers(0, 300), groups=st.integers(1, 7), levels=st.sampled_from([3, 50, 0]), seed=st.integers(0, 10_000))
def test_one_key_sort_of_float32_scores_gives_the_two_sort_auc_exactly(m, groups, levels, seed):
    "float32 scores take the one-int64-key sort; their float64 copies the two stable sorts: every group's AUC is the same."
    from fglit.metrics import _group_auc
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(m, generator=gen)
    if levels:                                             # ties, zeros of both signs, negatives
        s = torch.round(s * levels) / levels
        s[torch.rand(m, generator=gen) < 0.1] = -0.0
    if m and seed % 5 == 0:
        s[int(seed) % m] = float("nan")                    # a NaN score makes its group undefined
    g = torch.randint(0, groups, (m,), generator=gen)
    pos = torch.rand(m, generator=gen) < 0.4
    fast, slow = _group_auc(g, pos, s.float(), groups), _group_auc(g, pos, s.double(), groups)
    assert torch.equal(fast.isnan(), slow.isnan()) and torch.equal(fast[~fast.isnan()], slow[~slow.isnan()])
