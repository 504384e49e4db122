"""The end of a Lightning / Hugging Face run while the remote tier refuses connections: every step is committed
locally, the run finishes promptly, the steps the remote lacks are logged as an error (and listed in
``final_health``), and ``strict_uploads=True`` makes the upload error fatal (docs/lightning.md,
docs/huggingface.md)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.lazy import lazy, requires, subclass
from tierckpt.errors import RunConflictError, UploadError
from tierckpt.storage.local import LocalStore
from tierckpt.testing import FaultProxy
from tierckpt.tiers.listing import list_root

pytest.importorskip("s3fs")
pytestmark = requires("lightning", "transformers")

#: how long the end of a run may take once the remote refuses (one upload attempt fails in well under this)
END_BOUND_S = 20.0


def _opts(server, endpoint: str) -> dict:
    opts = server.storage_options()
    opts["client_kwargs"] = {"endpoint_url": endpoint}
    opts["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}
    return opts


def _manager_options(server, proxy: FaultProxy) -> dict:
    return {"storage_options": _opts(server, proxy.url), "remote_timeout_s": 3.0, "upload_deadline_s": 10.0,
            "keep_local": 10}


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url) as p:
        yield p


def _committed(local: Path) -> list[int]:
    return sorted(list_root(LocalStore(str(local))).steps)


def _not_uploaded_logged(caplog, steps) -> None:
    """An ERROR record names the committed steps the remote lacks."""
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    lacking = [m for m in errors if "are not on" in m]
    assert lacking, errors
    named = {int(s) for s in re.search(r"\(([\d, ]+)\)", lacking[-1]).group(1).split(",")}
    assert set(steps) <= named, (steps, lacking)


def _lacking(health, steps) -> None:
    """The plug-in's final health: the remote was failing and lacked ``steps``."""
    assert health is not None
    assert not health.ok and health.last_error
    assert set(steps) <= set(health.waiting), health
    assert health.remote_step == 2 and health.local_step == 6


def _wait_uploaded(handle, timeout: float = 20.0) -> None:
    handle.uploaded.result(timeout=timeout)


# ---------------------------------------------------------------------------------------------------- Lightning
L = lazy("lightning.pytorch")
ModelCheckpoint = lazy("lightning.pytorch.callbacks", "ModelCheckpoint")
TieredCheckpointIO = lazy("tierckpt.lightning", "TieredCheckpointIO")
TieredCheckpointLogger = lazy("tierckpt.lightning", "TieredCheckpointLogger")

STEPS, EVERY = 6, 2


class Net:
    """The test's LightningModule (:func:`subclass` adds the base)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 + self.global_step)
        x = torch.randn(8, 4, generator=g)
        return torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(64.0), batch_size=8)


class RefuseAfterFirstUpload:
    """A Lightning callback: once the first save is on the remote, the remote starts refusing connections."""

    def __init__(self, io: Any, proxy: FaultProxy) -> None:
        self.io, self.proxy = io, proxy
        self.train_end: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.proxy.mode == "forward" and self.io.last_handle is not None:
            _wait_uploaded(self.io.last_handle)
            self.proxy.set_mode("refuse")

    def on_train_end(self, trainer, pl_module):
        self.train_end = time.monotonic()


def _fit(tmp_path, server, proxy, bucket, *, logger: bool = False, **io_kw):
    torch.manual_seed(0)
    io = TieredCheckpointIO(tmp_path / "local", remote=f"{bucket}/run", **_manager_options(server, proxy), **io_kw)
    refuse = subclass(RefuseAfterFirstUpload, "lightning.pytorch.callbacks", "Callback")(io, proxy)
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=EVERY, save_last=True),
                 refuse]
    if logger:
        callbacks.append(TieredCheckpointLogger())
    trainer = L.Trainer(max_steps=STEPS, plugins=[io], callbacks=callbacks, accelerator="cpu", devices=1,
                        enable_progress_bar=False, logger=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    return io, refuse, trainer


def test_lightning_fit_finishes_during_outage(tmp_path, s3_server, s3_bucket, proxy, caplog) -> None:
    caplog.set_level(logging.WARNING)
    io, refuse, trainer = _fit(tmp_path, s3_server, proxy, s3_bucket, logger=True)
    trainer.fit(subclass(Net, "lightning.pytorch", "LightningModule")())  # raises nothing
    took = time.monotonic() - refuse.train_end
    assert proxy.mode == "refuse"
    assert took < END_BOUND_S, f"the end of fit took {took:.1f} s"
    assert _committed(tmp_path / "local") == [2, 4, 6]
    _not_uploaded_logged(caplog, [4, 6])
    _lacking(io.final_health, [4, 6])
    assert io._mgr is None  # the manager was closed: the folder is free for the next run


def test_lightning_strict_uploads_raises(tmp_path, s3_server, s3_bucket, proxy) -> None:
    io, refuse, trainer = _fit(tmp_path, s3_server, proxy, s3_bucket, strict_uploads=True)
    with pytest.raises(UploadError) as info:
        trainer.fit(subclass(Net, "lightning.pytorch", "LightningModule")())
    assert not isinstance(info.value, RunConflictError)
    assert time.monotonic() - refuse.train_end < END_BOUND_S
    assert _committed(tmp_path / "local") == [2, 4, 6]
    _lacking(io.final_health, [4, 6])


def test_lightning_next_run_uploads_what_the_outage_left(tmp_path, s3_server, s3_bucket, proxy) -> None:
    io, _refuse, trainer = _fit(tmp_path, s3_server, proxy, s3_bucket)
    trainer.fit(subclass(Net, "lightning.pytorch", "LightningModule")())
    proxy.set_mode("forward")
    io2 = TieredCheckpointIO(tmp_path / "local", remote=f"{s3_bucket}/run", **_manager_options(s3_server, proxy))
    assert io2.manager.load().step == 6
    io2.teardown()  # waits for the resumed uploads: the remote answers again
    assert io2.final_health is not None and io2.final_health.ok and not io2.final_health.waiting
    remote = {s.step for s in io2.manager.steps() if s.remote}
    io2.teardown()
    assert 6 in remote


# ---------------------------------------------------------------------------------------------------- Hugging Face
tierhf = lazy("tierckpt.hf")
HF_STEPS = 6


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16) -> None:
        self.ids = torch.randint(0, 101, (n, length), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HFRefuseAfterFirstUpload:
    """A Hugging Face callback: once the first save is on the remote, the remote starts refusing connections."""

    def __init__(self, cb: Any, proxy: FaultProxy) -> None:
        self.cb, self.proxy = cb, proxy
        self.train_end: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.proxy.mode == "forward" and self.cb.last_handle is not None:
            _wait_uploaded(self.cb.last_handle)
            self.proxy.set_mode("refuse")

    def on_train_end(self, args, state, control, **kwargs):  # runs before the tierckpt callback's (added last)
        self.train_end = time.monotonic()


def _hf(tmp_path, server, proxy, bucket, **cb_kw):
    cb = tierhf.TieredCheckpointCallback(tmp_path / "local", remote=f"{bucket}/run", save_steps=2,
                                         **_manager_options(server, proxy), **cb_kw)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    refuse = subclass(HFRefuseAfterFirstUpload, "transformers", "TrainerCallback")(cb, proxy)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=101, n_positions=16))
    args = TrainingArguments(output_dir=str(tmp_path / "hf_out"), max_steps=HF_STEPS, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], logging_steps=1, seed=0, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[refuse, cb])
    return cb, refuse, trainer


def test_hf_train_finishes_during_outage(tmp_path, s3_server, s3_bucket, proxy, caplog) -> None:
    caplog.set_level(logging.WARNING)
    cb, refuse, trainer = _hf(tmp_path, s3_server, proxy, s3_bucket)
    tierhf.train(trainer)  # raises nothing
    took = time.monotonic() - refuse.train_end
    assert proxy.mode == "refuse"
    assert took < END_BOUND_S, f"the end of train took {took:.1f} s"
    assert _committed(tmp_path / "local") == [2, 4, 6]
    _not_uploaded_logged(caplog, [4, 6])
    _lacking(cb.final_health, [4, 6])


def test_hf_strict_uploads_raises(tmp_path, s3_server, s3_bucket, proxy) -> None:
    cb, refuse, trainer = _hf(tmp_path, s3_server, proxy, s3_bucket, strict_uploads=True)
    with pytest.raises(UploadError) as info:
        trainer.train()
    assert not isinstance(info.value, RunConflictError)
    assert time.monotonic() - refuse.train_end < END_BOUND_S
    assert _committed(tmp_path / "local") == [2, 4, 6]
    _lacking(cb.final_health, [4, 6])
