"""Which rank each framework thinks this process is: Hugging Face (accelerate's state, through TrainingArguments)
and Lightning (its cluster environment, in a one-step fit), beside what the launcher set. One JSON line."""

import json
import os

import lightning as L
import torch
from transformers import TrainingArguments

hf = TrainingArguments(output_dir="who-output", use_cpu=True, report_to=[])
seen = {"env": [int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]}
seen["hf"] = [hf.process_index, hf.world_size, hf.local_process_index]


class Probe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_start(self) -> None:
        seen["lightning"] = [self.trainer.global_rank, self.trainer.world_size, self.trainer.local_rank]
        seen["lightning_environment"] = type(self.trainer.strategy.cluster_environment).__name__
        # One write per line: torchrun's workers share one stdout pipe, and print() writes the text and its
        # newline apart, so two ranks' lines could join (seen on a loaded machine).
        os.write(1, ("who " + json.dumps(seen) + "\n").encode())


trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ["DEVICES"]), num_nodes=int(os.environ["NODES"]), strategy="ddp", max_steps=1,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip
trainer.fit(Probe(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2))
torch.distributed.destroy_process_group()  # a live gloo group at exit can abort the process (134)
