"""Reconcile with Slurm: ``squeue --json`` as Slurm 22.05 and 24.11 print it, and adoption of
running jobs that never registered, against the real head loop and in-process agents."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from slurm_cdgpc.coordinator.reconcile import reconcile_with_slurm
from slurm_cdgpc.errors import InputError
from slurm_cdgpc.slurm.squeue import (
    SlurmJob,
    expand_hostlist,
    gres_gpu_indices,
    parse_squeue_json,
)
from tests.unit.test_coordinator_daemon import T0_S, MakeCluster, make_cluster, register_job

__all__ = ["make_cluster"]  # the fixture, imported to be found


def _n(value: float) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": value}


#: one running two-node job as 22.05 prints it (plain numbers, state as a string)
SQUEUE_22_05 = {
    "jobs": [
        {
            "job_id": 17,
            "job_state": "RUNNING",
            "user_name": "alice",
            "nodes": "n[1-2]",
            "gres_detail": ["gpu:2(IDX:0-1)", "gpu:1(IDX:3)"],
            "comment": "project x deadline=+2h iters=900",
            "submit_time": int(T0_S) - 600,
            "start_time": int(T0_S) - 500,
            "time_limit": 600,
            "deadline": 0,
        }
    ]
}

#: the same job as 24.11 prints it (numbers as set/infinite/number, state as a list)
SQUEUE_24_11 = {
    "jobs": [
        {
            "job_id": 17,
            "job_state": ["RUNNING"],
            "user_name": "alice",
            "nodes": "n[1-2]",
            "gres_detail": ["gpu:a100:2(IDX:0-1)", "gpu:a100:1(IDX:3)"],
            "comment": "project x deadline=+2h iters=900",
            "submit_time": _n(int(T0_S) - 600),
            "start_time": _n(int(T0_S) - 500),
            "time_limit": _n(600),
            "deadline": {"set": False, "infinite": False, "number": 0},
        }
    ]
}


@pytest.mark.parametrize("shape", [SQUEUE_22_05, SQUEUE_24_11], ids=["22.05", "24.11"])
def test_squeue_gives_each_node_its_gpus(shape: dict[str, Any]) -> None:
    [job] = parse_squeue_json(json.dumps(shape))
    assert job.gpus == {"n1": (0, 1), "n2": (3,)}
    assert (job.submit_s, job.start_s, job.deadline_s) == (T0_S - 600, T0_S - 500, None)


def test_hostlists_expand_as_slurm_prints_them() -> None:
    assert expand_hostlist("n[1-2],gpu[08-10]x,solo") == [
        "n1",
        "n2",
        "gpu08x",
        "gpu09x",
        "gpu10x",
        "solo",
    ]
    assert expand_hostlist("r[1-2]-n[1,3]") == ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]
    for bad in ("n[1-2", "n[2-1]", "n[a-b]", "n[1-2]]", "n[0-999999]"):
        with pytest.raises(InputError):
            expand_hostlist(bad)


def test_gres_detail_reads_only_gpus() -> None:
    assert gres_gpu_indices("gpu:a100:2(IDX:0,2),mps:100(IDX:0)") == (0, 2)
    assert gres_gpu_indices("gpu(IDX:1-3)") == (1, 2, 3)
    assert gres_gpu_indices("gpu:0(IDX:N/A)") == ()
    assert gres_gpu_indices("") == ()


def test_unreadable_allocation_leaves_the_job_without_gpus() -> None:
    # one gres entry for two nodes: which GPUs belong where is unknown, so none are claimed
    text = json.dumps(
        {"jobs": [{"job_id": 5, "job_state": "RUNNING", "nodes": "n[1-2]", "gres_detail": ["x"]}]}
    )
    [job] = parse_squeue_json(text)
    assert job.gpus == {}


def _job(job_id: str, **over: Any) -> SlurmJob:
    base: dict[str, Any] = {
        "job_id": job_id,
        "user": "bob",
        "state": "RUNNING",
        "nodes": "n1",
        "comment": "deadline=2026-01-01T02:00Z",
        "start_s": T0_S - 120.0,
        "time_limit_s": 7200.0,
        "array_job_id": None,
        "submit_s": T0_S - 130.0,
        "gpus": {"n1": (1,)},
    }
    return SlurmJob(**{**base, **over})


def test_a_running_job_that_never_registered_is_adopted_with_its_deadline(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.store.set_budget(600.0, "root")
    cluster.tick()
    running = {j.job_id: j for j in parse_squeue_json(json.dumps(SQUEUE_22_05))}
    result = reconcile_with_slurm(
        cluster.head, running, now_s=cluster.clock(), grace_s=30.0, tz=UTC
    )
    assert result.adopted == ["17"] and result.finished == []
    job = cluster.store.job("17")
    assert job is not None and job.user == "alice" and job.iterations_total == 900
    assert job.state == "adopted"
    assert job.deadline_s == T0_S - 600 + 7200  # +2h from the submit time, as the Prolog does
    assert {(g.node, g.gpu_index) for g in job.gpus} == {("n1", 0), ("n1", 1), ("n2", 3)}
    assert (job.time_limit_s, job.started_at_s) == (600 * 60.0, T0_S - 500)
    cluster.tick()
    requests = cluster.last_requests()
    assert {p.gpu for p in requests["n1"].setpoints} == {0, 1}
    assert {p.gpu for p in requests["n2"].setpoints} == {3}


def test_adoption_waits_for_the_prolog_and_never_revives_a_known_job(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster()
    cluster.tick()
    now_s = cluster.clock()
    register_job(cluster, "30", "n1", 0)
    cluster.head.deregister_job("30")  # its Epilog came; squeue may list it a moment longer
    running = {
        "20": _job("20", start_s=now_s - 5.0),  # its Prolog may still be on its way
        "30": _job("30"),
        "40": _job("40", state="COMPLETING"),
        "50": _job("50", gpus={}),  # no GPUs: nothing to cap
        "60": _job("60", comment="deadline=tomorow"),  # unreadable: adopted, no deadline
    }
    result = reconcile_with_slurm(cluster.head, running, now_s=now_s, grace_s=30.0)
    assert result.adopted == ["60"]
    assert cluster.store.job("30").state == "finished"
    for job_id in ("20", "40", "50"):
        assert cluster.store.job(job_id) is None
    adopted = cluster.store.job("60")
    assert adopted is not None
    assert adopted.deadline_s == T0_S - 120.0 + 7200.0  # the time limit stands in


def test_an_adopted_serving_job_keeps_its_latency_objective(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.tick()
    running = {"70": _job("70", comment="vllm slo=p99.9:250ms deadline=2026-01-01T02:00Z")}
    reconcile_with_slurm(cluster.head, running, now_s=cluster.clock(), grace_s=30.0)
    job = cluster.store.job("70")
    assert job is not None and (job.state, job.slo_percentile, job.slo_latency_s) == (
        "adopted",
        99.9,
        0.25,
    )
    assert job.deadline_s == datetime(2026, 1, 1, 2, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("fields", "waits"),
    [
        ({"state_reason": "Resources", "tres_per_node": "gres:gpu:8"}, True),  # 22.05
        ({"state_reason": "Priority", "tres_per_node": "gres/gpu:8"}, True),  # 23.02+
        ({"state_reason": ["Resources"], "tres_req_str": "cpu=1,gres/gpu=2"}, True),
        ({"state_reason": "Dependency", "tres_per_node": "gres:gpu:8"}, False),  # not for GPUs
        ({"state_reason": "JobHeldUser", "tres_per_node": "gres:gpu:8"}, False),
        ({"state_reason": "Resources", "tres_per_node": ""}, False),  # asks for no GPU
    ],
)
def test_a_pending_job_waits_for_gpus_only_for_want_of_resources(
    fields: dict[str, Any], waits: bool
) -> None:
    pending = {"job_id": 18, "job_state": "PENDING", "user_name": "bob", "nodes": "", **fields}
    jobs = parse_squeue_json(json.dumps({"jobs": [SQUEUE_22_05["jobs"][0], pending]}))
    assert [j.waits_for_gpus for j in jobs] == [False, waits]
    assert [j.active for j in jobs] == [True, False]


def test_reconcile_takes_slurms_time_limit_for_registered_jobs(make_cluster: MakeCluster) -> None:
    cluster = make_cluster()
    cluster.tick()
    register_job(cluster, "17", "n1", 0)  # a Prolog that could not read the limit
    assert cluster.store.job("17").time_limit_s is None
    running = {j.job_id: j for j in parse_squeue_json(json.dumps(SQUEUE_22_05))}
    reconcile_with_slurm(cluster.head, running, now_s=cluster.clock(), grace_s=30.0)
    job = cluster.store.job("17")
    assert (job.time_limit_s, job.started_at_s, job.work_source) == (
        36000.0,
        T0_S - 500,
        "time-limit",
    )
