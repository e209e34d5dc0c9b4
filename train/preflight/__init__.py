"""`entrypoint --preflight`: a bounded job-wide health check run instead of the trainer, under the same
launch plan (same image, ranks, master, backend, snapshot folder).

Checks, in order: identity agreement (`identity`), all-reduce sweep and point-to-point ring (`comm`),
per-rank matrix-multiply rate (`compute`), the snapshot folder (`storage`); `report` prints rank 0's
table and the JSON file; `__main__` wires them with one time budget.
"""
