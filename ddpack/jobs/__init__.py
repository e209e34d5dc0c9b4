"""ddpack's second wing: running jobs and reading what they left.

A run from `ddpack submit` (submit, run_file, sweep) to its record (run_record), its state and logs (status, runs,
slurm_cli), the run folder's metrics read back as segments (segments) for `ddpack compare` and `make report` (compare, report),
and the staging model the job's choice follows (goodput_model). It takes an image (or builds one through the first wing)
and never changes one.
"""
