"""Tests for GPFL's analysis helpers (`fglit.papers.gpfl_analysis`, from nbs/papers/32_gpfl_analysis.ipynb): cost counts, networks, fits, similarities."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fglit.algorithms.gpfl import mixing_matrix, personalised_update, row_normalize
from fglit.papers.gpfl_analysis import (aggregation_madds, group_contrast, linear_fit, links_for_ratio, random_network,
                                 similarity_matrices)


def brute_force_madds(W: torch.Tensor, F: int) -> int:
    "Multiply-adds of theta_i + sum_j w_ij delta_j done entry by entry, skipping zero weights (the discrete update)."
    count = 0
    k = W.size(0)
    for i in range(k):
        for j in range(k):
            if W[i, j] != 0:
                count += F          # one multiply w_ij * delta_j[f] and one add per parameter
    return count


@settings(max_examples=40, deadline=None)
@given(k=st.integers(2, 12), frac=st.floats(0, 1), F=st.integers(1, 50), seed=st.integers(0, 1000))
def test_madds_formula_matches_brute_force(k, frac, F, seed):
    links = int(round(frac * k * (k - 1)))
    A = random_network(k, links, seed)
    assert int(A.sum()) == links and A.diagonal().sum() == 0
    W = mixing_matrix(row_normalize(A), 0.95)
    counts = aggregation_madds(k, links, F)
    assert counts["discrete_madds"] == brute_force_madds(W, F)
    assert counts["dense_madds"] == k * k * F
    assert counts["ratio"] == pytest.approx(k * k / (links + k))
    assert 1.0 <= counts["ratio"] <= k


@settings(max_examples=25, deadline=None)
@given(k=st.integers(2, 10), frac=st.floats(0, 1), seed=st.integers(0, 1000))
def test_discrete_update_equals_dense(k, frac, seed):
    links = int(round(frac * k * (k - 1)))
    W = mixing_matrix(row_normalize(random_network(k, links, seed)), 0.95)
    g = torch.Generator().manual_seed(seed)
    theta, deltas = torch.randn(k, 33, generator=g), torch.randn(k, 33, generator=g)
    torch.testing.assert_close(personalised_update(theta, deltas, W, sparse=True), personalised_update(theta, deltas, W, sparse=False),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [4, 25, 100])
def test_links_for_ratio(k):
    links = links_for_ratio(k, 1.7)
    assert 0 <= links <= k * (k - 1)
    assert abs(k * k / (links + k) - 1.7) < 0.1
    assert links_for_ratio(k, 1.0) == k * (k - 1)         # ratio 1: the full network
    assert links_for_ratio(k, 1e9) == 0


def test_linear_fit():
    x = np.array([15, 20, 25, 50, 75, 100.0])
    f = linear_fit(x, 0.3 + 0.01 * x)
    assert f["slope"] == pytest.approx(0.01) and f["intercept"] == pytest.approx(0.3) and f["r2"] == pytest.approx(1.0)
    noisy = linear_fit(x, 0.3 + 0.01 * x + np.array([0.01, -0.02, 0.0, 0.03, -0.01, 0.0]))
    assert 0.9 < noisy["r2"] < 1.0
    assert linear_fit(x, x ** 2)["r2"] < 1.0                # a parabola is not a line


def test_group_contrast_and_similarities():
    groups = np.array([0, 0, 0, 1, 1, 1])
    S = np.where(groups[:, None] == groups[None, :], 0.9, 0.1)
    c = group_contrast(S, groups)
    assert c["within"] == pytest.approx(0.9) and c["across"] == pytest.approx(0.1) and c["auc"] == 1.0
    assert group_contrast(np.ones((6, 6)), groups)["auc"] == 0.5           # no signal
    g = torch.Generator().manual_seed(0)
    thetas = 10 + torch.randn(6, 200, generator=g)
    for name, M in similarity_matrices(thetas).items():
        assert M.shape == (6, 6)
        torch.testing.assert_close(M, M.T)
        torch.testing.assert_close(M.diagonal(), torch.ones(6, dtype=M.dtype))
    # a large shared offset makes raw parameters look alike; centring (marginal) removes it
    sims = similarity_matrices(thetas)
    assert sims["raw"].min() > 0.98 and sims["marginal"].fill_diagonal_(0).abs().max() < 0.7
