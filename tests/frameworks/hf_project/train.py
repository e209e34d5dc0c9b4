"""A small Hugging Face Trainer project as a user writes it (a tiny GPT-2 built from a config: no download),
with ddpack's change: `callbacks=[DdpackCallback()]` and `resume_from_checkpoint=last_checkpoint(...)`
(both left out with DDPACK_ADAPTER=0)."""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from faults import in_training_step

from ddpack_run.hf import DdpackCallback, last_checkpoint


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int = 32, vocab: int = 128) -> None:
        self.data = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.data[index], "labels": self.data[index]}


class Faults(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        in_training_step(args.process_index, state.global_step)


def main() -> None:
    output = os.environ.get("OUTPUT_DIR", "hf-output")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=output,
        per_device_train_batch_size=8,
        num_train_epochs=float(os.environ.get("EPOCHS", "3")),
        learning_rate=1e-3,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    adapter = os.environ.get("DDPACK_ADAPTER", "1") == "1"
    callbacks = [Faults(), *([DdpackCallback()] if adapter else [])]
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(1024), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=last_checkpoint(output) if adapter else None)


if __name__ == "__main__":
    main()
