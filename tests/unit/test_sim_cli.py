"""`stalwart sim`: the command line over both simulators (JSON, the figure, errors that say what to fix)."""

from __future__ import annotations

import json

from stalwart.cli import main


def test_sim_prints_one_json_summary_per_run_and_draws_the_figure(tmp_path, capsys):
    png = tmp_path / "sim.png"
    assert main(["sim", "pollux", "--traces", "3", "--policies", "tiresias,fifo", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "pollux" and [r["policy"] for r in out["results"]] == ["tiresias", "fifo"]
    tiresias, fifo = out["results"]
    assert tiresias["jobs"] == fifo["jobs"] == 160 and tiresias["finished"] == 160
    assert tiresias["avg_jct_s"] < fifo["avg_jct_s"], "least-attained service beats strict FIFO on JCT"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["sim", "elasticflow", "--traces", "10", "--policies", "edf", "--json"]) == 0
    [edf] = json.loads(capsys.readouterr().out)["results"]
    assert edf["trace"] == "cluster10" and edf["gpus"] == 256 and 0 < edf["dsr"] < 1
    assert all(not isinstance(v, (dict, list)) for v in edf.values()), "a summary row holds no per-job data"


def test_sim_rejects_bad_input_with_what_to_pass(capsys):
    assert main(["sim", "pollux", "--traces", "9"]) == 2
    assert "workload numbers are 1-8" in capsys.readouterr().err
    assert main(["sim", "elasticflow", "--policies", "elasticflow,nope"]) == 2
    assert "choose from elasticflow, edf" in capsys.readouterr().err
    assert main(["sim", "pollux", "--data", "/nonexistent"]) == 2
    assert "is not a directory" in capsys.readouterr().err
