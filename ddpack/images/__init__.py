"""ddpack's first wing: building images and shipping them.

The project's image on the bundle (app, build_inputs, images, base, engine), the local two-container smoke job (smoke),
the push to Amazon ECR (push, ecr, credentials) and the conversion to the squashfs pyxis runs (sqsh, enroot_tree).
Its one product is an image, or a squashfs of it; it never starts a Slurm job.
"""
