"""slurm-cdgpc: cooperative distributed GPU power capping for Slurm clusters."""

__version__ = "0.1.0"
