-- slurm-cdgpc store, version 1 (SQLite). Keep in step with sql/postgresql/0001_initial.sql and
-- slurm_cdgpc/store/schema.py (tests/integration/test_store.py compares them).
-- Times are UNIX epoch seconds (REAL), powers watts, clocks MHz.

CREATE TABLE schema_version (
    version INTEGER NOT NULL PRIMARY KEY,
    name VARCHAR(200) NOT NULL,
    applied_at_s REAL NOT NULL
);

CREATE TABLE budget_changes (
    id INTEGER NOT NULL PRIMARY KEY,
    effective_at_s REAL NOT NULL,
    budget_w REAL NOT NULL,
    set_by VARCHAR(64) NOT NULL,
    reason TEXT NOT NULL,
    created_at_s REAL NOT NULL,
    CONSTRAINT budget_changes_positive CHECK (budget_w > 0)
);
CREATE INDEX ix_budget_changes_effective ON budget_changes (effective_at_s);

CREATE TABLE jobs (
    job_id VARCHAR(64) NOT NULL PRIMARY KEY,
    user_name VARCHAR(64) NOT NULL,
    state VARCHAR(16) NOT NULL,
    deadline_s REAL,
    iterations_total BIGINT,
    iterations_done BIGINT NOT NULL,
    registered_at_s REAL NOT NULL,
    finished_at_s REAL,
    CONSTRAINT jobs_state CHECK (state IN ('registered', 'running', 'finished', 'adopted'))
);
CREATE INDEX ix_jobs_state ON jobs (state);

CREATE TABLE job_gpus (
    job_id VARCHAR(64) NOT NULL,
    node VARCHAR(255) NOT NULL,
    gpu_index INTEGER NOT NULL,
    PRIMARY KEY (job_id, node, gpu_index),
    FOREIGN KEY (job_id) REFERENCES jobs (job_id) ON DELETE CASCADE
);

CREATE TABLE nodes (
    name VARCHAR(255) NOT NULL PRIMARY KEY,
    url VARCHAR(512) NOT NULL,
    transport VARCHAR(8) NOT NULL,
    last_seen_s REAL,
    reachable BOOLEAN NOT NULL,
    gpu_count INTEGER NOT NULL,
    gpu_type VARCHAR(64) NOT NULL,
    worst_case_power_w REAL NOT NULL,
    CONSTRAINT nodes_transport CHECK (transport IN ('http', 'ssh'))
);

-- Every float of the model state is little-endian float64 bytes (bit for bit, NaN included);
-- statics holds graphics_max_mhz, memory_max_mhz, knee_mhz, mem_mask, idle_power_w, power_limit_w.
CREATE TABLE job_models (
    job_id VARCHAR(64) NOT NULL PRIMARY KEY,
    family VARCHAR(16) NOT NULL,
    updated_at_s REAL NOT NULL,
    power_theta BLOB NOT NULL,
    power_cov BLOB NOT NULL,
    power_err_var BLOB NOT NULL,
    power_count BIGINT NOT NULL,
    time_theta BLOB NOT NULL,
    time_cov BLOB NOT NULL,
    time_err_var BLOB NOT NULL,
    time_count BIGINT NOT NULL,
    gpus INTEGER NOT NULL,
    statics BLOB NOT NULL,
    FOREIGN KEY (job_id) REFERENCES jobs (job_id) ON DELETE CASCADE
);

CREATE TABLE measurements (
    id INTEGER NOT NULL PRIMARY KEY,
    time_s REAL NOT NULL,
    node VARCHAR(255) NOT NULL,
    gpu_index INTEGER NOT NULL,
    job_id VARCHAR(64),
    power_w REAL NOT NULL,
    energy_j REAL,
    graphics_mhz INTEGER,
    memory_mhz INTEGER,
    iterations_per_s REAL
);
CREATE INDEX ix_measurements_time ON measurements (time_s);
CREATE INDEX ix_measurements_job_time ON measurements (job_id, time_s);

CREATE TABLE decisions (
    id INTEGER NOT NULL PRIMARY KEY,
    time_s REAL NOT NULL,
    interval_index BIGINT NOT NULL,
    status VARCHAR(32) NOT NULL,
    mode VARCHAR(16) NOT NULL,
    shadow BOOLEAN NOT NULL,
    price REAL NOT NULL,
    budget_w REAL NOT NULL,
    effective_budget_w REAL NOT NULL,
    predicted_power_w REAL NOT NULL,
    measured_power_w REAL,
    solve_s REAL NOT NULL
);
CREATE INDEX ix_decisions_time ON decisions (time_s);

CREATE TABLE decision_setpoints (
    decision_id INTEGER NOT NULL,
    job_id VARCHAR(64) NOT NULL,
    graphics_mhz INTEGER NOT NULL,
    memory_mhz INTEGER NOT NULL,
    predicted_power_w REAL NOT NULL,
    PRIMARY KEY (decision_id, job_id),
    FOREIGN KEY (decision_id) REFERENCES decisions (id) ON DELETE CASCADE
);
