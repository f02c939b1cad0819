"""`stalwart plan`: JSON contract, presets and raw numbers, help text, clear errors, Python API parity."""

import json

import pytest

from stalwart.cli import build_parser, main
from stalwart.plan import PlanInputs, plan

SEED = ["--model", "gpt3-175b", "--gpu", "h100", "--gpus", "8192", "--tokens", "10T", "--mfu", "0.5"]


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on stdout
    return json.loads(out)


def test_seed_preset_summary(capsys):
    r = run_json(capsys, *SEED)
    for key in (
        "flops_per_token",
        "total_flops",
        "days",
        "memory_per_gpu_gb",
        "memory_breakdown_gb",
        "layouts",
        "p_fail_day",
        "mtbf_hours",
        "checkpoint_interval_s",
        "ettr",
    ):
        assert key in r, key
    assert r["days"] == pytest.approx(30, abs=1)  # seed: ≈ 30 days
    assert r["p_fail_day"] == pytest.approx(1 - 0.999**8192)
    best = r["layouts"][0]
    for key in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "memory_gb", "step_time_s", "mfu"):
        assert key in best, key
    assert best["dp"] * best["tp"] * best["pp"] * best["cp"] == 8192
    assert best["memory_gb"] <= r["usable_memory_gb"]
    assert [lo["step_time_s"] for lo in r["layouts"]] == sorted(lo["step_time_s"] for lo in r["layouts"])


def test_raw_numbers(capsys):
    r = run_json(
        capsys,
        "time",
        "--params",
        "175e9",
        "--gpu-flops",
        "1000e12",
        "--gpus",
        "8192",
        "--tokens",
        "10T",
        "--mfu",
        "0.5",
    )
    assert r["flops_per_token"] == 6 * 175e9
    assert r["days"] == pytest.approx(6 * 175e9 * 10e12 / (8192 * 1e15 * 0.5) / 86400)
    assert "layouts" not in r


def test_inverse_modes(capsys):
    r = run_json(capsys, "time", *SEED[:4], "--tokens", "10T", "--mfu", "0.5", "--days", "60")
    assert r["solved_for"] == "gpus" and r["gpus"] % 8 == 0 and r["days"] <= 60
    r = run_json(capsys, "time", *SEED[:6], "--mfu", "0.5", "--days", "15")
    assert r["solved_for"] == "tokens" and r["tokens"] == pytest.approx(5e12, rel=0.02)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpus", "-8"], "--gpus must be a positive"),
        (["--gpu", "tpu9"], "unknown GPU 'tpu9'"),
        (["--mfu", "1.5"], "MFU"),
    ],
)
def test_invalid_input_is_a_clean_error(capsys, argv, message):
    base = dict(zip(SEED[::2], SEED[1::2]))
    base.update(dict(zip(argv[::2], argv[1::2])))
    args = [x for kv in base.items() for x in kv]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error:") and message in err


def test_help_documents_every_flag():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings
    text = sub.format_help()
    for unit in ("GB/s", "FLOP/s", "GB (1e9 bytes)", "days", "count", "hours", "sequences"):
        assert unit in text, unit


def test_python_api_mirrors_cli(capsys):
    cli = run_json(capsys, *SEED)
    api = plan(PlanInputs(model="gpt3-175b", gpu="h100", gpus=8192, tokens=10e12, mfu=0.5))
    assert json.loads(json.dumps(api, default=str)) == cli


def test_gpu_table(capsys):
    assert main(["plan", "gpus", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["gpus"]
    assert {"h100", "h200", "a100-40g", "a100-80g", "v100"} <= set(table)
    assert table["a100-80g"]["peak_flops"] == 312e12
