"""benchmarks/gpu_step.py end to end on the CPU (--smoke, a fake peak): every section runs — the plain
loop, `stalwart train`, a snapshot every step, SIGKILL + restore from memory, the torchtitan section
(skipped with its reason where torchtitan is absent or there is no CUDA) — and the JSON it prints is
whole: figures finite and positive, ratios and fractions are what they claim to be. The GPU run is
the same code with another shape (docs/gpu.md); only its timings need the GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PEAK_TFLOPS = 0.05  # a fake bf16 peak: MFU gets computed on the CPU as on a GPU


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_gpu_step_runs_every_section_on_the_cpu(tmp_path, shm_root):
    partial = tmp_path / "partial.json"
    cmd = [sys.executable, "benchmarks/gpu_step.py", "--smoke", f"--peak-tflops={PEAK_TFLOPS}", "--json"]
    cmd += [f"--out-json={partial}", f"--work={tmp_path / 'work'}", f"--shm-dir={shm_root}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert json.loads(partial.read_text()) == r, "the partial file ends as the full result"
    assert set(r["sections"]) == {"baseline", "stalwart", "checkpoint", "restore", "torchtitan"}
    assert all(isinstance(s, float) for s in r["sections"].values()), r["sections"]
    assert r["peak_flops"] == PEAK_TFLOPS * 1e12 and r["peak_source"] == "--peak-tflops"
    assert positive(r["flops_per_token"]) and positive(r["model"]["n_params"])
    tokens_per_step = r["global_batch"] * r["seq_len"]
    for key in ("baseline", "stalwart"):
        x = r[key]
        assert "error" not in x, x
        assert all(positive(x[k]) for k in ("step_s", "tokens_per_s", "mfu")), x
        assert x["tokens_per_s"] == pytest.approx(tokens_per_step / x["step_s"])
        assert x["mfu"] == pytest.approx(r["flops_per_token"] * x["tokens_per_s"] / r["peak_flops"])
    assert r["baseline"]["n_params"] == r["model"]["n_params"]
    ratio = r["ratios"]["stalwart_vs_plain"]
    assert positive(ratio) and ratio == pytest.approx(r["stalwart"]["tokens_per_s"] / r["baseline"]["tokens_per_s"])
    assert r["ratios"]["stalwart_vs_torchtitan"] is None

    c = r["checkpoint"]  # a memory snapshot every step: blocking per save, ms and fraction of the step
    assert "error" not in c and "skipped" not in c, c
    assert all(positive(c[k]) for k in ("step_s", "save_call_ms", "blocking_ms_per_save", "blocking_fraction")), c
    assert c["hook_wait_ms_per_step"] >= 0 and c["blocking_target"] == 0.01
    assert c["blocking_ms_per_save"] == pytest.approx(c["save_call_ms"] + c["hook_wait_ms_per_step"])
    assert c["blocking_fraction"] == pytest.approx(c["blocking_ms_per_save"] / 1e3 / c["step_s"])
    assert c["step_vs_no_checkpoint"] == pytest.approx(c["step_s"] / r["stalwart"]["step_s"])
    assert c["snapshots"] == r["warmup"] + r["steps"] and c["snapshots_skipped"] == 0

    x = r["restore"]  # SIGKILL after step 2, restart: the snapshot comes back from shared memory
    assert x["killed_rc"] == -9 and (x["restored_from"], x["restore_step"]) == ("memory", 2), x
    assert positive(x["restore_s"]) and positive(x["restart_wall_s"])

    t = r["torchtitan"]
    assert set(t) == {"skipped"} and "torchtitan" in t["skipped"], t


def test_gpu_step_records_a_failed_section_and_runs_the_next(tmp_path, shm_root):
    """A section that outlives --section-timeout is killed (its process group) and recorded as an
    "error" in its place; the sections after it still run, those not asked for say so."""
    cmd = [sys.executable, "benchmarks/gpu_step.py", "--smoke", "--json", "--sections=stalwart,torchtitan"]
    cmd += [f"--work={tmp_path / 'work'}", f"--shm-dir={shm_root}", "--section-timeout=0.5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert "timed out after" in r["stalwart"]["error"], r["stalwart"]
    assert r["sections"]["baseline"] == "not requested" and "baseline" not in r
    assert "skipped" in r["torchtitan"] and r["ratios"] == {"stalwart_vs_plain": None, "stalwart_vs_torchtitan": None}


def test_gpu_profile_runs_every_line_on_the_cpu(tmp_path):
    """The step profile behind docs/gpu.md's rope and attention figures: its table is written, its
    figures are positive, and the complex-multiply rotation it compares against is the same rotation."""
    out = tmp_path / "profile.txt"
    cmd = [sys.executable, "benchmarks/gpu_profile.py", "--smoke", "--json", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
    assert r["device"] == "cpu" and r["shape"] == "tiny" and positive(r["n_params"])
    assert r["tokens_per_step"] == 2 * 2 * 32
    assert all(positive(r["rope"][k]) for k in ("apply_rope_ms", "complex_ms")), r["rope"]
    assert r["rope"]["max_abs_diff"] < 1e-5, "the complex rotation is apply_rope's (fp32 on the CPU)"
    assert all(positive(v) for v in r["attention"].values()), r["attention"]
    assert "aten::mm" in out.read_text() and "Self CPU time total" in out.read_text()


def test_gpu_techniques_runs_each_variant_on_the_cpu(tmp_path):
    """benchmarks/gpu_techniques.py --smoke: each technique's run (compile aside: tests/unit/test_compile.py
    runs it, and it is this benchmark's slowest on the CPU), its tokens/s against off's, the window's
    fewer FLOPs; a spent budget skips what is left and says so."""
    cmd = [sys.executable, "benchmarks/gpu_techniques.py", "--smoke", f"--peak-tflops={PEAK_TFLOPS}", "--json"]
    cmd += ["--variants=off,parallel_block,attn_window,prefetch_off", f"--work={tmp_path / 'work'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    v = r["variants"]
    assert list(v) == ["off", "parallel_block", "attn_window", "prefetch_off"]
    tokens_per_step = r["global_batch"] * r["seq_len"]
    for name, x in v.items():
        assert "error" not in x, (name, x)
        assert positive(x["step_s"]) and x["tokens_per_s"] == pytest.approx(tokens_per_step / x["step_s"])
        assert x["mfu"] == pytest.approx(x["flops_per_token"] * x["tokens_per_s"] / r["peak_flops"])
        assert x["vs_off"] == pytest.approx(x["tokens_per_s"] / v["off"]["tokens_per_s"])
    assert v["off"]["flags"] == [] and v["attn_window"]["flags"] == [f"--model.attn_window={r['seq_len'] // 4}"]
    assert v["attn_window"]["flops_per_token"] < v["off"]["flops_per_token"], "the window scores fewer keys"
    spent = subprocess.run(
        [*cmd[:3], "--json", "--budget-s=0", "--variants=off,compile", f"--work={tmp_path / 'work'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert spent.returncode == 0, spent.stderr[-2000:]
    skipped = json.loads(spent.stdout)["variants"]
    assert all(x == {"skipped": "over the 0 s budget"} for x in skipped.values()), skipped
