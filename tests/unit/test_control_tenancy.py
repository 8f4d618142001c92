"""Jobs that share GPUs: one clock per group, weighed on the sum of its tenants' pressures."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from slurm_cdgpc.control.discrete import ClockGrid
from slurm_cdgpc.control.domains import DomainLimits
from slurm_cdgpc.control.empc import ControllerSettings, EconomicMPC, JobState, Measurements
from slurm_cdgpc.control.tenancy import Interference, Tenancy, cotenant_key
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import JobEstimator
from tests.unit.problems import A100, a100_estimator


def _estimator(gpus: list[int], power_w: list[float], iteration_s: list[float]) -> JobEstimator:
    n = len(gpus)
    est = a100_estimator(gpus, iteration_s)
    for x in (1.0, 0.8, 0.6):  # three intervals on a simple power curve: the models are known
        one = np.full(n, x)
        est.observe(
            one, np.ones(n), np.array(power_w) * (0.4 + 0.6 * x**3), np.array(iteration_s) / x
        )
    return est


def _jobs(n: int, deadline_s: list[float], tenancy: Tenancy | None) -> JobState:
    return JobState(
        gpu_type=np.zeros(n, dtype=np.int64),
        remaining_iterations=np.full(n, 1000.0),
        deadline_s=np.array(deadline_s),
        tenancy=tenancy,
    )


def _mpc() -> EconomicMPC:
    return EconomicMPC(ClockGrid.from_tables([("A100", A100)], min_fraction=0.5))


def test_groups_are_the_jobs_whose_gpus_overlap_transitively() -> None:
    assert Tenancy.of_gpus([["a0"], ["a1"], ["b0"]]) is None  # nothing shared
    t = Tenancy.of_gpus([["a0", "a1"], ["b0"], ["a1", "a2"], ["a2"], ["b1"]])
    assert t is not None
    assert t.group.tolist() == [0, 1, 0, 0, 2]
    assert t.gpus.tolist() == [3.0, 1.0, 1.0]  # a0, a1, a2 under one clock
    assert t.tenants().tolist() == [3, 1, 1]
    # a job's own part of what its GPUs draw: its group's power split between its tenants
    np.testing.assert_allclose(t.attribution(np.array([2.0, 1, 2, 1, 1])), [0.5, 1, 0.5, 1, 1])
    with pytest.raises(InputError, match="numbered"):
        Tenancy(np.array([0, 2]), np.ones(3))


def test_a_group_is_one_row_whose_objective_and_power_are_its_tenants() -> None:
    """Σ_k w_k T_k(x) and the GPU's power once, at any clock: the group's row is exact."""
    est = _estimator([1, 1, 2], [300.0, 300.0, 250.0], [0.5, 0.2, 0.3])
    tenancy = Tenancy(np.array([0, 0, 1]), np.array([1.0, 2.0]))
    jobs = _jobs(3, [3600.0, 900.0, 7200.0], None)
    mpc = _mpc()
    alone = mpc.problem(est, jobs, 0.0, 1e4)
    shared = mpc.problem(est, replace(jobs, tenancy=tenancy), 0.0, 1e4)
    x = np.array([0.55, 0.8, 1.0])
    for xi in x:
        jx, gx = np.full(3, xi), np.full(2, xi)
        one_j, one_g = np.ones(3), np.ones(2)
        each = alone.weight[0] * alone.time_s(jx, one_j)
        np.testing.assert_allclose(
            shared.weight[0] * shared.time_s(gx, one_g), [each[0] + each[1], each[2]]
        )
        # both tenants learnt the one GPU's whole power: the group counts it once
        per_job = alone.power_w(jx, one_j)
        np.testing.assert_allclose(
            shared.power_w(gx, one_g), [(per_job[0] + per_job[1]) / 2, per_job[2]]
        )


def test_tenants_share_one_clock_set_by_their_summed_pressure() -> None:
    """Two jobs on GPU a0, one on a1, each GPU alike: the shared GPU carries two deadlines, so
    it gets the higher clock; the plan counts the shared GPU's power once."""
    est = _estimator([1, 1, 1], [300.0] * 3, [0.5] * 3)
    tenancy = Tenancy.of_gpus([["a0"], ["a0"], ["a1"]])
    assert tenancy is not None
    jobs = _jobs(3, [3600.0, 3600.0, 3600.0], tenancy)
    mpc = _mpc()
    budget_w = 420.0  # well below two GPUs at their top clocks
    d = mpc.step(est, jobs, 0.0, budget_w)
    assert d.graphics_mhz[0] == d.graphics_mhz[1] > d.graphics_mhz[2]
    np.testing.assert_allclose(d.job_power_w[0], d.job_power_w[1])
    gpu_w = est.predict_power_w(d.graphics_mhz / 1410.0, np.ones(3))
    assert d.predicted_power_w == pytest.approx(gpu_w[0] + gpu_w[2], rel=1e-9)
    assert d.predicted_power_w <= budget_w
    # the same jobs as if unshared would each have got the third job's clock
    alone = _mpc().step(est, replace(jobs, tenancy=None), 0.0, budget_w)
    assert alone.graphics_mhz[0] == alone.graphics_mhz[2]


def test_the_offset_counts_a_shared_gpu_once() -> None:
    """Readings that match the plan teach no offset, though both tenants report the GPU."""
    est = _estimator([1, 1], [300.0] * 2, [0.5] * 2)
    tenancy = Tenancy.of_gpus([["a0"], ["a0"]])
    jobs = _jobs(2, [3600.0, 3600.0], tenancy)
    mpc = _mpc()
    d = mpc.step(est, jobs, 0.0, 250.0)
    x = d.graphics_mhz / 1410.0
    gpu_w = est.predict_power_w(x, np.ones(2))
    measured = Measurements(
        graphics_mhz=d.graphics_mhz.astype(np.float64),
        memory_mhz=np.full(2, 1593.0),
        power_w=gpu_w,  # each tenant sees the GPU's whole power
        iteration_s=np.full(2, 0.5) / x,
        planned_power_w=d.job_power_w,
    )
    mpc.step(est, jobs, 10.0, 250.0, measured=measured)
    assert abs(mpc.offset) < 1e-3


def test_a_new_tenant_makes_its_gpu_count_at_its_limit() -> None:
    est = _estimator([1], [300.0], [0.5])
    est.add_jobs(a100_estimator([1]).statics, iteration_s=np.full(1, 0.5))
    tenancy = Tenancy.of_gpus([["a0"], ["a0"]])
    problem = _mpc().problem(est, _jobs(2, [3600.0, 3600.0], tenancy), 0.0, 1e4)
    # not measured with its new tenant yet: the GPU at its limit, whatever the clock
    assert problem.power_w(np.array([0.6]), np.ones(1)) == pytest.approx([400.0])


def test_a_gpu_is_modelled_by_its_youngest_tenant_who_saw_only_the_present_company() -> None:
    """Job 0 ran alone at 200 W for three intervals; job 1 joined and both read 320 W at the
    same clock once: the GPU is counted at what the two draw together, not at a mean that
    remembers the GPU alone."""
    est = _estimator([1], [200.0], [0.5])
    est.add_jobs(a100_estimator([1]).statics, iteration_s=np.full(1, 0.5))
    x = np.full(2, 0.6)
    together_w = 320.0 * (0.4 + 0.6 * 0.6**3)
    est.observe(x, np.ones(2), np.full(2, together_w), np.full(2, 0.5 / 0.6))
    tenancy = Tenancy.of_gpus([["a0"], ["a0"]])
    problem = _mpc().problem(est, _jobs(2, [3600.0, 3600.0], tenancy), 0.0, 1e4)
    assert problem.gpus.tolist() == [1.0]
    newcomer_w = est.predict_power_w(x, np.ones(2))[1]
    assert problem.power_w(x[:1], np.ones(1)) == pytest.approx([newcomer_w])
    assert newcomer_w > est.predict_power_w(x, np.ones(2))[0]  # the old model under-predicts


def test_a_domain_sees_a_shared_gpu_once() -> None:
    est = _estimator([1, 1, 1], [300.0] * 3, [0.5] * 3)
    tenancy = Tenancy.of_gpus([["a0"], ["a0"], ["b0"]])
    assert tenancy is not None
    rack = DomainLimits(
        names=("rack-a",),
        limit_w=np.array([200.0]),
        uncontrolled_w=np.zeros(1),
        domain=np.zeros(2, dtype=np.int64),
        job_row=np.array([0, 1]),
        share=np.ones(2),
    )
    mpc = _mpc()
    d = mpc.step(est, _jobs(3, [3600.0] * 3, tenancy), 0.0, 1e4, domains=rack)
    assert d.domain_planned_w[0] == pytest.approx(d.job_power_w[0] + d.job_power_w[1])
    assert d.domain_planned_w[0] <= 200.0
    assert d.graphics_mhz[0] == d.graphics_mhz[1] < d.graphics_mhz[2]


def test_groups_that_do_not_match_the_jobs_are_refused() -> None:
    est = _estimator([1, 1], [300.0] * 2, [0.5] * 2)
    bad = Tenancy(np.array([0, 0, 0]), np.ones(1))
    with pytest.raises(InputError, match="GPU groups do not match"):
        _mpc().step(est, _jobs(2, [3600.0, 3600.0], bad), 0.0, 1e4)


def test_a_cotenant_key_names_the_set_of_co_tenants() -> None:
    assert cotenant_key([]) == 0
    key = cotenant_key(["17", "4"])
    assert key > 0
    assert cotenant_key(["4", "17", "4"]) == key  # a set: order and repeats do not matter
    assert cotenant_key(["4"]) != key
    assert cotenant_key(["4", "18"]) != key


def _slowed(mpc: EconomicMPC, est: JobEstimator, cotenants: list[int], slowdown: float) -> float:
    """One interval at the top clock, job 0 measured ``slowdown`` times slower than it ran
    before among ``cotenants`` (one key per job); what its model predicts after learning."""
    n = len(est)
    jobs = _jobs(n, [3600.0] * n, None)
    measured = Measurements(
        graphics_mhz=np.full(n, 1410.0),
        memory_mhz=np.full(n, 1593.0),
        power_w=np.full(n, 300.0),
        iteration_s=np.full(n, 0.5) * np.array([slowdown] + [1.0] * (n - 1)),
        cotenants=np.array(cotenants, dtype=np.int64),
    )
    mpc.step(est, jobs, 0.0, 1e4, measured=measured)
    return float(est.predict_iteration_s(np.ones(n), np.ones(n))[0])


@pytest.mark.parametrize("reanchor", [True, False])
def test_a_job_measured_among_new_co_tenants_re_anchors_its_time_model(reanchor: bool) -> None:
    """Job 0 ran alone (key 0) for eight intervals at 0.5 s an iteration; a co-tenant joins
    and its iteration takes 0.9 s: with the rule, the first sample among the new co-tenant
    re-anchors the model; without, RLS takes it for an outlier and keeps 0.5 s."""
    est = _estimator([1], [300.0], [0.5])
    mpc = EconomicMPC(
        ClockGrid.from_tables([("A100", A100)], min_fraction=0.5),
        ControllerSettings(reanchor_tenants=reanchor),
    )
    for _ in range(5):
        assert _slowed(mpc, est, [0], 1.0) == pytest.approx(0.5, rel=0.02)
    together = cotenant_key(["2"])
    after = _slowed(mpc, est, [together], 1.8)
    if reanchor:
        assert after == pytest.approx(0.9, rel=0.02)
        # the same company again teaches as usual: no second anchor
        assert est.time.fresh.tolist() == [False]
    else:
        assert after == pytest.approx(0.5, rel=0.05)


def test_a_sample_of_unknown_company_neither_anchors_nor_forgets_the_last() -> None:
    """-1 (no GPU of the job sampled) leaves the key learned; the change is seen when a
    sample among the new co-tenants comes."""
    est = _estimator([1], [300.0], [0.5])
    mpc = _mpc()
    for _ in range(5):
        _slowed(mpc, est, [0], 1.0)
    assert _slowed(mpc, est, [-1], 1.0) == pytest.approx(0.5, rel=0.02)
    assert est.cotenants.tolist() == [0]
    assert _slowed(mpc, est, [cotenant_key(["2"])], 1.8) == pytest.approx(0.9, rel=0.02)


def test_interference_learns_what_each_change_of_co_tenants_did() -> None:
    """A cell (co-tenants before, after) counts once it has its events; its reverse stands in
    negated; counts from `MAX_COTENANTS` up share a cell; no change, or an unknown count
    before, scales nothing."""
    i = Interference(min_events=3)
    one, zero = np.array([1]), np.array([0])
    i.learn(np.array([1, 1]), np.array([0, 0]), np.log([0.5, 0.5]))
    assert i.scale(one, zero).tolist() == [1.0]  # two events: not yet
    i.learn(one, zero, np.log([0.5]))
    assert i.scale(one, zero) == pytest.approx([0.5])
    assert i.scale(zero, one) == pytest.approx([2.0])  # 0 → 1 not seen: the reverse, negated
    assert i.scale(np.array([1, -1, 0]), np.array([1, 0, 0])).tolist() == [1.0, 1.0, 1.0]
    # a change within one cell, or a miss that is no number, teaches nothing
    i.learn(np.array([2, 5, 2]), np.array([2, 7, 1]), np.array([1.0, 1.0, np.nan]))
    assert i.count[2, 2] == i.count[3, 3] == i.count[2, 1] == 0
    many = np.full(3, 5)
    i.learn(many, np.zeros(3, dtype=np.int64), np.full(3, np.log(0.25)))
    assert i.scale(np.array([3, 9]), np.array([0, 0])) == pytest.approx([0.25, 0.25])
    # one wild sample is clipped to a factor of e²: it cannot own a cell
    wild = Interference(min_events=1)
    wild.learn(one, zero, np.array([-30.0]))
    assert wild.scale(one, zero) == pytest.approx([np.exp(-Interference.CLIP)])


def _among(
    mpc: EconomicMPC,
    est: JobEstimator,
    iteration_s: list[float],
    keys: list[int],
    counts: list[int],
) -> None:
    """One interval at the top clock: each job's iteration time (NaN: not measured) and the
    co-tenants it was measured among (key and count, -1: not sampled); every job planned alone."""
    n = len(est)
    mpc.step(
        est,
        _jobs(n, [3600.0] * n, None),
        0.0,
        1e4,
        measured=Measurements(
            graphics_mhz=np.full(n, 1410.0),
            memory_mhz=np.full(n, 1593.0),
            power_w=np.full(n, 300.0),
            iteration_s=np.array(iteration_s),
            cotenants=np.array(keys, dtype=np.int64),
            cotenant_count=np.array(counts, dtype=np.int64),
        ),
    )


@pytest.mark.parametrize("interference", [True, False])
def test_a_tenant_whose_co_tenant_left_is_planned_at_the_speed_such_changes_gave(
    interference: bool,
) -> None:
    """Jobs 0 and 1 each learned 0.9 s an iteration beside one co-tenant. Job 0's first sample
    alone takes 0.45 s: a change from one co-tenant to none halved a settled model's time. Job
    1's co-tenant has left too, but no sample of it alone has come (the head reads two plans
    back): with the rule its plan counts it at half its model's time until one does; without,
    at its model's 0.9 s."""
    est = _estimator([1, 1], [300.0, 300.0], [0.9, 0.9])
    mpc = EconomicMPC(
        ClockGrid.from_tables([("A100", A100)], min_fraction=0.5),
        ControllerSettings(interference=interference),
    )
    mpc.interference = Interference(min_events=1)
    beside = [cotenant_key(["7"]), cotenant_key(["8"])]
    for _ in range(3):
        _among(mpc, est, [0.9, 0.9], beside, [1, 1])
    assert est.time_scale.tolist() == [1.0, 1.0]  # nothing learned of a change yet
    _among(mpc, est, [0.45, np.nan], [0, -1], [0, -1])
    before, after, log_ratio = est.cotenant_steps
    if not interference:
        assert est.time_scale.tolist() == [1.0, 1.0] and mpc.interference.count.sum() == 0
        return
    assert (before.tolist(), after.tolist()) == ([1], [0])
    assert log_ratio == pytest.approx([np.log(0.5)], abs=0.02)
    # job 0 re-anchored on its sample alone: its model is its plan; job 1's is halved
    assert est.time_scale == pytest.approx([1.0, 0.5], abs=0.01)
    t_model = est.predict_iteration_s(np.ones(2), np.ones(2))
    assert t_model == pytest.approx([0.45, 0.9], rel=0.02)
    # job 1's first sample alone re-anchors it: its plan is its model again
    _among(mpc, est, [0.9, 0.45], [0, 0], [0, 0])
    assert est.time_scale.tolist() == [1.0, 1.0]
