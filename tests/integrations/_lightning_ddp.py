"""One phase of a 2-process DDP Lightning job on CPU (gloo), for tests/integrations/test_lightning.py: ``fit``
trains N steps saving through TieredCheckpointIO, ``resume`` continues from ``ckpt_path="last"`` to 2N, ``straight``
trains 2N steps without checkpoints. Lightning's DDP launcher starts the second process by running this script
again; each rank writes its final weights (as lists) and the loaded step to ``<out>/<phase>-r<rank>.json``.

    python tests/integrations/_lightning_ddp.py PHASE OUT_DIR [REMOTE]
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tierckpt.lightning import TieredCheckpointIO

N, K = 4, 2


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 + self.global_step * 2 + self.global_rank)
        x = torch.randn(8, 4, generator=g)
        return torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(64.0), batch_size=8)


def main() -> None:
    phase, out = sys.argv[1], sys.argv[2]
    remote = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    model = Net()
    io = TieredCheckpointIO(os.path.join(out, "local"), remote=remote, keep_local=5)
    plugins, callbacks = ([], []) if phase == "straight" else (
        [io], [ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=K, save_last=True)])
    trainer = L.Trainer(max_steps=N if phase == "fit" else 2 * N, accelerator="cpu", devices=2, strategy="ddp",
                        plugins=plugins, callbacks=callbacks, enable_checkpointing=phase != "straight",
                        enable_progress_bar=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path="last" if phase == "resume" else None)
    result = {"weights": {k: v.tolist() for k, v in model.state_dict().items()}, "global_step": trainer.global_step,
              "loaded_step": io._loaded_step}
    with open(os.path.join(out, f"{phase}-r{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
