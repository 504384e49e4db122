"""2-process DDP Lightning jobs on CPU (gloo), for tests/integrations/test_lightning.py.

    python tests/integrations/_lightning_ddp.py OUT_DIR

runs four jobs one after the other, each as 2 rank processes, and writes each rank's final weights (as lists), its
global step and the step the plug-in loaded to ``OUT_DIR/<job>-r<rank>.json``:

- ``straight``: 2N steps without checkpoints (the reference);
- ``fit``: N steps saving through TieredCheckpointIO on rank 0, a remote beside the local tier, in ``OUT_DIR/fit``;
- ``resume``: a new job on a copy of ``fit``'s folder continues from ``ckpt_path="last"`` to 2N;
- ``resume-remote``: the same with the local tier gone, so both ranks read the remote.

The ranks are launched as torchrun or Slurm launch them: ``LOCAL_RANK``, ``WORLD_SIZE`` and the master's address in
the environment, so Lightning runs each as one rank of an externally launched job. They are forked from this process
once it has imported Lightning (about 6 s of CPU per interpreter otherwise), each job's ranks exiting before the next
job starts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import traceback

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tierckpt.lightning import TieredCheckpointIO

N, K = 4, 2
WORLD = 2


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


def run_rank(job: str, folder: str, out: str) -> None:
    """One rank of ``job``, its tiers in ``folder``; its result goes to ``out/<job>-r<rank>.json``."""
    torch.manual_seed(0)
    model = Net()
    straight = job == "straight"
    io = TieredCheckpointIO(os.path.join(folder, "local"), remote=None if straight else os.path.join(folder, "remote"),
                            keep_local=5)
    plugins, callbacks = ([], []) if straight else (
        [io], [ModelCheckpoint(dirpath=os.path.join(folder, "ckpts"), every_n_train_steps=K, save_last=True)])
    trainer = L.Trainer(max_steps=N if job == "fit" else 2 * N, accelerator="cpu", devices=WORLD, strategy="ddp",
                        plugins=plugins, callbacks=callbacks, enable_checkpointing=not straight,
                        enable_progress_bar=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path="last" if job.startswith("resume") else None)
    result = {"weights": {k: v.tolist() for k, v in model.state_dict().items()}, "global_step": trainer.global_step,
              "loaded_step": io._loaded_step}
    with open(os.path.join(out, f"{job}-r{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


def launch(job: str, folder: str, out: str) -> None:
    """Fork the job's ranks with a launcher's environment and wait for both; raise if one failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                                  NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank))
                run_rank(job, folder, out)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if any(codes):
        raise SystemExit(f"job {job}: the ranks exited {codes}")


def main() -> None:
    out = sys.argv[1]
    launch("straight", os.path.join(out, "straight"), out)
    fit = os.path.join(out, "fit")
    launch("fit", fit, out)
    for job, wipe_local in (("resume", False), ("resume-remote", True)):
        folder = os.path.join(out, job)
        shutil.copytree(fit, folder)
        if wipe_local:
            shutil.rmtree(os.path.join(folder, "local"))
        launch(job, folder, out)


if __name__ == "__main__":
    main()
