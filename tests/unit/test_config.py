import subprocess
import sys

import pytest

from stalwart.config import Config, load_config, parse_overrides
from stalwart.plan.parallel import Layout
from stalwart.train.resolve import grad_accum, resolve


def test_toml_and_overrides_layer_over_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\nlr = 1e-3\n[parallel]\ndp_mode = "fsdp"\n')
    cfg = load_config(path, {"train.steps": "9", "data.shuffle": "false", "train.lr": "2e-3"})
    assert cfg.train.steps == 9 and cfg.train.lr == 2e-3
    assert cfg.parallel.dp_mode == "fsdp" and cfg.data.shuffle is False
    assert cfg.train.global_batch == Config().train.global_batch


def test_shipped_configs_load_and_validate():
    for name in ("configs/debug.toml", "configs/small.toml"):
        resolve(load_config(name), world_size=2)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"train.stepz": "1"}, "unknown config key 'train.stepz' \\(did you mean 'train.steps'\\?\\)"),
        ({"trian.steps": "1"}, "unknown config key 'trian.steps'"),
        ({"train.steps": "many"}, "train.steps expects int, got 'many'"),
        ({"train.deterministic": "maybe"}, "expects true/false"),
    ],
)
def test_bad_overrides_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_wrong_type_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ValueError, match="train.steps expects int"):
        load_config(path)
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_float_int_coercion():
    cfg = load_config(None, {"train.steps": "1e3", "train.peak_flops": "312e12"})
    assert cfg.train.steps == 1000 and cfg.train.peak_flops == 312e12


def test_batch_divisibility_is_explained():
    assert grad_accum(16, 4, 2) == 2
    assert grad_accum(16, 4, 1) == 4
    with pytest.raises(
        ValueError, match=r"not divisible by data-parallel ranks \(3\).*use a global_batch divisible by 3"
    ):
        grad_accum(16, 4, 3)
    with pytest.raises(ValueError, match=r"use micro_batch in \[1, 2, 4, 8\]"):
        grad_accum(16, 3, 2)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("parallel.dp_mode", "zero", "dp_mode"),
        ("train.steps", "0", "train.steps must be positive"),
        ("train.warmup_steps", "500", "warmup_steps"),
        ("train.min_lr", "1.0", "min_lr"),
    ],
)
def test_validate_rejects_bad_values(key, value, match):
    cfg = load_config(None, {key: value})
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_parse_overrides_forms():
    assert parse_overrides(["--train.steps", "5", "--data.seq_len=64"]) == {"train.steps": "5", "data.seq_len": "64"}
    with pytest.raises(ValueError, match="needs a value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ValueError, match="unexpected argument"):
        parse_overrides(["steps"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"guard.enabled": "true"}, "guard.enabled needs checkpoint.enabled=true"),
        ({"checkpoint.keep_last": "2"}, r"rollback_steps=100 .* set checkpoint.keep_last ≥ 3 \(now 2\)"),
        ({"checkpoint.persist_every_steps": "0"}, r"reach back only checkpoint.memory_every \+ 1 = 2 steps"),
        ({"guard.window": "3"}, "guard.window must be ≥ 5"),
        ({"guard.max_rollbacks": "0"}, "guard.max_rollbacks must be ≥ 1"),
        ({"guard.loss_k": "0"}, "guard.loss_k must be > 0"),
        ({"data.skip_samples": "10:5"}, "bad range '10:5'"),
    ],
)
def test_guard_settings_must_make_a_rollback_possible(overrides, match):
    base = {"guard.enabled": "true", "checkpoint.enabled": "true"}
    if "guard.enabled" in overrides:
        base = {}
    cfg = load_config(None, {**base, **overrides})
    with pytest.raises(ValueError, match=match):
        resolve(cfg, 1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # defaults: persist every 50, keep 3, roll back 100
        {"checkpoint.persist_every_steps": "0", "guard.rollback_steps": "2"},  # memory-only: the older slot
        {"checkpoint.persist_every_steps": "10", "checkpoint.keep_last": "11", "guard.rollback_steps": "100"},
    ],
)
def test_guard_settings_that_can_roll_back_validate(overrides):
    resolve(load_config(None, {"guard.enabled": "true", "checkpoint.enabled": "true", **overrides}), 1)


# -- [parallel]: degrees, model and batch checked before any process starts --------------------------
@pytest.mark.parametrize(
    "overrides, world, match",
    [
        ({"parallel.tp": "2"}, 3, r"tp×pp×cp = 2 does not divide the 3 ranks"),
        ({"parallel.dp": "4", "parallel.tp": "2"}, 4, r"needs .* = 8 ranks but the job has 4"),
        ({"parallel.tp": "2"}, 6, r"not divisible by data-parallel ranks \(3\) × train.micro_batch \(4\)"),
        ({"parallel.tp": "4"}, 4, r"tp=4 must divide model.n_heads=4 and model.n_kv_heads=2.*use tp in \[1, 2\]"),
        ({"parallel.pp": "8"}, 8, "8 pipeline stages but the model has only 4 layers"),
        ({"parallel.pp": "2", "parallel.layer_split": "3,2"}, 2, "must give 2 positive counts that sum to 4"),
        ({"parallel.pp": "2", "parallel.schedule": "interleaved_1f1b"}, 2, "virtual_stages ≥ 2"),
        ({"parallel.pp": "2", "train.micro_batch": "16"}, 2, "1F1B needs at least pp=2 micro-batches per step, got 1"),
        ({"parallel.ep": "2", "parallel.dp_mode": "fsdp"}, 2, "needs a mixture-of-experts model"),
        ({"parallel.tp": "2", "model.tie_embeddings": "true"}, 2, "untied embeddings"),
        ({"parallel.compress": "powersgd", "parallel.dp_mode": "fsdp"}, 2, "needs plain DDP"),
        ({"parallel.compress": "alq", "parallel.dp_mode": "fsdp"}, 2, "compress='alq' needs plain DDP"),
        ({"parallel.compress": "alq", "parallel.alq_bits": "3"}, 2, "alq_bits must be 2, 4 or 8"),
        ({"parallel.compress": "alq", "parallel.alq_update_every": "0"}, 2, "alq_update_every must be positive"),
        ({"parallel.recompute": "most"}, 2, "recompute='most' is not one of"),
        ({"parallel.layout": "auto", "parallel.tp": "2"}, 2, "remove parallel.tp=2 or set parallel.layout='manual'"),
        ({"parallel.layout": "best"}, 2, "parallel.layout='best' is not one of manual, auto"),
    ],
)
def test_parallel_mistakes_are_explained(overrides, world, match):
    with pytest.raises(ValueError, match=match):
        resolve(load_config(None, overrides), world)


def test_parallel_plan_from_config():
    cfg = load_config(None, {"parallel.dp_mode": "fsdp", "parallel.tp": "2", "parallel.recompute": "selective"})
    plan = resolve(cfg, 4)
    assert plan.layout == Layout(dp_shard=2, tp=2) and plan.options.recompute == "selective"
    assert plan.summary()["describe"] == "dp_shard=2 × tp=2" and "auto" not in plan.summary()
    assert plan.grad_accum == 16 // (2 * 4) and plan.model_args.n_layers == 4 and plan.moe is None
    hsdp = resolve(load_config(None, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}), 4)
    assert hsdp.layout == Layout(dp_replicate=2, dp_shard=2)
    pp = resolve(load_config(None, {"parallel.pp": "2", "parallel.layer_split": "1, 3"}), 2)
    assert pp.options.layer_split == (1, 3) and pp.summary()["schedule"] == "1f1b"
    auto = resolve(
        load_config(
            None, {"parallel.layout": "auto", "train.global_batch": "8", "train.micro_batch": "2", "data.seq_len": "32"}
        ),
        2,
    )
    assert auto.layout.world_size == 2 and auto.why.startswith("parallel = 'auto' chose")
    assert auto.summary()["auto"] == auto.why
    assert resolve(cfg, 4, vocab_size=300).model_args.vocab_size == 300  # the data's vocabulary


def test_config_is_a_leaf():
    """``stalwart.config`` imports nothing above it (no train, data, plan or models module), not even
    when it validates."""
    code = (
        "import sys, stalwart.config as c; c.load_config(None, {'data.skip_samples': '1:2'}).validate(); "
        "print(' '.join(m for m in sys.modules if m.startswith('stalwart.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "stalwart.config" in loaded
    above = [m for m in loaded if m.split(".")[1] in ("train", "data", "plan", "models", "checkpoint", "commands")]
    assert not above, above
