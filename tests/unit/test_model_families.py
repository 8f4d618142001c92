from __future__ import annotations

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FAMILIES, power_family, time_regressors


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_stationary_point_solves_first_order_condition(name: str) -> None:
    fam = power_family(name)
    rng = np.random.default_rng(1)
    n = 500
    a = rng.uniform(50, 300, (n, fam.core_params))
    knee = rng.uniform(0.6, 0.9, n)
    s = rng.uniform(1, 400, n)
    x = fam.stationary(s, a, knee)
    # s/x² = m(x) everywhere except where a bent job sits exactly on its knee (m jumps there)
    on_kink = np.isclose(x, knee) if name == "bent" else np.zeros(n, bool)
    lhs, rhs = s / x**2, fam.marginal(a, x, knee)
    np.testing.assert_allclose(lhs[~on_kink], rhs[~on_kink], rtol=1e-9)
    if on_kink.any():  # the subgradient at the kink spans [a, 3a]
        assert np.all(lhs[on_kink] >= a[on_kink, 0] * (1 - 1e-9))
        assert np.all(lhs[on_kink] <= 3 * a[on_kink, 0] * (1 + 1e-9))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_stationary_point_minimises_the_scalar_problem(name: str) -> None:
    fam = power_family(name)
    a = np.array([[120.0] * fam.core_params])
    knee = np.array([0.77])
    s = np.array([90.0])
    x_star = fam.stationary(s, a, knee)[0]
    grid = np.linspace(0.05, 3.0, 20001)
    theta = np.concatenate([a[0], [0.0, 0.0]])
    power = fam.power(
        np.broadcast_to(theta, (grid.size, theta.size)),
        grid,
        np.ones_like(grid),
        np.zeros_like(grid),
        np.full_like(grid, 0.77),
    )
    cost = s[0] / grid + power
    assert abs(grid[np.argmin(cost)] - x_star) < 2e-4


def test_bent_basis_is_continuous_and_steeper_above_the_knee() -> None:
    fam = power_family("bent")
    knee = np.array([0.8, 0.8])
    x = np.array([0.8 - 1e-9, 0.8 + 1e-9])
    h = fam.basis(x, knee)[:, 0]
    assert abs(h[0] - h[1]) < 1e-8
    m = fam.marginal(np.array([[1.0], [1.0]]), np.array([0.7, 0.95]), knee)
    assert m[0] == pytest.approx(1.0)
    assert m[1] == pytest.approx(3 * 0.95**2 / 0.8**2)


def test_clock_independent_power_gives_infinite_stationary_point() -> None:
    for name in FAMILIES:
        fam = power_family(name)
        x = fam.stationary(np.array([5.0]), np.zeros((1, fam.core_params)), np.array([0.8]))
        assert np.isinf(x[0])


def test_time_regressors_mask_memory_on_hbm() -> None:
    phi = time_regressors(np.array([0.5, 0.5]), np.array([0.8, 0.8]), np.array([1.0, 0.0]))
    np.testing.assert_allclose(phi, [[2.0, 1.25, 1.0], [2.0, 0.0, 1.0]])


def test_unknown_family_is_a_one_line_error() -> None:
    with pytest.raises(InputError, match=r"unknown model family 'quartic' \(known: bent, cubic"):
        power_family("quartic")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_regressors_over_a_horizon_are_the_basis_memory_and_intercept_columns(name: str) -> None:
    """(H, N) clocks against per-job masks and knees: [h(x), mask·x_m, 1] and [1/x, mask/x_m, 1]."""
    fam = power_family(name)
    x = np.array([[0.5, 1.0], [0.8, 0.9]])
    x_m, mask, knee = np.full((2, 2), 0.8), np.array([1.0, 0.0]), np.array([0.7, 0.7])
    phi = fam.regressors(x, x_m, mask, knee)
    assert phi.shape == (2, 2, fam.n_params)
    np.testing.assert_array_equal(phi[..., : fam.core_params], fam.basis(x, knee))
    np.testing.assert_array_equal(phi[..., -2], mask * x_m)
    np.testing.assert_array_equal(phi[..., -1], 1.0)
    phi_t = time_regressors(x, x_m, mask)
    np.testing.assert_array_equal(phi_t, np.stack([1.0 / x, mask / x_m, np.ones_like(x)], axis=-1))
