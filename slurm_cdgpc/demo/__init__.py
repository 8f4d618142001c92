"""``make demo``: the real daemons on one machine, replaying a slice of a real trace.

`cluster` starts ``cdgpcd`` on a SQLite file and four ``cdgpc-noded`` with eight simulated GPUs
each, on loopback; `replayer` plays Slurm's part (FIFO first-fit placement, the Prolog and the
Epilog, launching the jobs' work on the simulated GPUs); `live` draws the terminal table;
`report` measures the run from the head's store and plots it.
"""
