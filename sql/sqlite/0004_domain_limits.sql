-- slurm-cdgpc store, version 4 (SQLite): a power domain's limit set by an admin.
-- Keep in step with sql/postgresql/0004_domain_limits.sql and slurm_cdgpc/store/schema.py.
--
-- domain: the power domain (a name of the head's topology file) whose limit the change sets,
-- NULL for the cluster's budget. A domain's limit at time t is its latest change effective at
-- or before t, else the topology file's; the budget's, the latest with a NULL domain.

ALTER TABLE budget_changes ADD COLUMN domain VARCHAR(255);
