from __future__ import annotations

import numpy as np

from slurm_cdgpc.gpu.catalog import catalog_spec
from slurm_cdgpc.model import kind_prior as kp
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from slurm_cdgpc.model.families import time_regressors
from slurm_cdgpc.model.kind_prior import KIND_PRIOR_MIN_SAMPLES, KindPrior

A100 = catalog_spec("A100-SXM4-80GB")


def _statics(n: int) -> JobStatics:
    return JobStatics.of([A100], np.zeros(n, dtype=np.intp), np.ones(n, dtype=np.int64))


def _time_s(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A job whose time is 0.4 core-bound and 0.6 fixed (the fixed prior says 0.7 / 0.3)."""
    return scale * (0.4 / x + 0.6)


def _run(estimator: JobEstimator, scale: np.ndarray, clocks: np.ndarray) -> None:
    n = len(estimator)
    for x in clocks:
        xs = np.full(n, x)
        power = 80.0 + 300.0 * xs
        estimator.observe(xs, np.ones(n), power, _time_s(xs, scale))


def test_a_new_job_starts_from_the_shape_earlier_jobs_on_its_type_showed() -> None:
    est = JobEstimator(EstimatorSettings(kind_prior=True))
    scales = np.array([0.2, 1.0, 3.0, 7.0])  # the shape is shared, the scale is each job's own
    est.add_jobs(_statics(4), kinds=["A100-SXM4-80GB"] * 4)
    _run(est, scales, np.array([1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.9, 1.0]))
    assert est.pool is not None and est.pool.samples.sum() >= KIND_PRIOR_MIN_SAMPLES

    est.add_jobs(_statics(2), kinds=["A100-SXM4-80GB", None])
    new = est.time.theta[4:]
    # the pooled job: the fleet's 0.4 / 0.6 split; the job without a pool: the fixed prior's
    np.testing.assert_allclose(new[0] / new[0].sum(), [0.4, 0.0, 0.6], atol=0.01)
    np.testing.assert_allclose(new[1] / new[1].sum(), [0.7, 0.0, 0.3], atol=1e-9)
    # its first reading at the top clock sets the scale and the shape holds down to 0.6
    x = np.array([1.0, 1.0])
    est.observe(
        np.concatenate([np.full(4, np.nan), x]),
        np.ones(6),
        np.concatenate([np.full(4, np.nan), 80.0 + 300.0 * x]),
        np.concatenate([np.full(4, np.nan), _time_s(x, np.array([5.0, 5.0]))]),
    )
    low = np.full(6, 0.6)
    predicted = est.predict_iteration_s(low, np.ones(6))[4]
    assert abs(predicted / _time_s(np.array([0.6]), np.array([5.0]))[0] - 1.0) < 0.01


def test_a_pool_with_too_few_readings_leaves_the_fixed_prior() -> None:
    est = JobEstimator(EstimatorSettings(kind_prior=True))
    est.add_jobs(_statics(1), kinds=["A100-SXM4-80GB"])
    _run(est, np.array([1.0]), np.array([1.0, 0.9, 0.8]))  # one reading pooled
    assert est.pool is not None and 0 < est.pool.samples.sum() < KIND_PRIOR_MIN_SAMPLES
    est.add_jobs(_statics(1), kinds=["A100-SXM4-80GB"])
    theta = est.time.theta[1]
    np.testing.assert_allclose(theta / theta.sum(), [0.7, 0.0, 0.3], atol=1e-9)


def test_off_kinds_change_nothing() -> None:
    est = JobEstimator(EstimatorSettings(kind_prior=False))
    assert est.pool is None
    est.add_jobs(_statics(3), kinds=["A100-SXM4-80GB"] * 3)
    _run(est, np.ones(3), np.linspace(1.0, 0.6, 30))
    plain = JobEstimator(EstimatorSettings(kind_prior=False))
    plain.add_jobs(_statics(3))
    _run(plain, np.ones(3), np.linspace(1.0, 0.6, 30))
    np.testing.assert_array_equal(est.time.theta, plain.time.theta)
    np.testing.assert_array_equal(est.power.theta, plain.power.theta)


def test_readings_among_co_tenants_and_dropped_rows_stay_out_of_the_pool() -> None:
    est = JobEstimator(EstimatorSettings(kind_prior=True))
    est.add_jobs(_statics(3), kinds=["A100-SXM4-80GB", "A100-SXM4-80GB", None])
    n = 3
    for x in (1.0, 0.9, 0.8, 0.7):
        xs = np.full(n, x)
        est.observe(
            xs,
            np.ones(n),
            80.0 + 300.0 * xs,
            _time_s(xs, np.ones(n)),
            cotenants=np.array([0, 7, 0], dtype=np.int64),  # the second shares its GPU
        )
    assert est.pool is not None
    # only the first job, from its third reading on (its time model has its scale by then)
    assert int(est.pool.samples.sum()) == 2
    est.keep(np.array([False, True, True]))
    np.testing.assert_array_equal(est.kind, [0, -1])


def test_readings_a_power_limit_held_stay_out_of_the_pool() -> None:
    est = JobEstimator(EstimatorSettings(kind_prior=True))
    est.add_jobs(_statics(2), kinds=["A100-SXM4-80GB"] * 2)
    for x in (1.0, 0.9, 0.8, 0.7, 1.0, 1.0):
        xs = np.full(2, x)
        # the second job's board limit holds it at 300 W above 0.7 of top: it ran below its
        # lock there, and its reading is not what that lock draws
        held = np.array([False, x > 0.7])
        est.observe(
            xs,
            np.ones(2),
            np.where(held, 300.0, 80.0 + 300.0 * xs),
            _time_s(xs, np.ones(2)),
            power_capped=held,
        )
    assert est.pool is not None
    # from the third reading on: the first job's four, the second's one at 0.7
    assert int(est.pool.samples.sum()) == 5


def test_pooled_fit_is_least_squares_over_every_reading() -> None:
    pool = KindPrior(3, 1e3)
    kind = pool.ids(["a"] * 50)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, 50)
    phi_t = time_regressors(x, np.ones(50), np.zeros(50))
    truth = np.array([0.3, 0.0, 0.7])
    phi_p = np.stack([x, np.zeros(50), np.ones(50)], axis=1)
    pool.learn(kind, phi_p, phi_p @ np.array([250.0, 0.0, 60.0]), phi_t, phi_t @ truth)
    got = pool.models(pool.ids(["a", "b"]))
    np.testing.assert_array_equal(got.ready, [True, False])
    np.testing.assert_allclose(got.time_theta[0], truth, atol=1e-3)
    np.testing.assert_allclose(got.power_theta[0], [250.0, 0.0, 60.0], rtol=1e-6)


def _readings(n: int, kinds: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.4, 1.0, n)
    phi_p = np.stack([x, x**3, rng.uniform(0.5, 1.0, n), np.ones(n)], axis=1)
    phi_t = time_regressors(x, np.ones(n), np.ones(n))
    return rng.integers(0, kinds, n), phi_p, rng.uniform(80.0, 700.0, n), phi_t, rng.random(n)


def test_pooled_sums_do_not_depend_on_how_the_readings_are_batched() -> None:
    """One call with more rows than a pass takes, and the same rows one at a time: the same
    sums to the last bit (each sum takes its rows in their order, whatever the batch)."""
    kind, phi_p, power_w, phi_t, time_rel = _readings(kp._CHUNK + 301, 7)
    names = [str(i) for i in range(7)]
    at_once, one_by_one = KindPrior(4, 1e3), KindPrior(4, 1e3)
    at_once.ids(names)
    one_by_one.ids(names)
    at_once.learn(kind, phi_p, power_w, phi_t, time_rel)
    for r in range(kind.shape[0]):
        one_by_one.learn(
            kind[r : r + 1],
            phi_p[r : r + 1],
            power_w[r : r + 1],
            phi_t[r : r + 1],
            time_rel[r : r + 1],
        )
    np.testing.assert_array_equal(at_once.sums, one_by_one.sums)
    np.testing.assert_array_equal(at_once.samples, np.bincount(kind, minlength=7))


def test_pooled_matrices_are_the_full_sums_of_outer_products() -> None:
    """The pool keeps upper triangles; the fits see the whole symmetric sums, bit for bit what
    adding every row's full φφᵀ gives."""
    kind, phi_p, power_w, phi_t, time_rel = _readings(500, 3, seed=1)
    pool = KindPrior(4, 1e3)
    ids = pool.ids(["a", "b", "c"])
    pool.learn(kind, phi_p, power_w, phi_t, time_rel)
    lay, sums = pool.layout, pool.sums
    gram, info = np.zeros((3, 4, 4)), np.zeros((3, 4, 4))
    time_gram, time_rhs = np.zeros((3, 3, 3)), np.zeros((3, 3))
    for r in range(kind.shape[0]):
        outer = np.outer(phi_p[r], phi_p[r])
        gram[kind[r]] += outer
        info[kind[r]] += outer / power_w[r] ** 2
        time_gram[kind[r]] += np.outer(phi_t[r], phi_t[r])
        time_rhs[kind[r]] += phi_t[r] * time_rel[r]
    np.testing.assert_array_equal(kp._symmetric(sums[:, lay.power_gram], lay.p_i, lay.p_j, 4), gram)
    np.testing.assert_array_equal(kp._symmetric(sums[:, lay.power_info], lay.p_i, lay.p_j, 4), info)
    np.testing.assert_array_equal(
        kp._symmetric(sums[:, lay.time_gram], lay.t_i, lay.t_j, 3), time_gram
    )
    np.testing.assert_array_equal(sums[:, lay.time_rhs], time_rhs)
    assert pool.models(ids).power_cov.shape == (3, 4, 4)


def _pooled_after(scatter: float) -> JobEstimator:
    """An estimator whose A100 pool learned four jobs drawing its power family's
    `_KIND_THETA` curve, each reading scattered by ``scatter`` (relative), and one new job of
    that kind that has started from it."""
    est = JobEstimator(EstimatorSettings(kind_prior=True))
    est.add_jobs(_statics(4), kinds=["A100-SXM4-80GB"] * 4)
    rng = np.random.default_rng(1)
    for x in (1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.9, 1.0, 0.75, 0.65):
        xs = np.full(4, x)
        watts = est.power_regressors(xs, np.ones(4)) @ _KIND_THETA
        watts *= 1.0 + scatter * rng.standard_normal(4)
        est.observe(xs, np.ones(4), watts, _time_s(xs, np.ones(4)))
    est.add_jobs(_statics(1), kinds=["A100-SXM4-80GB"])
    assert est.pooled.tolist() == [False] * 4 + [True]
    return est


#: the kind's power curve in the shipped family's regressors
_KIND_THETA = np.array([300.0, 0.0, 80.0])


def _watts(est: JobEstimator, x: float) -> float:
    return float(est.predict_power_w(np.full(len(est), x), np.ones(len(est)))[-1])


def _observe_last(est: JobEstimator, x: float, power_w: float) -> None:
    n = len(est)
    xs = np.where(np.arange(n) == n - 1, x, np.nan)
    est.observe(xs, np.ones(n), np.where(np.isnan(xs), np.nan, power_w), _time_s(xs, np.ones(n)))


def test_a_pooled_power_model_is_not_rescaled_by_its_first_reading() -> None:
    est = _pooled_after(0.0)
    kind_low, kind_top = _watts(est, 0.6), _watts(est, 1.0)
    _observe_last(est, 0.6, 1.1 * kind_low)  # its first reading, at the floor: 10 % above
    # rescaled, the whole curve would move 10 %; the reading teaches the kind's exactly
    # fitted curve through RLS instead, as one reading against the pool's ten
    assert _watts(est, 1.0) < 1.03 * kind_top
    assert kind_low < _watts(est, 0.6) < 1.03 * kind_low
    assert not est.pooled[:4].any()


def test_a_pooled_power_model_weighs_what_its_fit_explains() -> None:
    # one kind its family fits exactly, one whose readings scatter 5 % about the curve: the
    # scattered pool weighs (1 % / 5 %)² of a reading, and its job's own readings move it
    exact, noisy = _pooled_after(0.0), _pooled_after(0.05)
    before = [_watts(est, 0.8) for est in (exact, noisy)]
    for est, watts in zip((exact, noisy), before, strict=True):
        _observe_last(est, 0.8, 1.2 * watts)
    assert _watts(exact, 0.8) < 1.03 * before[0]
    assert _watts(noisy, 0.8) > 1.15 * before[1]
