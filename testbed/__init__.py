"""What the tests and the benchmarks both stand on: the test Slurm cluster (`slurm_cluster`, also CI's set-up
tool), jobs submitted to it as a user does (`slurm_jobs`), the README's and docs' worked examples
(`readme_examples`), a clean environment for child processes (`env`) and the GPT both measure (`gpt`).

Host-side only: nothing here is copied into an image.
"""
