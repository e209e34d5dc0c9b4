"""ddpack's second wing: running jobs and reading what they left.

A run from `ddpack submit` (submit; submit_checks: every check before a job is queued; job_script: the sbatch script;
run_toml: `--file run.toml`; sweep_points: a sweep's points and sweep.json) to its record (run_json: run.json), found
again (find_runs), its state from Slurm and the run's records (status, decisions: decisions.jsonl, slurm_cli), its
logs (logs), acted on (run_actions: cancel, resubmit, rm; sweep: a sweep as a whole), and the run folder's metrics
read back as segments (run_metrics) for `ddpack compare` and `make report` (compare, report, ledger, export), and the
staging model the job's choice follows (goodput_model). It takes an image (or builds one through the first wing) and
never changes one.
"""
