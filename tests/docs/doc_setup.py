"""Small stand-ins that the documentation's hidden setup blocks import: what a reader's script already has (a data
loader, a dataset, a tiny model) before the shown code runs. Kept small so that every page runs in seconds."""

from __future__ import annotations

import torch


class StatefulLoader:
    """Batches of ``data`` in a shuffled order that depends on the epoch only; ``state_dict()`` is its position, so
    a restored loader goes on with the batch after the last one trained on."""

    def __init__(self, data: torch.Tensor, batch_size: int, seed: int = 0) -> None:
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.epoch, self.index = 0, 0

    def next(self) -> torch.Tensor:
        if self.index == len(self.data) // self.batch_size:
            self.epoch, self.index = self.epoch + 1, 0
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        picked = order[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        return self.data[picked]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.index = sd["epoch"], sd["index"]


class Tokens(torch.utils.data.Dataset):
    """A few random token sequences (a stand-in for a tokenized corpus): two batches of 8."""

    def __init__(self, n: int = 16, length: int = 16, vocab: int = 101) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    """A GPT-2 built from a config (nothing is downloaded), small enough to train a few steps in a second."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=101, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def lit_regressor():
    """A small LightningModule: a 2-layer regressor on 64 random samples (two batches an epoch)."""
    import lightning.pytorch as L

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self):
            x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                               batch_size=32)

    return Regressor()
