"""Searches over many runs: the search space, the study, where trials run (this machine, SLURM arrays), results."""
