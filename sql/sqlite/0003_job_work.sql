-- slurm-cdgpc store, version 3 (SQLite): what bounds a job's work when it does not say it.
-- Keep in step with sql/postgresql/0003_job_work.sql and slurm_cdgpc/store/schema.py.
--
-- time_limit_s: Slurm's time limit (NULL: none, UNLIMITED or not known yet); started_at_s: when
-- Slurm started the job (NULL: not known; the registration time stands in); total_source: who
-- said iterations_total, 'comment' (iters=, which wins) or 'framework' (a progress report's
-- total), NULL when nobody did.

ALTER TABLE jobs ADD COLUMN time_limit_s REAL;
ALTER TABLE jobs ADD COLUMN started_at_s REAL;
ALTER TABLE jobs ADD COLUMN total_source VARCHAR(16)
    CONSTRAINT jobs_total_source CHECK (total_source IN ('comment', 'framework'));
