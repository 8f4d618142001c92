-- slurm-cdgpc store, version 6 (SQLite): the job's name, as Slurm has it.
-- Keep in step with sql/postgresql/0006_job_name.sql and slurm_cdgpc/store/schema.py.
--
-- job_name: Slurm's JobName (sbatch --job-name, else the script's name), from the line of
-- scontrol show job the Prolog reads; NULL: not known. With the user and the GPU type it is
-- the job's kind, whose earlier jobs' models a new one may start from (kind_prior).

ALTER TABLE jobs ADD COLUMN job_name VARCHAR(200);
