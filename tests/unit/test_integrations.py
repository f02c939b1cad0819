"""stalwart.integrations: the shared parts, and each framework's resume in one process (no launcher):
a run stopped by an exception after step 7 with snapshots every 2 steps resumes from memory at step 6
and ends bitwise where an uninterrupted run ends. Under `stalwart run` with a SIGKILL:
tests/e2e/test_integrations.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from stalwart.integrations.common import Blob, Snapshots, check_packable, pack, unpack
from stalwart.utils.hashing import state_dict_hash


class Custom:
    pass


def test_stalwart_imports_no_framework():
    code = (
        "import sys, stalwart, stalwart.integrations, stalwart.checkpoint; "
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pack_round_trips_and_refuses_code():
    value = {"a": [1, 2.5, "x"], "t": torch.arange(3), "none": None}
    back = unpack(pack(value))
    assert back["a"] == value["a"] and torch.equal(back["t"], value["t"]) and back["none"] is None
    check_packable(value, "it")
    with pytest.raises(ValueError, match="cannot snapshot my state.*weights_only"):
        check_packable({"obj": Custom()}, "my state")


def test_blob_is_a_template_without_capture_and_keeps_what_it_loads():
    assert Blob().state_dict() == {"data": b""}
    saved = Blob(lambda: {"step": 3}).state_dict()
    restored = Blob()
    restored.load_state_dict(saved)
    assert restored.value == {"step": 3}
    restored.load_state_dict({"data": b""})
    assert restored.value is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_steps": 0}, "every_steps=0 must be ≥ 1"),
        ({"every_steps": 2, "persist_every_steps": 5}, "multiple of every_steps=2"),
        ({"persist_every_steps": -1}, "persist_every_steps=-1"),
    ],
)
def test_snapshots_reject_bad_intervals(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Snapshots(str(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="non-empty path"):
        Snapshots("")


def memory_only(tmp_path: Path) -> dict:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return {"keeper": False, "shm_root": str(tmp_path / "shm")}


def test_snapshots_every_n_steps_restore_and_reapply_the_rng(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    snaps = Snapshots(str(tmp_path / "ckpt"), every_steps=2, **memory_only(tmp_path))
    taken, after_save = [], None
    for step in range(1, 6):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        taken.append(snaps.after_step(step, {"model": model, "optim": opt}))
        if step == 4:
            snaps.ckpt.wait()
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            after_save = torch.rand(3)  # the RNG as the snapshot of step 4 captured it
    assert taken == [False, True, False, True, False]
    snaps.ckpt.close(success=False)  # as a crash leaves them

    fresh = nn.Linear(4, 4)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    again = Snapshots(str(tmp_path / "ckpt"), every_steps=2, **memory_only(tmp_path))
    assert again.restore({"model": fresh, "optim": opt2}) == 4 and again.restored.source == "memory"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())
    torch.rand(5)  # a framework's setup draws random numbers...
    again.reapply_rng()  # ...so the restored states are set again before the first resumed step
    assert torch.equal(torch.rand(3), after_save)
    again.ckpt.close()


# -- Hugging Face Trainer ---------------------------------------------------------------------------------
def hf_trainer(out: Path, callbacks: list | None = None):
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None
    )
    tokens = torch.randint(0, 32, (24, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]  # 6 steps per epoch: the run crosses one
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=10,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=2,
        seed=0,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    model = transformers.GPT2LMHeadModel(config)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def crash_after(step: int):
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise RuntimeError(f"crash after step {step}")

    return Crash()


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    ref = hf_trainer(tmp_path_factory.mktemp("hf-ref"))
    ref.train()
    return ref


# Crashed after step 7: step 6, an epoch's end, is restored; after step 9: step 8, mid-epoch (batches skipped).
@pytest.mark.parametrize("crash, restored", [(7, 6), (9, 8)])
def test_hf_trainer_resumes_from_memory_bitwise(tmp_path, hf_reference, crash, restored):
    pytest.importorskip("transformers")
    from stalwart.integrations.hf import StalwartCallback

    ref = hf_reference
    first = hf_trainer(tmp_path / "a", callbacks=[crash_after(crash)])
    cb = StalwartCallback(str(tmp_path / "ckpt"), every_steps=2, **memory_only(tmp_path))
    assert cb.resume(first, fallback="own-checkpoint") == "own-checkpoint"  # nothing held yet
    with pytest.raises(RuntimeError, match=f"crash after step {crash}"):
        first.train()
    cb.snapshots.ckpt.close(success=False)

    second = hf_trainer(tmp_path / "b")
    cb2 = StalwartCallback(str(tmp_path / "ckpt"), every_steps=2, **memory_only(tmp_path))
    resume = cb2.resume(second)
    assert (cb2.snapshots.restored.source, cb2.snapshots.restored.step) == ("memory", restored)
    held = {p.name for p in Path(resume).iterdir()}
    assert {"trainer_state.json", "pytorch_model.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= held
    second.train(resume_from_checkpoint=resume)
    assert second.state.global_step == 10 and not Path(resume).exists()
    assert state_dict_hash(second.model.state_dict()) == state_dict_hash(ref.model.state_dict())
    opt = lambda t: state_dict_hash(t.optimizer.optimizer.state_dict()["state"])
    assert opt(second) == opt(ref)


def test_hf_callback_needs_its_resume_and_a_model(tmp_path):
    pytest.importorskip("transformers")
    from stalwart.integrations.hf import StalwartCallback

    cb = StalwartCallback(str(tmp_path / "ckpt"), **memory_only(tmp_path))
    trainer = hf_trainer(tmp_path / "x", callbacks=[cb])
    with pytest.raises(ValueError, match=r"resume\(\) before training"):
        trainer.train()
    trainer.model_init = lambda: None
    with pytest.raises(ValueError, match="model_init"):
        cb.resume(trainer)


# -- Lightning --------------------------------------------------------------------------------------------
def test_resumable_loader_skips_what_the_interrupted_pass_handed_out():
    pytest.importorskip("lightning")
    from stalwart.integrations.lightning import ResumableDataLoader

    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = ResumableDataLoader(data, batch_size=2)
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(2)]
    assert first == [[0, 1], [2, 3]] and loader.state_dict() == {"consumed": 2}
    resumed = ResumableDataLoader(data, batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert [b[0].tolist() for b in resumed] == [[4, 5], [6, 7], [8, 9]]
    assert next(iter(resumed))[0].tolist() == [0, 1], "only the interrupted pass is skipped"
    resumed.load_state_dict({"consumed": 5})  # the pass had ended: the next one is whole
    assert len(list(resumed)) == 5


def lightning_fit(tmp_path: Path, callbacks: list, plugins: list, ckpt_path: str | None = None):
    pl = pytest.importorskip("lightning.pytorch")
    from stalwart.integrations.lightning import ResumableDataLoader

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
            return ResumableDataLoader(data, batch_size=4)  # 6 steps per epoch

    pl.seed_everything(0, verbose=False)
    module = Tiny()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=10,
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


# As for the Trainer: restored at an epoch's end (step 6) and mid-epoch (step 8, batches skipped).
@pytest.mark.parametrize("crash, restored", [(7, 6), (9, 8)])
def test_lightning_resumes_from_memory_bitwise(tmp_path, crash, restored):
    pl = pytest.importorskip("lightning.pytorch")
    from stalwart.integrations.lightning import StalwartCheckpoint

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == crash:
                raise RuntimeError(f"crash after step {crash}")

    ref, ref_trainer = lightning_fit(tmp_path, [], [])
    ckpt = StalwartCheckpoint(str(tmp_path / "ckpt"), every_steps=2, **memory_only(tmp_path))
    with pytest.raises(RuntimeError, match=f"crash after step {crash}"):
        lightning_fit(tmp_path, [Crash(), ckpt], [ckpt.checkpoint_io], ckpt.ckpt_path)
    assert ckpt.snapshots.restored.source == "fresh"
    ckpt.snapshots.ckpt.close(success=False)

    again = StalwartCheckpoint(str(tmp_path / "ckpt"), every_steps=2, **memory_only(tmp_path))
    module, trainer = lightning_fit(tmp_path, [again], [again.checkpoint_io], again.ckpt_path)
    assert (again.snapshots.restored.source, again.snapshots.restored.step) == ("memory", restored)
    assert trainer.global_step == 10
    assert state_dict_hash(module.state_dict()) == state_dict_hash(ref.state_dict())
    optim = lambda t: state_dict_hash(t.optimizers[0].state_dict()["state"])
    assert optim(trainer) == optim(ref_trainer)


def test_lightning_needs_the_checkpoint_io(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from stalwart.integrations.lightning import StalwartCheckpoint

    ckpt = StalwartCheckpoint(str(tmp_path / "ckpt"), **memory_only(tmp_path))
    with pytest.raises(ValueError, match="plugins=\\[ckpt.checkpoint_io\\]"):
        lightning_fit(tmp_path, [ckpt], [], ckpt.ckpt_path)


# -- Lightning Fabric -------------------------------------------------------------------------------------
def fabric_loop(tmp_path: Path, fabric, crash: int | None = None, steps: int = 10):
    """A plain Fabric loop (dropout, LR schedule, 6 steps per epoch); with a StalwartFabric it restores
    before the loop, snapshots after each step and finishes after it."""
    lf = pytest.importorskip("lightning.fabric")
    from stalwart.integrations.fabric import ResumableDataLoader, StalwartFabric

    stalwart = isinstance(fabric, StalwartFabric)
    lf.seed_everything(0, verbose=False)
    fabric.launch()
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    loader = fabric.setup_dataloaders(ResumableDataLoader(data, batch_size=4))
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader, "step": 0, "seen": []}
    if stalwart:
        fabric.load(fabric.snapshot_path, state)
    while state["step"] < steps:
        for x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            sched.step()
            state["step"] += 1
            state["seen"] = state["seen"] + [round(float(x[0, 0]), 4)]
            if stalwart:
                fabric.save(fabric.snapshot_path, state)
            if state["step"] == crash:
                raise RuntimeError(f"crash after step {crash}")
            if state["step"] == steps:
                break
    if stalwart:
        fabric.finish_snapshots()
    return model, opt, state


@pytest.fixture(scope="module")
def fabric_reference(tmp_path_factory):
    lf = pytest.importorskip("lightning.fabric")
    model, opt, state = fabric_loop(tmp_path_factory.mktemp("fabric-ref"), lf.Fabric(accelerator="cpu", devices=1))
    return state_dict_hash(model.state_dict()), state_dict_hash(opt.state_dict()["state"]), state["seen"]


# As for the others: restored at an epoch's end (step 6) and mid-epoch (step 8: batches skipped, same epoch).
@pytest.mark.parametrize("crash, restored", [(7, 6), (9, 8)])
def test_fabric_resumes_from_memory_bitwise(tmp_path, fabric_reference, crash, restored):
    pytest.importorskip("lightning.fabric")
    from stalwart.integrations.fabric import StalwartFabric

    make = lambda: StalwartFabric(
        str(tmp_path / "ckpt"), every_steps=2, accelerator="cpu", devices=1, **memory_only(tmp_path)
    )
    first = make()
    with pytest.raises(RuntimeError, match=f"crash after step {crash}"):
        fabric_loop(tmp_path, first, crash=crash)
    assert first.snapshots.restored.source == "fresh"
    first.finish_snapshots(success=False)  # as a crash leaves them

    again = make()
    model, opt, state = fabric_loop(tmp_path, again)
    assert (again.snapshots.restored.source, again.snapshots.restored.step) == ("memory", restored)
    assert again.step == state["step"] == 10
    assert state["seen"] == fabric_reference[2], "the same batches in the same order"
    assert state_dict_hash(model.state_dict()) == fabric_reference[0]
    assert state_dict_hash(opt.state_dict()["state"]) == fabric_reference[1]


def test_fabric_refuses_sharded_strategies_and_unknown_options(tmp_path):
    pytest.importorskip("lightning.fabric")
    from lightning.fabric.strategies import ModelParallelStrategy

    from stalwart.integrations.fabric import StalwartFabric

    # FSDP and DeepSpeed need a GPU or a package to build; the check is the same (DDP or single device).
    strategy = ModelParallelStrategy(lambda model, mesh: model)
    with pytest.raises(ValueError, match="not ModelParallelStrategy"):
        StalwartFabric(str(tmp_path / "ckpt"), accelerator="cpu", devices=1, strategy=strategy)
    with pytest.raises(TypeError, match="keep_lst"):
        StalwartFabric(str(tmp_path / "ckpt"), accelerator="cpu", devices=1, keep_lst=2)
    fabric = StalwartFabric(str(tmp_path / "ckpt"), accelerator="cpu", devices=1, **memory_only(tmp_path))
    with pytest.raises(ValueError, match="state dict"):
        fabric.load(fabric.snapshot_path)
    with pytest.raises(ValueError, match="no filter"):
        fabric.save(fabric.snapshot_path, {"model": nn.Linear(1, 1)}, filter={"model": lambda *_: True})
    with pytest.raises(ValueError, match="'fabric' is reserved"):
        fabric.save(fabric.snapshot_path, {"model": nn.Linear(1, 1), "fabric": 1})
    fabric.finish_snapshots()
