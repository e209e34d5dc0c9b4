"""Host-side tooling, in two wings: ddpack.images (images: build, push, squashfs, the local smoke job) and ddpack.jobs
(Slurm runs: submit, status, logs, compare, report). Beside them: the `ddpack` command (cli, completion), the
host's errors, its private files and the job's own definitions it reads (job_side).

Never imported inside a training rank (the image's runtime is `entrypoint` and `train`).
"""
