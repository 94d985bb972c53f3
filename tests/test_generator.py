"""Tests of fglit.algorithms.generator: FedGen's label-conditional generator, its seeded draws, the teachers' ensemble loss and the fitting routine."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from _device import DEV

from fglit.algorithms.generator import (LabelConditionalGenerator, diversity_loss, ensemble_accuracy, ensemble_logits, fit_generator,
                                        label_weights, sample_labels, sample_noise, teacher_loss, teacher_weights)
from fglit.federation import flat_state, load_flat_state

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def linear_teachers(seed=0, dim=4, classes=3, count=3):
    torch.manual_seed(seed)
    return [nn.Linear(dim, classes).to(DEV) for _ in range(count)]


def fitted(teachers, counts, steps=150, seed=2, **kw):
    torch.manual_seed(0)
    gen = LabelConditionalGenerator(8, counts.size(1), teachers[0].in_features, hidden=(32,)).to(DEV)
    opt = torch.optim.Adam(gen.parameters(), lr=1e-2)
    stats = fit_generator(gen, opt, teachers, label_weights(counts), counts.sum(0), steps, 32,
                          rng=torch.Generator().manual_seed(seed), **kw)
    return gen, stats


# -- the generator --------------------------------------------------------------------------------------------------

def test_generator_shapes_parameters_and_state():
    g = LabelConditionalGenerator(3, 4, 5, hidden=(8, 6))
    assert g(torch.randn(7, 3), torch.randint(0, 4, (7,))).shape == (7, 5)
    assert sum(p.numel() for p in g.parameters()) == (7 * 8 + 8 + 16) + (8 * 6 + 6 + 12) + (6 * 5 + 5)
    assert flat_state(g).numel() == sum(p.numel() for p in g.parameters()) + 2 * (8 + 6)     # + BN running statistics
    e = LabelConditionalGenerator(3, 4, 5, hidden=(), label_embedding=True)
    assert e.out.in_features == 6 and e.condition(torch.tensor([1, 1])).shape == (2, 3)
    assert g.condition(torch.tensor([3])).tolist() == [[0., 0., 0., 1.]]


def test_eval_mode_rows_are_independent_and_state_travels():
    g = LabelConditionalGenerator(4, 3, 2, hidden=(16,))
    g.train(); g(torch.randn(64, 4), torch.randint(0, 3, (64,)))          # moves the running statistics
    g.eval()
    z, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    assert torch.allclose(g(z, y)[:3], g(z[:3], y[:3]))
    other = LabelConditionalGenerator(4, 3, 2, hidden=(16,)).eval()
    load_flat_state(other, flat_state(g))
    assert torch.equal(other(z, y), g(z, y))


# -- draws ------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 4.0]), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
       st.integers(0, 2**31 - 1))
def test_labels_are_seeded_and_never_of_weight_zero(weights, seed):
    p = torch.tensor(weights)
    a = sample_labels(p, 300, torch.Generator().manual_seed(seed))
    assert torch.equal(a, sample_labels(p, 300, torch.Generator().manual_seed(seed)))
    assert a.dtype == torch.long and bool((p[a] > 0).all())


def test_label_frequencies_follow_the_distribution():
    a = sample_labels(torch.tensor([1., 0., 3.]), 20000, torch.Generator().manual_seed(0))
    freq = torch.bincount(a, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.25, 0.0, 0.75]), atol=0.015)


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.tensor([1., -1.]), torch.ones(2, 2), torch.tensor([1., float("nan")])])
def test_bad_label_distributions_are_refused(bad):
    with pytest.raises(ValueError, match="label distribution"):
        sample_labels(bad, 4)


def test_noise_kinds_and_device():
    z = sample_noise(4000, 3, "uniform", torch.Generator().manual_seed(0), DEV)
    assert z.device.type == DEV.type and float(z.min()) >= 0 and float(z.max()) < 1
    n = sample_noise(4000, 3, "gaussian", torch.Generator().manual_seed(0))
    assert abs(float(n.mean())) < 0.05 and abs(float(n.std()) - 1) < 0.05
    assert torch.equal(n, sample_noise(4000, 3, rng=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="noise"):
        sample_noise(2, 2, "laplace")


# -- the teachers' weights and ensemble (shared with FedTAD) ---------------------------------------------------------

score_matrices = st.integers(1, 6).flatmap(lambda K: st.integers(1, 5).flatmap(lambda C: st.lists(
    st.lists(st.one_of(st.just(0.0), st.floats(0, 50)), min_size=C, max_size=C), min_size=K, max_size=K)))


@settings(max_examples=60, deadline=None)
@given(scores=score_matrices, seed=st.integers(0, 10_000))
def test_teacher_weights_are_convex_per_label_and_permutation_equivariant(scores, seed):
    R = torch.tensor(scores, dtype=torch.float64)
    K, C = R.shape
    W = teacher_weights(R)
    assert W.shape == (K, C) and W.dtype == torch.float64 and ((W >= 0) & (W <= 1)).all()
    known = R.sum(0) > 0
    assert torch.allclose(W.sum(0)[known], torch.ones(int(known.sum()), dtype=torch.float64)) and (W[:, ~known] == 0).all()
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    assert torch.allclose(teacher_weights(R[perm]), W[perm])
    assert torch.allclose(teacher_weights(3.5 * R), W)                          # scale-free


@pytest.mark.parametrize("bad", [torch.tensor([[1.0, -1.0]]), torch.tensor([[float("inf"), 1.0]]), torch.ones(3)])
def test_teacher_weights_refuse_bad_scores(bad):
    with pytest.raises(ValueError, match="finite"):
        teacher_weights(bad)


def test_ensemble_by_hand_and_equal_weights_give_the_mean():
    w = teacher_weights(torch.tensor([[3., 0.], [1., 2.]]))
    assert torch.equal(ensemble_logits(torch.tensor([[[4., 0.], [4., 0.]], [[0., 4.], [0., 4.]]]), w, torch.tensor([0, 1])),
                       torch.tensor([[3., 1.], [0., 4.]]))                 # label 0: 3/4 and 1/4; label 1: the second teacher only
    t = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(ensemble_logits(t, teacher_weights(torch.ones(5, 3)), torch.tensor([0, 1, 2, 0, 1, 2, 0])), t.mean(0))


def test_diversity_loss_by_hand_range_and_gradient():
    assert diversity_loss(torch.tensor([[0.], [1.]]), torch.tensor([[0., 0.], [2., 0.]])).item() == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert diversity_loss(torch.zeros(4, 3), torch.randn(4, 5)).item() == 1.0          # one noise: nothing to spread
    g = torch.Generator().manual_seed(1)
    z, x = torch.randn(6, 3, generator=g), torch.randn(6, 5, generator=g, requires_grad=True)
    loss = diversity_loss(z, x)
    assert 0 < loss.item() < 1 and diversity_loss(z, 2 * x).item() < loss.item()       # spreading the outputs lowers it
    loss.backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


# -- the teachers' loss -------------------------------------------------------------------------------------------

def test_teacher_loss_by_hand():
    w = label_weights(torch.tensor([[3., 0.], [1., 2.]]))
    assert torch.equal(w, torch.tensor([[0.75, 0.], [0.25, 1.]]))
    t = torch.tensor([[[math.log(3), 0.]], [[0., math.log(3)]]])
    assert teacher_loss(t, w, torch.tensor([0])).item() == pytest.approx(math.log(1 + 3 ** -0.5), rel=1e-6)
    assert teacher_loss(t, w, torch.tensor([0]), "losses").item() == pytest.approx(0.75 * math.log(4 / 3) + 0.25 * math.log(4), rel=1e-6)
    with pytest.raises(ValueError, match="ensemble"):
        teacher_loss(t, w, torch.tensor([0]), "votes")


@SETTINGS
@given(st.integers(1, 4), st.integers(2, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_one_holder_per_label_makes_both_forms_its_cross_entropy(T, C, n, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, n, C, generator=g, dtype=torch.float64)
    owner = torch.randint(0, T, (C,), generator=g)
    weights = F.one_hot(owner, T).T.to(torch.float64)                  # [T, C]: each label held by one teacher
    labels = torch.randint(0, C, (n,), generator=g)
    own = F.cross_entropy(logits[owner[labels], torch.arange(n)], labels)
    assert torch.allclose(teacher_loss(logits, weights, labels), own)
    assert torch.allclose(teacher_loss(logits, weights, labels, "losses"), own)


@SETTINGS
@given(st.integers(2, 4), st.integers(2, 4), st.integers(0, 2**31 - 1))
def test_weighted_losses_bound_the_loss_of_weighted_logits(T, C, seed):
    # cross-entropy is convex in the logits: CE(sum_k a_k g_k) <= sum_k a_k CE(g_k) for convex weights (Jensen)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, 5, C, generator=g, dtype=torch.float64) * 3
    r = torch.rand(T, C, generator=g, dtype=torch.float64) + 0.1
    weights = r / r.sum(0)                                              # each label's column sums to 1
    labels = torch.randint(0, C, (5,), generator=g)
    assert teacher_loss(logits, weights, labels).item() <= teacher_loss(logits, weights, labels, "losses").item() + 1e-12


# -- fitting ------------------------------------------------------------------------------------------------------

COUNTS = torch.tensor([[5., 5., 0.], [5., 0., 5.], [0., 0., 0.]])


def test_fit_against_fixed_linear_teachers():
    teachers = linear_teachers()
    with torch.no_grad():       # the third teacher holds no label: its (negated) view must not matter
        teachers[2].weight.copy_(-teachers[0].weight); teachers[2].bias.copy_(-teachers[0].bias)
    alpha, prior = label_weights(COUNTS), COUNTS.sum(0)
    before = LabelConditionalGenerator(8, 3, 4, hidden=(32,)).to(DEV)
    gen, stats = fitted(teachers, COUNTS, steps=200)
    assert ensemble_accuracy(before, teachers, alpha, prior, rng=torch.Generator().manual_seed(1)) < 0.6
    assert ensemble_accuracy(gen, teachers, alpha, prior, rng=torch.Generator().manual_seed(1)) > 0.97
    assert set(stats) == {"teacher", "diversity", "extra", "loss", "accuracy"} and stats["extra"] == 0.0
    assert all(p.grad is None for t in teachers for p in t.parameters()) and not gen.training


def test_fit_is_deterministic_under_its_seed():
    teachers = linear_teachers(1)
    (a, sa), (b, sb), (c, _) = fitted(teachers, COUNTS, 40), fitted(teachers, COUNTS, 40), fitted(teachers, COUNTS, 40, seed=3)
    assert sa == sb and torch.equal(flat_state(a), flat_state(b)) and not torch.equal(flat_state(a), flat_state(c))


def test_extra_losses_see_the_batch_and_change_the_objective():
    teachers, seen = linear_teachers(2), []

    def pull(x, z, labels, logits):
        seen.append((x.shape, z.shape, labels.shape, logits.shape, x.requires_grad))
        return ((x[:, 0] - 5) ** 2).mean()

    gen, stats = fitted(teachers, COUNTS, 150, extra_losses=[pull])
    assert seen[0] == ((32, 4), (32, 8), (32,), (3, 32, 3), True) and len(seen) == 150 and stats["extra"] > 0
    with torch.no_grad():
        y = sample_labels(COUNTS.sum(0), 300, torch.Generator().manual_seed(0)).to(DEV)
        x = gen(sample_noise(300, 8, rng=torch.Generator().manual_seed(0), device=DEV), y)
    assert abs(float(x[:, 0].mean()) - 5) < 1.0


def test_diversity_weight_spreads_the_outputs():
    teachers = linear_teachers(3)
    spread = []
    for eta in (0.0, 50.0):
        gen, _ = fitted(teachers, COUNTS, 150, diversity_weight=eta)
        with torch.no_grad():
            y = torch.zeros(200, dtype=torch.long, device=DEV)
            spread.append(float(gen(sample_noise(200, 8, rng=torch.Generator().manual_seed(0), device=DEV), y).std(0).mean()))
    assert spread[1] > spread[0]


def test_zero_steps_change_nothing():
    teachers = linear_teachers()
    gen = LabelConditionalGenerator(8, 3, 4, hidden=(32,)).to(DEV)
    before = flat_state(gen).clone()
    assert fit_generator(gen, torch.optim.Adam(gen.parameters()), teachers, label_weights(COUNTS), COUNTS.sum(0), 0, 32) == {}
    assert torch.equal(before, flat_state(gen))
