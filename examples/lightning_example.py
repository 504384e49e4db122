"""Lightning + tierckpt: train 20 steps with checkpoints every 5, then a fresh Trainer resumes from "last" to 40.

    python examples/lightning_example.py [--dir /tmp/tierckpt-lightning]
"""

import argparse
import os
import tempfile

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tierckpt.lightning import TieredCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 16, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)


def run(root: str, max_steps: int, ckpt_path=None) -> None:
    io = TieredCheckpointIO(os.path.join(root, "local"), remote=os.path.join(root, "remote"), keep_local=2)
    cb = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=5, save_last=True)
    trainer = L.Trainer(max_steps=max_steps, plugins=[io], callbacks=[cb], accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), ckpt_path=ckpt_path)  # teardown waits until every save is on both tiers
    print(f"trained to step {trainer.global_step}; markers: {sorted(os.listdir(cb.dirpath))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tierckpt-lightning-")
    run(root, 20)
    run(root, 40, ckpt_path="last")  # a restarted job: resumes from the newest intact step (20)
    print("steps in the local tier:",
          sorted(d for d in os.listdir(os.path.join(root, "local")) if d.startswith("step-")))
