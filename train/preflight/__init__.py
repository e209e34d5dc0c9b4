"""`entrypoint --preflight`: a bounded job-wide health check run instead of the trainer, under the same
launch plan (same image, ranks, master, backend, snapshot folder).

Checks, in order: identity agreement (`identity`), each node's seconds-cheap health (`node`: /dev/shm, locked
memory, RDMA devices, the GPUs as nvidia-smi reads them), all-reduce sweep and point-to-point ring (`comm`),
per-rank matrix-multiply rate (`compute`), with --preflight-strict on GPUs the copy and all-reduce floors
(`throughput`), the snapshot folder (`storage`); `report` prints rank 0's table and the JSON file (node checks as
`verdict.NodeCheck` records); `__main__` wires them with one time budget.
"""
