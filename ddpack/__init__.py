"""Host-side tooling: build images, push them, convert them to squashfs, run the local smoke job.

Never imported inside a training rank (the image's runtime is `entrypoint` and `train`).
"""
