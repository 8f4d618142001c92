"""Tests against real components (PostgreSQL, Slurm, daemons over loopback)."""
