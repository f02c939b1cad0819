"""The NCCL defaults `stalwart run` gives its workers (docs/techniques.md): set where absent, the user's
own value kept, none with `--nccl-env off` (the worker's real environment: tests/e2e/test_nccl_env.py)."""

from __future__ import annotations

from stalwart.launch.nccl_env import NCCL_DEFAULTS, apply_defaults
from stalwart.launch.run_args import build_parser


def test_defaults_fill_only_what_is_missing():
    env = {"NCCL_IB_TIMEOUT": "18", "PATH": "/bin"}
    added = apply_defaults(env)
    assert env["NCCL_IB_TIMEOUT"] == "18" and "NCCL_IB_TIMEOUT" not in added
    assert {k: env[k] for k in NCCL_DEFAULTS if k != "NCCL_IB_TIMEOUT"} == {
        k: v for k, (v, _) in NCCL_DEFAULTS.items() if k != "NCCL_IB_TIMEOUT"
    }
    assert env["PATH"] == "/bin"
    old_name = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}  # the user's setting under torch's older name wins too
    assert "TORCH_FR_BUFFER_SIZE" not in apply_defaults(old_name) and "TORCH_FR_BUFFER_SIZE" not in old_name


def test_off_switch_sets_nothing():
    env: dict[str, str] = {}
    assert apply_defaults(env, enabled=False) == {} and env == {}
    args = build_parser().parse_args(["--nccl-env", "off", "train.py"])
    assert args.nccl_env == "off"
    assert build_parser().parse_args(["train.py"]).nccl_env == "on"
