-- slurm-cdgpc store, version 2 (PostgreSQL): the leader lock of the active cdgpcd. Keep in step
-- with sql/sqlite/0002_leader.sql and slurm_cdgpc/store/schema.py.
--
-- One row. The head that holds it (holder, until expires_at_s) is the only one that may push
-- setpoints; epoch rises at every change of holder (to the database's clock in milliseconds, or
-- by one) and is sent in every exchange, so that an agent refuses a head that lost the lock
-- (slurm_cdgpc/store/leader.py). holder is '' when free.
-- Times are UNIX epoch seconds of the database server's clock, whatever the heads' clocks say.

CREATE TABLE leader (
    id INTEGER NOT NULL PRIMARY KEY,
    holder VARCHAR(255) NOT NULL,
    epoch BIGINT NOT NULL,
    acquired_at_s DOUBLE PRECISION NOT NULL,
    expires_at_s DOUBLE PRECISION NOT NULL,
    CONSTRAINT leader_one_row CHECK (id = 1),
    CONSTRAINT leader_epoch CHECK (epoch >= 0)
);
INSERT INTO leader (id, holder, epoch, acquired_at_s, expires_at_s) VALUES (1, '', 0, 0, 0);
