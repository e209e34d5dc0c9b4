"""The DDP trainer that runs inside the image: `python -m train --help`."""
