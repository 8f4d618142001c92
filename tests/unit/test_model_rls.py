from __future__ import annotations

import numpy as np
import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.rls import Rls, RlsSettings, finite_rows


def _random_regressors(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.uniform(0.5, 1.0, n)
    return np.stack([x, x**2, np.ones(n)], axis=1)


def test_recovers_known_coefficients_for_every_job_at_once() -> None:
    rng = np.random.default_rng(0)
    n = 200
    truth = rng.uniform(0.5, 5.0, (n, 3))
    rls = Rls(np.zeros((n, 3)), RlsSettings(forgetting=1.0, initial_cov=1e6))
    for _ in range(60):
        phi = _random_regressors(rng, n)
        y = np.einsum("nk,nk->n", phi, truth) * (1 + 0.001 * rng.standard_normal(n))
        rls.update(phi, y)
    err = np.abs(rls.theta - truth)
    assert np.median(err) < 0.05
    # the prediction is what the controller uses: it must be close for every job
    phi = _random_regressors(rng, n)
    rel = np.abs(rls.predict(phi) - np.einsum("nk,nk->n", phi, truth)) / np.einsum(
        "nk,nk->n", phi, truth
    )
    assert rel.max() < 0.005


def test_forgetting_tracks_a_change_that_plain_least_squares_averages_away() -> None:
    rng = np.random.default_rng(1)
    before, after = np.array([[2.0, 1.0, 3.0]]), np.array([[4.0, 1.0, 1.0]])

    def final_error(forgetting: float) -> float:
        rls = Rls(np.zeros((1, 3)), RlsSettings(forgetting=forgetting, outlier_sigmas=1e9))
        for k in range(200):
            truth = before if k < 100 else after
            phi = _random_regressors(rng, 1)
            rls.update(phi, np.einsum("nk,nk->n", phi, truth))
        phi = _random_regressors(rng, 1)
        return float(abs(rls.predict(phi)[0] - (phi @ after[0])[0]) / (phi @ after[0])[0])

    assert final_error(0.9) < 1e-3
    assert final_error(1.0) > 10 * final_error(0.9)


def test_nonnegativity_projection_keeps_collinear_fits_stable() -> None:
    # φ = [1/x, 1] near x = 1 is nearly collinear; a 10x-off prior used to send θ to ±∞
    rls = Rls(np.array([[0.7, 0.3]]), RlsSettings(forgetting=0.98), nonneg=np.array([True, True]))
    clocks = np.arange(1410, 850, -15) / 1410
    for x in clocks:
        phi = np.array([[1 / x, 1.0]])
        rls.update(phi, np.array([0.05 / x + 0.045]))
        assert np.all(rls.theta >= 0)
    assert rls.predict(np.array([[1 / 0.6, 1.0]]))[0] == pytest.approx(0.05 / 0.6 + 0.045, rel=0.02)


def test_covariance_stays_bounded_when_the_regressor_stops_moving() -> None:
    settings = RlsSettings(forgetting=0.9, max_trace=500.0)
    rls = Rls(np.zeros((3, 3)), settings)
    phi = np.tile([0.8, 0.64, 1.0], (3, 1))
    for _ in range(500):
        rls.update(phi, np.full(3, 100.0))
    assert np.all(np.einsum("nii->n", rls.cov) <= 500.0 * (1 + 1e-9))
    assert np.all(np.isfinite(rls.theta))


def test_single_outlier_is_skipped_but_a_lasting_shift_is_learned() -> None:
    rng = np.random.default_rng(2)
    truth = np.array([[3.0, 0.0, 1.0]])
    rls = Rls(np.zeros((1, 3)), RlsSettings(forgetting=0.95))
    for _ in range(30):
        phi = _random_regressors(rng, 1)
        rls.update(phi, phi @ truth[0] * (1 + 0.002 * rng.standard_normal(1)))
    theta_before = rls.theta.copy()
    phi = _random_regressors(rng, 1)
    report = rls.update(phi, phi @ truth[0] * 3.0)  # a checkpoint interval
    assert report.outliers == 1 and report.updated == 0
    np.testing.assert_array_equal(rls.theta, theta_before)
    shifted = truth * 1.5  # the job really changed phase: from then on it must be learned
    learned = 0
    for _ in range(60):
        phi = _random_regressors(rng, 1)
        learned += rls.update(phi, phi @ shifted[0]).updated
    assert learned >= 55
    phi = _random_regressors(rng, 1)
    assert rls.predict(phi)[0] == pytest.approx((phi @ shifted[0])[0], rel=0.05)


def test_masked_and_unmeasured_jobs_are_left_alone() -> None:
    rls = Rls(np.ones((3, 3)), RlsSettings())
    phi = np.tile([1.0, 1.0, 1.0], (3, 1))
    report = rls.update(phi, np.array([10.0, np.nan, 10.0]), mask=np.array([True, True, False]))
    assert report.updated == 1
    np.testing.assert_array_equal(rls.theta[1:], np.ones((2, 3)))
    assert not np.array_equal(rls.theta[0], np.ones(3))


def test_job_churn_appends_and_drops_rows() -> None:
    rls = Rls(np.ones((2, 3)), RlsSettings())
    rls.append(np.full((3, 3), 2.0))
    assert rls.n == 5 and rls.cov.shape == (5, 3, 3)
    rls.keep(np.array([True, False, True, False, True]))
    np.testing.assert_array_equal(rls.theta[:, 0], [1.0, 2.0, 2.0])
    assert rls.count.shape == (3,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forgetting": 0.0}, "forgetting factor"),
        ({"forgetting": 1.5}, "forgetting factor"),
        ({"initial_cov": -1.0}, "covariance"),
        ({"outlier_sigmas": 0.0}, "outlier"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InputError, match=message):
        RlsSettings(**kwargs)


def test_finite_rows_is_whether_every_entry_of_a_row_is_finite() -> None:
    a = np.ones((6, 3))
    a[1, 0], a[2, 1], a[3, 2], a[4, :] = np.nan, np.inf, -np.inf, np.nan
    np.testing.assert_array_equal(finite_rows(a), [True, False, False, False, False, True])
    np.testing.assert_array_equal(finite_rows(a), np.isfinite(a).all(axis=1))
