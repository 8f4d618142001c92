"""Nested power domains as the controller sees them (`DomainLimits`): each domain's limit and the
jobs' shares of it. The cluster is the root: its limit is the step's budget, not one of these.
The controller's math: never reaches `store/`, `transport/`, `agent/`, `coordinator/` or `cli/`
(`tests/unit/test_import_graph.py`). Design: DESIGN.md, "Power domains"; tests:
`tests/unit/test_control_domains.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.model.families import FloatArray

IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class DomainLimits:
    """The domains below the cluster for one step (rows, PDUs, racks: any depth).

    Membership is sparse, as `QueueState`'s placement: one (domain, job row, share) triple for
    each domain a job has GPUs under, with share the fraction of the job's GPUs there. A job on
    two racks of one row has two rack triples of 0.5 and one row triple of 1; a job on nodes
    in no domain has none (it is under the cluster alone).
    """

    names: tuple[str, ...]
    #: (D,) each domain's limit
    limit_w: FloatArray
    #: (D,) what the domain's GPUs outside the plan may draw (idle, released, held-out GPUs)
    uncontrolled_w: FloatArray
    #: the triples, (K,) each
    domain: IntArray
    job_row: IntArray
    share: FloatArray
    #: (D,) each domain's parent's index, −1 under the cluster; parents come before their
    #: children (None: every domain directly under the cluster)
    parent: IntArray | None = None

    def __post_init__(self) -> None:
        d = len(self.names)
        if self.limit_w.shape != (d,) or self.uncontrolled_w.shape != (d,):
            raise InputError(f"{d} domains need {d} limits and {d} uncontrolled powers")
        k = self.domain.shape
        if self.job_row.shape != k or self.share.shape != k:
            raise InputError("domain memberships need a domain, a job row and a share each")
        if k[0] and (self.domain.min() < 0 or self.domain.max() >= d):
            raise InputError("a domain membership names no known domain")
        if not np.all(np.isfinite(self.limit_w) & (self.limit_w > 0)):
            raise InputError("every power domain's limit must be a positive number of watts")
        if k[0] and not np.all((self.share > 0) & (self.share <= 1)):
            raise InputError("a job's share of a power domain must be in (0, 1]")
        if self.parent is not None and (
            self.parent.shape != (d,) or np.any(self.parent >= np.arange(d))
        ):
            raise InputError("every power domain's parent must come before it")

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def none(cls) -> DomainLimits:
        """No domain below the cluster."""
        empty_f, empty_i = np.zeros(0), np.zeros(0, dtype=np.int64)
        return cls((), empty_f, empty_f, empty_i, empty_i, empty_f)

    def job_power_w(self, job_power_w: FloatArray) -> FloatArray:
        """(D,) each domain's share of the jobs' power, Σ_n share_dn p_n."""
        return np.bincount(
            self.domain, weights=self.share * job_power_w[self.job_row], minlength=len(self)
        ).astype(np.float64)

    def jobs(self) -> IntArray:
        """(D,) how many jobs have GPUs under each domain."""
        return np.bincount(self.domain, minlength=len(self)).astype(np.int64)

    def parents(self) -> IntArray:
        return np.full(len(self), -1, dtype=np.int64) if self.parent is None else self.parent
