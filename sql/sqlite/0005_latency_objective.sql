-- slurm-cdgpc store, version 5 (SQLite): a serving job's latency objective.
-- Keep in step with sql/postgresql/0005_latency_objective.sql and slurm_cdgpc/store/schema.py.
--
-- slo_percentile and slo_latency_s: the comment's slo=p99:250ms (99, 0.25): the percentile of
-- request latencies and the latency it stays within, seconds; both NULL: not a serving job.

ALTER TABLE jobs ADD COLUMN slo_percentile REAL;
ALTER TABLE jobs ADD COLUMN slo_latency_s REAL;
