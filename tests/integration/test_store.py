"""The store on real databases: every test that takes ``store`` or ``engine`` runs on SQLite and
on PostgreSQL (see conftest.py)."""

from __future__ import annotations

import dataclasses
import math
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.estimator import EstimatorSettings, JobEstimator, JobStatics
from slurm_cdgpc.model.rls import RlsState
from slurm_cdgpc.store import (
    ACTIVE_STATES,
    Job,
    JobGpu,
    Measurement,
    MigrationError,
    ModelSnapshot,
    Node,
    Setpoint,
    Store,
    StoreBusyError,
    StoreError,
    current_version,
    make_engine,
    upgrade,
)
from slurm_cdgpc.store.engine import IDLE_IN_TRANSACTION_S
from slurm_cdgpc.store.migrate import migrations, split_statements, sql_dir
from slurm_cdgpc.store.repository import JobRegistration
from slurm_cdgpc.store.schema import STATIC_FLOATS, Base
from tests.integration.conftest import T0_S, FakeClock

HOUR_S = 3600.0
DAY_S = 86400.0


# -- budget ----------------------------------------------------------------------------------


def test_current_budget_is_the_latest_change_in_force(store: Store, clock: FakeClock) -> None:
    assert store.current_budget() is None  # never set: uncapped

    first = store.set_budget(450e3, "root", reason="initial")
    clock.advance(HOUR_S)
    store.set_budget(400e3, "alice", reason="cooling maintenance")
    night = store.set_budget(300e3, "alice", effective_at_s=T0_S + 10 * HOUR_S, reason="tariff")

    assert store.current_budget(T0_S - 1) is None
    assert store.current_budget(T0_S + 1).budget_w == 450e3  # type: ignore[union-attr]
    now = store.current_budget()
    assert now is not None
    assert (now.budget_w, now.set_by, now.reason) == (400e3, "alice", "cooling maintenance")
    # the scheduled change is history, but not in force before its time
    assert store.current_budget(T0_S + 10 * HOUR_S) == night
    assert [c.budget_w for c in store.budget_history()] == [450e3, 400e3, 300e3]
    assert [c.budget_w for c in store.budget_history(since_s=clock.now_s)] == [400e3, 300e3]
    assert store.budget_history()[0] == first
    assert night.created_at_s == clock.now_s  # when it was said, not when it applies


def test_budget_changes_at_the_same_instant_the_later_one_wins(store: Store) -> None:
    store.set_budget(450e3, "root", effective_at_s=T0_S)
    store.set_budget(420e3, "root", effective_at_s=T0_S)
    assert store.current_budget(T0_S).budget_w == 420e3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("budget_w", "user"),
    [(0.0, "root"), (-5.0, "root"), (float("nan"), "root"), (float("inf"), "root"), (1e3, "")],
)
def test_bad_budget_is_refused_and_changes_nothing(
    store: Store, budget_w: float, user: str
) -> None:
    store.set_budget(450e3, "root")
    with pytest.raises(InputError):
        store.set_budget(budget_w, user)
    assert [c.budget_w for c in store.budget_history()] == [450e3]


def test_a_domain_limit_is_its_latest_change_and_never_the_budget(
    store: Store, clock: FakeClock
) -> None:
    store.set_budget(450e3, "root")
    assert store.domain_limits() == {}  # never set: the topology file's limits hold
    rack = store.set_budget(40e3, "alice", domain="rack12", reason="PDU swap")
    store.set_budget(200e3, "root", domain="row1")
    clock.advance(HOUR_S)
    store.set_budget(35e3, "alice", domain="rack12", effective_at_s=T0_S + 2 * HOUR_S)
    store.set_budget(38e3, "bob", domain="rack12", effective_at_s=T0_S + 2 * HOUR_S)  # wins
    store.set_budget(30e3, "root", domain="rack7", effective_at_s=T0_S + 3 * HOUR_S)

    assert rack.domain == "rack12" and rack.reason == "PDU swap"
    assert store.domain_limits(T0_S - 1) == {}
    now = store.domain_limits()
    assert now == {"rack12": rack, "row1": now["row1"]} and now["row1"].budget_w == 200e3
    later = store.domain_limits(T0_S + 3 * HOUR_S)
    assert {d: (c.budget_w, c.set_by) for d, c in later.items()} == {
        "rack12": (38e3, "bob"),
        "row1": (200e3, "root"),
        "rack7": (30e3, "root"),
    }
    # the cluster's budget, its history and its schedule know nothing of the domains
    assert store.current_budget(T0_S + 3 * HOUR_S).budget_w == 450e3  # type: ignore[union-attr]
    assert [(c.budget_w, c.domain) for c in store.budget_history()] == [(450e3, None)]
    assert [(c.domain, c.budget_w) for c in store.domain_limit_history(since_s=clock.now_s)] == [
        ("rack12", 35e3),
        ("rack12", 38e3),
        ("rack7", 30e3),
    ]
    assert len(store.domain_limit_history()) == 5


@pytest.mark.parametrize(
    ("limit_w", "domain"), [(0.0, "rack12"), (-5.0, "rack12"), (math.nan, "rack12"), (1e3, "a b")]
)
def test_bad_domain_limit_is_refused_and_changes_nothing(
    store: Store, limit_w: float, domain: str
) -> None:
    with pytest.raises(InputError, match="power domain"):
        store.set_budget(limit_w, "root", domain=domain)
    assert store.domain_limit_history() == [] and store.budget_history() == []


def test_budgets_kept_before_the_domains_stay_the_clusters(
    engine: Engine, clock: FakeClock, tmp_path: Path
) -> None:
    """``db upgrade`` on a version 3 store with a budget history adds the domain column (version
    4); the budgets recorded before it are still the cluster's, and domains can be set."""
    dialect = engine.dialect.name
    (tmp_path / dialect).mkdir()
    for migration in migrations(dialect):
        if migration.version <= 3:
            (tmp_path / dialect / migration.path.name).write_text(migration.path.read_text())
    assert upgrade(engine, root=tmp_path) == [1, 2, 3]
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO budget_changes (effective_at_s, budget_w, set_by, reason, "
                "created_at_s) VALUES (:t, 450000, 'root', 'before domains', :t)"
            ),
            {"t": T0_S},
        )
    assert upgrade(engine)[0] == 4
    store = Store(engine, clock=clock)
    kept = store.current_budget()
    assert kept is not None and (kept.budget_w, kept.domain) == (450e3, None)
    store.set_budget(40e3, "root", domain="rack12")
    assert store.current_budget() == kept and store.budget_history() == [kept]
    assert store.domain_limits()["rack12"].budget_w == 40e3


# -- jobs ------------------------------------------------------------------------------------


def test_register_job_is_idempotent(store: Store) -> None:
    first = store.register_job("1234", "alice", {"gpu01": [0, 1]}, deadline_s=T0_S + DAY_S)
    again = store.register_job("1234", "alice", {"gpu01": [1, 0]}, deadline_s=T0_S + DAY_S)

    assert again == first
    assert len(store.jobs()) == 1
    assert store.count_rows()["job_gpus"] == 2
    assert first.state == "registered"
    assert first.gpus == (JobGpu("gpu01", 0), JobGpu("gpu01", 1))


def test_multi_node_job_collects_the_gpus_of_every_node(store: Store) -> None:
    # the Prolog runs on each node of the job and registers that node's GPUs
    store.register_job("77_3", "bob", {"gpu01": [0, 1, 2, 3]}, iterations_total=10_000)
    store.register_job("77_3", "bob", {"gpu02": [0, 1, 2, 3]})
    job = store.register_job("77_3", "bob", {"gpu02": [0, 1, 2, 3]})  # a retried Prolog

    assert job.nodes == ("gpu01", "gpu02")
    assert job.gpu_count == 8
    assert job.iterations_total == 10_000  # not erased by calls that did not give it
    assert store.job("77_3") == job


def test_concurrent_prologs_of_one_job_both_land(make_db_engine: Callable[[], Engine]) -> None:
    """Two nodes' Prologs register the same new job at the same moment, from two processes."""
    upgrade(make_db_engine())
    stores = [Store(make_db_engine()), Store(make_db_engine())]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def prolog(store: Store, node: str) -> None:
        start.wait()
        try:
            store.register_job("555", "carol", {node: [0, 1]})
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [
        threading.Thread(target=prolog, args=(s, node))
        for s, node in zip(stores, ("gpu01", "gpu02"), strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    job = stores[0].job("555")
    assert job is not None
    assert job.nodes == ("gpu01", "gpu02") and job.gpu_count == 4


def test_batches_of_every_size_run_a_handful_of_statement_shapes(
    store: Store, engine: Engine
) -> None:
    """The driver keeps compiled statements per connection: one text per batch size grew the
    head's native memory for hours in a soak."""
    texts: set[str] = set()

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        texts.add(statement)

    store.register_job("99999", "alice", {"n0": [0]})
    event.listen(engine, "before_cursor_execute", seen)
    try:
        done = 0
        for size in range(1, 101):
            batch = [
                JobRegistration(str(done + i + 1), "alice", {f"n{(done + i) % 7}": [i % 8]})
                for i in range(size)
            ]
            batch.append(JobRegistration("99999", "alice", {"n0": [size % 8]}))  # an update
            outcomes = store.register_jobs(batch)
            assert all(isinstance(o, Job) for o in outcomes)
            done += size
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert len(store.jobs()) == done + 1 and store.job("99999").gpus == (JobGpu("n0", 100 % 8),)
    assert len(texts) < 40  # one per batch size was over 200


def test_finish_is_idempotent_and_a_requeued_job_starts_over(
    store: Store, clock: FakeClock
) -> None:
    store.register_job("900", "dave", {"gpu01": [0], "gpu02": [0]})
    store.record_progress("900", 1_500, iterations_total=9_000)
    clock.advance(HOUR_S)
    done = store.finish_job("900")
    clock.advance(60)
    assert store.finish_job("900") == done  # the Epilog of the second node
    assert done is not None and done.state == "finished" and done.finished_at_s == T0_S + HOUR_S

    # Slurm requeued it: same id, new allocation
    requeued = store.register_job("900", "dave", {"gpu07": [3]})
    assert requeued.state == "registered"
    assert requeued.finished_at_s is None
    assert requeued.gpus == (JobGpu("gpu07", 3),)
    assert requeued.iterations_total == 9_000
    assert requeued.iterations_done == 0


def test_spooled_prolog_and_epilog_delivered_late_change_nothing(
    store: Store, clock: FakeClock
) -> None:
    """The head was down: a node spooled the hooks and forwards them out of order."""
    store.register_job("31", "erin", {"gpu01": [0]}, at_s=T0_S)
    store.finish_job("31", at_s=T0_S + HOUR_S)  # the Epilog got through directly
    clock.advance(2 * HOUR_S)
    late = store.register_job("31", "erin", {"gpu02": [1]}, at_s=T0_S)  # the spooled Prolog
    assert late.state == "finished" and late.gpus == (JobGpu("gpu01", 0),)

    requeued = store.register_job("31", "erin", {"gpu03": [2]})  # now: a real requeue
    stale = store.finish_job("31", at_s=T0_S + HOUR_S)  # the first run's Epilog, spooled
    assert stale == requeued and requeued.state == "registered"
    assert store.finish_job("31") is not None
    assert store.jobs(ACTIVE_STATES) == []


def test_job_states_and_progress(store: Store) -> None:
    store.register_job("1", "alice", {"n1": [0]})
    store.register_job("2", "alice", {"n1": [1]})
    store.register_job("3", "bob", {"n2": [0]}, adopted=True)
    store.start_job("1")
    store.start_job("3")  # adopted jobs stay adopted
    store.finish_job("2")
    progressed = store.record_progress("1", 250, iterations_total=1000)

    assert progressed is not None and progressed.iterations_done == 250
    assert [j.job_id for j in store.jobs("running")] == ["1"]
    assert [j.job_id for j in store.jobs(ACTIVE_STATES)] == ["1", "3"]
    assert [(j.job_id, j.state) for j in store.jobs()] == [
        ("1", "running"),
        ("2", "finished"),
        ("3", "adopted"),
    ]
    assert store.finish_job("404") is None
    assert store.start_job("404") is None
    with pytest.raises(InputError, match="unknown job state"):
        store.jobs("runing")


def test_bad_registrations_are_refused_and_change_nothing(store: Store) -> None:
    store.register_job("10", "alice", {"n1": [0]})
    with pytest.raises(InputError, match="registered to alice"):
        store.register_job("10", "mallory", {"n1": [1]})
    for job_id, user, gpus in [
        ("10; DROP TABLE jobs", "alice", {"n1": [0]}),
        ("11", "al ice", {"n1": [0]}),
        ("11", "alice", {"-n1": [0]}),
        ("11", "alice", {"n1": [-1]}),
    ]:
        with pytest.raises(InputError):
            store.register_job(job_id, user, gpus)
    assert [(j.job_id, j.gpus) for j in store.jobs()] == [("10", (JobGpu("n1", 0),))]


# -- nodes -----------------------------------------------------------------------------------


def test_nodes_are_upserted_and_their_reachability_tracked(store: Store, clock: FakeClock) -> None:
    store.upsert_node(
        "gpu01", "http://gpu01:8464", gpu_count=8, gpu_type="A100", worst_case_power_w=3200
    )
    store.upsert_node(
        "gpu02", "gpu02", transport="ssh", gpu_count=4, gpu_type="A40", worst_case_power_w=1200
    )
    clock.advance(30)
    store.upsert_node(
        "gpu01", "http://gpu01:9000", gpu_count=8, gpu_type="A100", worst_case_power_w=3300
    )
    clock.advance(30)
    store.mark_nodes(["gpu99"], ["gpu02"])  # one round: gpu02 failed; gpu99 is not known

    nodes = {n.name: n for n in store.nodes()}
    assert list(nodes) == ["gpu01", "gpu02"]
    assert nodes["gpu01"].url == "http://gpu01:9000"
    assert nodes["gpu01"].worst_case_power_w == 3300
    assert nodes["gpu01"].last_seen_s == T0_S + 30
    lost = nodes["gpu02"]
    assert not lost.reachable and lost.last_seen_s == T0_S  # last seen when it answered
    clock.advance(30)
    store.mark_nodes(["gpu02", "gpu01"], at_s=T0_S + 90)
    back = store.nodes_named(["gpu01", "gpu02"])
    assert all(n.reachable and n.last_seen_s == T0_S + 90 for n in back.values())
    # a round of more nodes than one statement's list (`_chunks`) marks every one of them
    many = [f"n{i:04d}" for i in range(2500)]
    store.add_nodes([Node(n, n, "ssh", None, False, 1, "T4", 70.0) for n in many])
    store.mark_nodes(many[::2], many[1::2], at_s=T0_S + 120)
    marked = store.nodes_named(many)
    assert [marked[n].reachable for n in many] == [True, False] * 1250
    assert {marked[n].last_seen_s for n in many[::2]} == {T0_S + 120}
    with pytest.raises(InputError):
        store.upsert_node("gpu03", "x", transport="ftp", gpu_count=1, gpu_type="T4",
                          worst_case_power_w=70)  # fmt: skip


# -- model state -----------------------------------------------------------------------------


def _statics(m: int) -> JobStatics:
    return JobStatics(
        gpus=np.array([1, 4, 8, 2][:m], dtype=np.int64),
        graphics_max_mhz=np.array([1410.0, 1410.0, 1740.0, 1980.0][:m]),
        memory_max_mhz=np.array([1215.0, 1215.0, 7251.0, 2619.0][:m]),
        knee_mhz=np.array([1005.0, 1005.0, 1200.0, 1300.0][:m]),
        mem_mask=np.array([0.0, 0.0, 1.0, 0.0][:m]),
        idle_power_w=np.array([55.0, 55.0, 30.0, 70.0][:m]),
        power_limit_w=np.array([400.0, 400.0, 300.0, 700.0][:m]),
    )


def _observe(estimator: JobEstimator, rng: np.random.Generator) -> None:
    """One interval of synthetic measurements (a plant that is not the model family)."""
    m = len(estimator)
    x = rng.uniform(0.35, 1.0, m)
    x_m = np.ones(m)
    power_w = 60.0 + 320.0 * x**2.2 + rng.normal(0.0, 2.0, m)
    iteration_s = 0.21 / x + 0.04 + rng.normal(0.0, 0.001, m)
    estimator.observe(x, x_m, power_w, iteration_s)


def _trained(job_ids: list[str], seed: int = 3) -> JobEstimator:
    estimator = JobEstimator(EstimatorSettings(family="bent"))
    estimator.add_jobs(_statics(len(job_ids)))
    rng = np.random.default_rng(seed)
    for _ in range(15):
        _observe(estimator, rng)
    return estimator


def _same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_snapshots_identical(a: ModelSnapshot, b: ModelSnapshot) -> None:
    assert (a.job_ids, a.family) == (b.job_ids, b.family)
    for bank_a, bank_b in ((a.power, b.power), (a.time, b.time)):
        for field in ("theta", "cov", "err_var", "count"):
            assert _same_bits(getattr(bank_a, field), getattr(bank_b, field)), field
    for static in dataclasses.fields(JobStatics):
        assert _same_bits(getattr(a.statics, static.name), getattr(b.statics, static.name))


def test_model_state_round_trips_bit_for_bit(store: Store) -> None:
    job_ids = ["101", "102_7", "103"]
    for job_id in job_ids:
        store.register_job(job_id, "alice", {"n1": [0]})
    trained = ModelSnapshot.of(job_ids, _trained(job_ids))
    # values that a decimal or float column round trip would bend or refuse
    nan_payload = np.frombuffer(struct.pack("<Q", 0x7FF8_0000_0000_0123), dtype="<f8")[0]
    power = RlsState(
        theta=trained.power.theta.copy(),
        cov=trained.power.cov.copy(),
        err_var=np.array([5e-324, 0.1 + 0.2, np.inf]),
        count=np.array([0, 2**62, 17], dtype=np.int64),
    )
    power.theta[0, 0] = -0.0
    power.theta[1, 1] = nan_payload
    power.cov[2, 0, 1] = np.nextafter(1.0, 2.0)
    statics = dataclasses.replace(trained.statics, knee_mhz=np.array([np.nan, 1005.0, 1e-310]))
    snapshot = dataclasses.replace(trained, power=power, statics=statics)

    assert store.save_models(snapshot) == 3
    _assert_snapshots_identical(store.load_models("bent"), snapshot)
    reordered = store.load_models("bent", ["103", "101"])
    assert reordered.job_ids == ("103", "101")
    assert _same_bits(reordered.time.cov, snapshot.time.cov[[2, 0]])


def test_a_restarted_head_learns_on_exactly_where_it_stopped(store: Store) -> None:
    job_ids = ["201", "202", "203", "204"]
    for job_id in job_ids:
        store.register_job(job_id, "bob", {"n1": [0]})
    before = _trained(job_ids)
    store.save_models(ModelSnapshot.of(job_ids, before))

    after = store.load_models("bent", job_ids).restore(EstimatorSettings(family="bent"))
    rng_before, rng_after = np.random.default_rng(11), np.random.default_rng(11)
    for _ in range(10):
        _observe(before, rng_before)
        _observe(after, rng_after)
    _assert_snapshots_identical(ModelSnapshot.of(job_ids, after), ModelSnapshot.of(job_ids, before))
    x = np.linspace(0.4, 1.0, 4)
    assert _same_bits(after.predict_power_w(x, np.ones(4)), before.predict_power_w(x, np.ones(4)))


def test_saving_replaces_and_other_families_are_left_out(store: Store) -> None:
    for job_id in ("1", "2"):
        store.register_job(job_id, "alice", {"n1": [0]})
    old = ModelSnapshot.of(["1", "2"], _trained(["1", "2"], seed=1))
    new = ModelSnapshot.of(["1", "2"], _trained(["1", "2"], seed=2))
    store.save_models(old)
    store.save_models(new)
    _assert_snapshots_identical(store.load_models("bent"), new)

    linear = JobEstimator(EstimatorSettings(family="linear"))
    linear.add_jobs(_statics(1))
    store.save_models(ModelSnapshot.of(["2"], linear))
    assert store.load_models("bent").job_ids == ("1",)
    assert store.load_models("linear", ["2", "404"]).job_ids == ("2",)
    empty = store.load_models("cubic")
    assert len(empty) == 0 and empty.power.theta.shape == (0, 4)
    with pytest.raises(InputError, match="family"):
        store.load_models("linear").restore(EstimatorSettings(family="bent"))
    with pytest.raises(InputError, match="unregistered"):
        store.save_models(ModelSnapshot.of(["3"], linear))


# -- measurements ----------------------------------------------------------------------------


def _sample(time_s: float, gpu: int = 0, power_w: float = 250.0, **kw: Any) -> Measurement:
    return Measurement(time_s=time_s, node="gpu01", gpu_index=gpu, power_w=power_w, **kw)


def test_measurements_older_than_the_retention_are_pruned(store: Store, clock: FakeClock) -> None:
    store.record_measurements(
        _sample(T0_S - age_s, job_id="1", energy_j=1e6, graphics_mhz=1410, iterations_per_s=3.0)
        for age_s in (40 * DAY_S, 31 * DAY_S, 29 * DAY_S, 60.0)
    )
    assert store.prune_measurements(30 * DAY_S) == 2
    assert [T0_S - m.time_s for m in store.measurements()] == [29 * DAY_S, 60.0]
    assert store.prune_measurements(30 * DAY_S) == 0
    clock.advance(DAY_S + 1)
    assert store.prune_measurements(30 * DAY_S) == 1
    kept = store.measurements(job_id="1")
    assert kept == [_sample(T0_S - 60.0, job_id="1", energy_j=1e6, graphics_mhz=1410,
                            iterations_per_s=3.0)]  # fmt: skip


def test_measurements_store_not_measured_as_none(store: Store) -> None:
    store.record_measurements([_sample(T0_S, energy_j=float("nan"), iterations_per_s=None)])
    (m,) = store.measurements(since_s=T0_S)
    assert m.energy_j is None and m.iterations_per_s is None and m.job_id is None
    with pytest.raises(InputError, match="power of gpu01 GPU 1"):
        store.record_measurements([_sample(T0_S + 1), _sample(T0_S + 1, gpu=1, power_w=np.nan)])
    assert len(store.measurements()) == 1


# -- decisions -------------------------------------------------------------------------------


def _decide(store: Store, index: int, **kw: Any) -> Any:
    values: dict[str, Any] = {
        "interval_index": index,
        "status": "binding",
        "mode": "newton",
        "price": 0.25 * index,
        "budget_w": 450e3,
        "effective_budget_w": 448e3,
        "predicted_power_w": 447.9e3,
        "solve_s": 0.004,
        "setpoints": [Setpoint("2", 1200, 1215, 310.0), Setpoint("1", 990, 1215, 205.5)],
    }
    values.update(kw)
    return store.record_decision(**values)


def test_decisions_form_an_audit_trail(store: Store, clock: FakeClock) -> None:
    first = _decide(store, 1)
    clock.advance(30)
    second = _decide(store, 2, shadow=True, setpoints=[])
    store.set_measured_power(first.id, 446.1e3)  # one interval later
    clock.advance(30)
    _decide(store, 3, status="infeasible", price=float("inf"))

    trail = store.decisions()
    assert [d.interval_index for d in trail] == [1, 2, 3]
    assert trail[0].measured_power_w == 446.1e3 and trail[1].measured_power_w is None
    assert [s.job_id for s in trail[0].setpoints] == ["1", "2"]
    assert trail[0].setpoints[1] == Setpoint("2", 1200, 1215, 310.0)
    assert trail[1] == second and second.shadow and second.setpoints == ()
    assert trail[2].price == float("inf")
    assert [d.interval_index for d in store.decisions(since_s=T0_S + 30)] == [2, 3]
    assert [d.interval_index for d in store.decisions(limit=2)] == [2, 3]
    with pytest.raises(InputError):
        store.set_measured_power(10_000, 1.0)
    with pytest.raises(InputError, match="one setpoint per job"):
        _decide(store, 4, setpoints=[Setpoint("1", 1, 1, 1.0)] * 2)
    with pytest.raises(InputError, match="NaN"):
        _decide(store, 4, price=float("nan"))
    assert len(store.decisions()) == 3


# -- atomicity -------------------------------------------------------------------------------


def _crash_on(engine: Engine, table: str) -> Callable[[], None]:
    """Make the next INSERT into ``table`` fail, as if the process died there."""

    def crash(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith(f"INSERT INTO {table.upper()}"):
            raise RuntimeError(f"injected crash before writing {table}")

    event.listen(engine, "before_cursor_execute", crash)
    return lambda: event.remove(engine, "before_cursor_execute", crash)


@pytest.mark.faults
def test_a_write_that_fails_midway_leaves_nothing(store: Store, engine: Engine) -> None:
    heal = _crash_on(engine, "decision_setpoints")
    with pytest.raises(RuntimeError, match="injected crash"):
        _decide(store, 1)  # the decision row was written, its setpoints were not
    heal()
    assert store.decisions() == []
    assert store.count_rows()["decisions"] == 0
    assert [d.interval_index for d in [_decide(store, 1)]] == [1]  # and the store still works


@pytest.mark.faults
def test_an_interval_commits_whole_or_not_at_all(store: Store, engine: Engine) -> None:
    job_ids = ["1", "2"]
    for job_id in job_ids:
        store.register_job(job_id, "alice", {"n1": [0, 1]})
    old = ModelSnapshot.of(job_ids, _trained(job_ids, seed=1))
    store.save_models(old)
    heal = _crash_on(engine, "measurements")
    with pytest.raises(RuntimeError, match="injected crash"), store.transaction():
        store.set_budget(1e3, "root")
        store.save_models(ModelSnapshot.of(job_ids, _trained(job_ids, seed=2)))
        _decide(store, 1)
        store.record_measurements([_sample(T0_S)])
    heal()
    _assert_snapshots_identical(store.load_models("bent"), old)
    assert store.decisions() == [] and store.current_budget() is None
    assert store.measurements() == []

    with store.transaction():
        store.save_models(ModelSnapshot.of(job_ids, _trained(job_ids, seed=2)))
        _decide(store, 1)
        store.record_measurements([_sample(T0_S)])
    assert len(store.decisions()) == 1 and len(store.measurements()) == 1


def test_a_transaction_that_may_not_wait_fails_at_once_while_another_writer_holds_the_store(
    store: Store, engine: Engine
) -> None:
    if engine.dialect.name != "sqlite":  # every PostgreSQL statement is a round trip: never
        with pytest.raises(StoreBusyError, match="may wait"), store.transaction(wait=False):
            store.set_budget(1e3, "root")
        assert store.current_budget() is None
        return
    with engine.connect() as other:
        other.execution_options(cdgpc_write=True)
        with other.begin():  # BEGIN IMMEDIATE: another writer holds the write lock
            started = time.monotonic()
            with (
                pytest.raises(StoreBusyError, match="another writer"),
                store.transaction(wait=False),
            ):
                raise AssertionError("the block ran without the write lock")
            assert time.monotonic() - started < 5.0  # at once, not after the 30 s busy timeout
    with store.transaction(wait=False):  # free again: it writes, and commits
        store.set_budget(2e3, "root")
    assert store.current_budget().budget_w == 2e3  # type: ignore[union-attr]
    with engine.connect() as conn:  # and the pooled connection waits for writers again
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


@pytest.mark.postgres
def test_postgresql_ends_a_transaction_left_idle_and_keeps_the_urls_options(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head paused mid-write must not hold its locks (the leader row) for ever: the server
    ends its session. The URL's own ``options`` (here the test schema's search_path) still
    apply."""
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as conn:
            timeout = conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar()
            path = conn.execute(text("SHOW search_path")).scalar()
    finally:
        engine.dispose()
    assert timeout == f"{IDLE_IN_TRANSACTION_S}s"
    assert path == make_url(postgres_url).query["options"].removeprefix("-csearch_path=")

    monkeypatch.setattr("slurm_cdgpc.store.engine.IDLE_IN_TRANSACTION_S", 1)
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))  # a transaction begins, then its client "pauses"
            time.sleep(1.5)
            with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):
                conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()


# -- migrations ------------------------------------------------------------------------------


def test_migrations_are_idempotent(engine: Engine) -> None:
    assert current_version(engine) == 0
    latest = len(migrations(engine.dialect.name))
    assert upgrade(engine) == list(range(1, latest + 1))
    assert upgrade(engine) == []
    assert current_version(engine) == latest
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT version, name FROM schema_version ORDER BY version"))
        assert [r.version for r in rows] == list(range(1, latest + 1))


def _reflected(engine: Engine) -> dict[str, Any]:
    inspector = inspect(engine)
    return {
        table: _describe_table(
            columns=[
                (c["name"], c["nullable"], c["type"].python_type)
                for c in inspector.get_columns(table)
            ],
            primary_key=inspector.get_pk_constraint(table)["constrained_columns"],
            foreign_keys=[
                (
                    tuple(fk["constrained_columns"]),
                    fk["referred_table"],
                    tuple(fk["referred_columns"]),
                    (fk.get("options") or {}).get("ondelete"),
                )
                for fk in inspector.get_foreign_keys(table)
            ],
            indexes=[
                (ix["name"], tuple(ix["column_names"])) for ix in inspector.get_indexes(table)
            ],
        )
        for table in inspector.get_table_names()
    }


def _declared() -> dict[str, Any]:
    return {
        table.name: _describe_table(
            columns=[(c.name, c.nullable, c.type.python_type) for c in table.columns],
            primary_key=[c.name for c in table.primary_key.columns],
            foreign_keys=[
                (
                    tuple(c.name for c in fk.columns),
                    fk.referred_table.name,
                    tuple(e.column.name for e in fk.elements),
                    fk.ondelete,
                )
                for fk in table.foreign_key_constraints
            ],
            indexes=[(ix.name, tuple(c.name for c in ix.columns)) for ix in table.indexes],
        )
        for table in Base.metadata.sorted_tables
    }


def _describe_table(**parts: list[Any]) -> dict[str, Any]:
    return {name: sorted(items, key=repr) for name, items in parts.items()}


def test_migrated_schema_matches_the_orm(engine: Engine) -> None:
    upgrade(engine)
    reflected, declared = _reflected(engine), _declared()
    assert sorted(reflected) == sorted(declared)
    for table in declared:
        assert reflected[table] == declared[table], table


def test_the_schema_comparison_notices_drift(engine: Engine, tmp_path: Path) -> None:
    """A column missing from a migration (or added to the ORM only) fails the check above."""
    dialect = engine.dialect.name
    (tmp_path / dialect).mkdir()
    for migration in migrations(dialect):
        sql = migration.path.read_text()
        drifted = "\n".join(
            line for line in sql.splitlines() if not line.strip().startswith("measured_power_w")
        )
        assert drifted != sql
        (tmp_path / dialect / migration.path.name).write_text(drifted)
    upgrade(engine, root=tmp_path)
    reflected, declared = _reflected(engine), _declared()
    assert reflected["decisions"] != declared["decisions"]
    assert {t: d for t, d in reflected.items() if t != "decisions"} == {
        t: d for t, d in declared.items() if t != "decisions"
    }


def test_a_database_from_a_newer_cdgpc_is_refused(engine: Engine) -> None:
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO schema_version (version, name, applied_at_s) VALUES (999, 'x', 0)")
        )
    with pytest.raises(MigrationError, match="version 999, newer"):
        upgrade(engine)


def test_each_dialect_has_the_same_migrations() -> None:
    versions = {
        dialect: [(m.version, m.name) for m in migrations(dialect)]
        for dialect in ("sqlite", "postgresql")
    }
    assert versions["sqlite"] == versions["postgresql"] != []
    assert sql_dir() == Path(__file__).resolve().parents[2] / "sql"


def test_migration_files_split_into_statements() -> None:
    sql = (
        "-- header; not a statement\n"
        "CREATE TABLE a (x INT); -- trailing\n\n"
        "CREATE INDEX i ON a (x);\n"
    )
    assert split_statements(sql) == ["CREATE TABLE a (x INT)", "CREATE INDEX i ON a (x)"]


def test_static_floats_follow_job_statics() -> None:
    assert tuple(f.name for f in dataclasses.fields(JobStatics))[1:] == STATIC_FLOATS


# -- engines ---------------------------------------------------------------------------------


def test_sqlite_runs_with_wal_and_foreign_keys(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'cdgpc.db'}")
    try:
        upgrade(engine)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        store = Store(engine)
        store.register_job("1", "alice", {"n1": [0]})
        with engine.begin() as conn:  # deleting a job deletes its GPU set (ON DELETE CASCADE)
            conn.exec_driver_sql("DELETE FROM jobs")
        assert store.count_rows()["job_gpus"] == 0
    finally:
        engine.dispose()


def test_sqlite_checkpoints_when_told_and_commits_leave_it_until_the_log_is_large(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cdgpc.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        upgrade(engine)
        store = Store(engine)
        store.checkpoint()
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 10_000
        size = path.stat().st_size
        for i in range(300):  # well past SQLite's default of 1,000 pages of log
            store.register_job(str(i + 1), "alice", {f"n{i}": list(range(8))})
        assert path.stat().st_size == size  # every page is still in the log
        store.checkpoint()
        assert path.stat().st_size > size  # now in the database
        assert len(store.jobs()) == 300
    finally:
        engine.dispose()


def test_an_unreachable_database_is_one_line_store_error(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'missing' / 'cdgpc.db'}")
    try:
        with pytest.raises(StoreError) as caught:
            Store(engine).jobs()
        assert "\n" not in str(caught.value) and "unable to open" in str(caught.value)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "url", ["mysql://root@localhost/cdgpc", "postgresql+psycopg2://x@y/z", "not a url"]
)
def test_unsupported_store_urls_are_refused(url: str) -> None:
    with pytest.raises(InputError):
        make_engine(url)


def test_time_limits_and_who_said_the_total_are_kept(store: Store) -> None:
    job = store.register_job("950", "erin", {"gpu01": [0]}, time_limit_s=7200.0, started_at_s=T0_S)
    assert (job.time_limit_s, job.started_at_s, job.work_source) == (7200.0, T0_S, "time-limit")
    job = store.record_progress("950", 10, iterations_total=500)
    assert job is not None and (job.iterations_total, job.work_source) == (500, "framework")
    job = store.register_job("950", "erin", {"gpu01": [0]}, iterations_total=800)
    assert (job.iterations_total, job.work_source) == (800, "comment")
    job = store.record_progress("950", 20, iterations_total=500)  # iters= wins from now on
    assert job is not None and (job.iterations_done, job.iterations_total) == (20, 800)
    # the head's round writes every job's step at once: the same rules, one transaction
    store.register_job("952", "erin", {"gpu01": [2]})
    store.record_progress_many([("950", 30, 500), ("952", 7, 70), ("999", 1, None)])

    def counts(job_id: str) -> tuple[int, int | None] | None:
        job = store.job(job_id)
        return None if job is None else (job.iterations_done, job.iterations_total)

    assert (counts("950"), counts("952"), counts("999")) == ((30, 800), (7, 70), None)
    with pytest.raises(InputError, match="iteration counts must be ≥ 0"):
        store.record_progress_many([("952", 8, None), ("950", -1, None)])
    assert counts("952") == (7, 70)  # nothing changed
    job = store.record_time_limit("950", 3600.0, None)
    assert job is not None and (job.time_limit_s, job.started_at_s) == (3600.0, T0_S)
    assert store.job("950") == job
    for bad in (0.0, -5.0, math.inf, math.nan):
        with pytest.raises(InputError, match="time limit must be > 0 s"):
            store.register_job("951", "erin", {"gpu01": [1]}, time_limit_s=bad)
        with pytest.raises(InputError, match="time limit must be > 0 s"):
            store.record_time_limit("950", bad, None)
    assert store.job("951") is None and store.job("950") == job


def test_a_serving_jobs_latency_objective_is_kept(store: Store, clock: FakeClock) -> None:
    job = store.register_job("960", "erin", {"gpu01": [0]}, slo_percentile=99.0, slo_latency_s=0.25)
    assert (job.slo_percentile, job.slo_latency_s) == (99.0, 0.25)
    job = store.register_job("960", "erin", {"gpu02": [0]})  # another node's Prolog: kept
    assert (job.slo_percentile, job.slo_latency_s) == (99.0, 0.25) and store.job("960") == job
    job = store.register_job("960", "erin", {"gpu02": [0]}, slo_percentile=99.9, slo_latency_s=1.5)
    assert store.job("960") == job and (job.slo_percentile, job.slo_latency_s) == (99.9, 1.5)
    store.finish_job("960")
    clock.advance(60)
    requeued = store.register_job("960", "erin", {"gpu03": [1]})
    assert (requeued.slo_percentile, requeued.slo_latency_s) == (99.9, 1.5)
    plain = store.register_job("961", "erin", {"gpu01": [1]})
    assert (plain.slo_percentile, plain.slo_latency_s) == (None, None)
    for percentile, latency_s, message in [
        (99.0, None, "needs a percentile and a latency, got 99.0 and None"),
        (None, 0.25, "needs a percentile and a latency, got None and 0.25"),
        (100.0, 0.25, r"slo percentile must be in \(0, 100\), got 100.0"),
        (math.nan, 0.25, "slo percentile must be in"),
        (99.0, 0.0, "slo latency must be > 0 s, got 0.0"),
        (99.0, math.inf, "slo latency must be > 0 s, got inf"),
    ]:
        with pytest.raises(InputError, match=message):
            store.register_job(
                "961", "erin", {"gpu01": [1]}, slo_percentile=percentile, slo_latency_s=latency_s
            )
    assert store.job("961") == plain


def test_the_job_name_is_kept_and_a_bad_one_changes_nothing(store: Store) -> None:
    job = store.register_job("970", "erin", {"gpu01": [0]}, job_name="train-bert")
    assert job.job_name == "train-bert" and store.job("970") == job
    job = store.register_job("970", "erin", {"gpu02": [0]})  # another node's Prolog: kept
    assert job.job_name == "train-bert" and store.job("970") == job
    assert store.register_job("971", "erin", {"gpu01": [1]}).job_name is None
    for bad in ("", "a\tb", "x" * 201):
        with pytest.raises(InputError, match="job_name: must be 1 to 200 printable"):
            store.register_job("972", "erin", {"gpu01": [2]}, job_name=bad)
    assert store.job("972") is None
