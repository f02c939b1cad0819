"""A stalwart checkpoint is a plain DCP checkpoint: torch alone loads it into its own
``get_state_dict(model, optimizer)`` template, nested or flattened, with no stalwart import.

Two real ranks (gloo) train a small model under DDP or FSDP2 and take stalwart snapshots; the keeper's
code path (:func:`write_checkpoint`) persists them; a fresh process that never imports stalwart
loads the checkpoint with ``get_state_dict`` → ``dcp.load(FileSystemReader)`` → ``set_state_dict``
and must see exactly the saved weights, optimizer moments and hyperparameters.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from stalwart._compat import storage_info_fields
from stalwart.checkpoint.persist import write_checkpoint
from stalwart.checkpoint.shm import JobPaths, complete_slots
from stalwart.checkpoint.snapshot import SnapshotView
from stalwart.checkpoint.storage import Storage
from stalwart.utils.ports import free_port

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def optimizer(model, lr, decay):
        weights = [p for p in model.parameters() if p.ndim >= 2]
        biases = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": weights, "weight_decay": decay}, {"params": biases, "weight_decay": 0.0}],
                                 lr=lr, betas=(0.8, 0.95))
""")

# one rank: train 3 steps under DDP or FSDP2, take a stalwart snapshot, and (rank 0) write the full state
SAVE = MODEL + textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    mode, shm, expected = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build()
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = optimizer(model, lr=0.0123, decay=0.05)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    from stalwart.checkpoint.shm import JobPaths
    from stalwart.checkpoint.snapshot import SnapshotWriter
    from stalwart.checkpoint.state import TrainingState
    writer = SnapshotWriter(JobPaths(shm), rank, 2)
    writer.start(3, TrainingState({"model": model, "optim": opt}, rank).capture(), persist=True)
    writer.close()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, expected)
    dist.destroy_process_group()
    from stalwart.runtime import exit_process  # gloo may abort at finalization (see exit_process)
    exit_process(0)
""")

# a fresh process with torch only: the standard template, DCP's load, set_state_dict
LOAD = MODEL + textwrap.dedent("""
    import sys
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path, flatten, out = sys.argv[1], sys.argv[2] == "flat", sys.argv[3]
    model = build()
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    opt = optimizer(model, lr=1.0, decay=0.5)  # hyperparameters must come from the checkpoint
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    assert not any(m.startswith("stalwart") for m in sys.modules), "the load must not need stalwart"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out)
""")


def _save_two_ranks(mode: str, tmp: Path, shm: Path) -> Path:
    script = tmp / "save.py"
    script.write_text(SAVE)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), mode, str(shm), str(tmp / "expected.pt")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    return tmp / "expected.pt"


def _persist(shm: Path, target: Path) -> Path:
    """The keeper's code path: every rank's snapshot → one committed DCP checkpoint."""
    paths = JobPaths(shm)
    views = [SnapshotView(paths, complete_slots(paths, rank)[0]) for rank in range(2)]
    storage = Storage(str(target))
    try:
        write_checkpoint(storage, 3, views, "test")
    finally:
        for v in views:
            v.close()
    # every hyperparameter has its key, but equal values share their bytes (one record, many keys)
    md = storage.read_metadata(3)
    hyper = [k for k in md.state_dict_metadata if k.startswith("optim.param_groups.")]
    records = {tuple(storage_info_fields(md.storage_data[MetadataIndex(k)]).values()) for k in hyper}
    assert len(hyper) >= 4 * 12 and len(records) < len(hyper) / 3
    return Path(storage.checkpoint_id(3))


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_plain_dcp_loads_a_stalwart_checkpoint_into_torch_templates(mode, tmp_path):
    shm = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    try:
        expected_file = _save_two_ranks(mode, tmp_path, shm)
        checkpoint = _persist(shm, tmp_path / "ckpt")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    expected = torch.load(expected_file, weights_only=True)
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for layout in ("flat", "nested"):
        out = tmp_path / f"loaded-{layout}.pt"
        run = subprocess.run(
            [sys.executable, str(script), str(checkpoint), layout, str(out)],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        loaded = torch.load(out, weights_only=True)
        assert loaded["model"].keys() == expected["model"].keys()
        for key, value in expected["model"].items():
            assert torch.equal(loaded["model"][key], value), (layout, key)
        # the plain optimizer's state dict is keyed by parameter index; expected by FQN (DCP)
        names = list(expected["model"])
        groups = loaded["optim"]["param_groups"]
        assert [g["lr"] for g in groups] == [0.0123, 0.0123], layout
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0] and groups[0]["betas"] == (0.8, 0.95)
        index_to_name = {
            i: n for g, eg in zip(groups, expected["optim"]["param_groups"]) for i, n in zip(g["params"], eg["params"])
        }
        assert sorted(index_to_name.values()) == sorted(names)
        for index, state in loaded["optim"]["state"].items():
            for k, v in expected["optim"]["state"][index_to_name[index]].items():
                assert torch.equal(torch.as_tensor(state[k]), torch.as_tensor(v)), (layout, index, k)
        assert len(loaded["optim"]["state"]) == len(names)
