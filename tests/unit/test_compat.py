"""Each private torch API in ``stalwart._compat`` still exists and behaves as stalwart assumes.

A failure here means the installed torch changed an internal stalwart relies on: fix ``_compat``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stalwart import _compat


def test_torch_version_in_supported_range() -> None:
    low, high = (tuple(int(x) for x in v.split(".")) for v in _compat.SUPPORTED_TORCH)
    assert low <= tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) <= high


# --- elastic agent, launcher, process helpers -------------------------------------------------


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint -------------------------------------------------------------------


def test_flatten_state_dict_gives_dcp_keys_and_paths() -> None:
    flat, paths = _compat.flatten_state_dict({"m": {"w": torch.ones(1)}, "o": {"param_groups": [{"lr": 0.1}],
                                                                                "state.a.b": 2}})
    assert set(flat) == {"m.w", "o.param_groups.0.lr", "o.state.a.b"}
    assert paths == {"m.w": ("m", "w"), "o.param_groups.0.lr": ("o", "param_groups", 0, "lr"),
                     "o.state.a.b": ("o", "state.a.b")}


def _tiny_state() -> dict[str, Any]:
    return {"w": torch.arange(6.0).reshape(2, 3), "extra": {"lr": 0.5}}


def test_checkpoint_writer_routes_every_shard_stream_through_the_wrapped_fs(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    opened: list[tuple[str, str]] = []

    class Recording:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            opened.append((str(path), mode))
            with self.inner.create_stream(path, mode) as stream:
                yield stream

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    for local in (True, False):
        target = tmp_path / f"local-{local}"
        writer = _compat.checkpoint_writer(str(target), local=local, wrap_fs=Recording, sync_files=False)
        assert isinstance(writer.fs, Recording)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(_tiny_state(), storage_writer=writer, no_dist=True)
        assert any(p.endswith(".distcp") and "w" in m for p, m in opened), opened
        opened.clear()


def test_checkpoint_reader_takes_metadata_from_the_callback(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_tiny_state(), checkpoint_id=str(tmp_path), no_dist=True)
        calls: list[int] = []

        def read() -> Any:
            calls.append(1)
            with open(tmp_path / ".metadata", "rb") as f:
                return pickle.load(f)

        for local in (True, False):
            reader = _compat.checkpoint_reader(str(tmp_path), local=local, read_metadata=read)
            md = reader.read_metadata()
            assert md.storage_meta.load_id == reader.load_id
            target = {"w": torch.zeros(2, 3), "extra": {"lr": 0.0}}
            dcp.load(target, storage_reader=reader, no_dist=True)
            assert torch.equal(target["w"], _tiny_state()["w"]) and target["extra"]["lr"] == 0.5
    assert len(calls) >= 4


def test_storage_info_round_trips_through_json_and_pickles_by_the_allowed_name() -> None:
    import json
    import pickle

    from torch.distributed.checkpoint.storage import WriteResult

    fields = {"path": "__0_0.distcp", "at": 64, "length": 128, "transforms": None}
    info = _compat.storage_info(json.loads(json.dumps(fields)))
    assert _compat.storage_info_fields(info) == fields
    assert type(info).__module__ == _compat.STORAGE_INFO_CLASS[0]
    assert type(info).__name__ == _compat.STORAGE_INFO_CLASS[1]
    assert f"{_compat.STORAGE_INFO_CLASS[1]}".encode() in pickle.dumps(info)
    WriteResult(index=None, size_in_bytes=128, storage_data=info)  # type: ignore[arg-type]
    assert _compat.storage_prefix("__1_").prefix == "__1_"


# --- end of distributed checkpoint section ----------------------------------------------------


# --- device mesh (torch.distributed.device_mesh) ---------------------------------------------


# --- end of device mesh section ---------------------------------------------------------------


# --- training ---------------------------------------------------------------------------------


# --- end of training section ------------------------------------------------------------------
