"""The Slurm seam: the job comment grammar, the Prolog/Epilog, the spool, and Slurm's commands.

Only this package runs Slurm commands (``scontrol``, ``squeue``). The modules the Prolog and
Epilog import (`comment`, `env`, `spool`, `scontrol`, `hooks`) use the standard library and the
project's stdlib-only modules (`slurm_cdgpc.config`, `slurm_cdgpc.transport`) only: they must
start in milliseconds with an empty ``PATH``.
"""
