"""Single-process checks of the pieces the parallel layouts rely on: the MoE model and its
load-balancing gradient, activation recompute, gradient clipping, pipeline stage modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stalwart.models import build_model, model_args, moe_args
from stalwart.models.moe import aux_loss, moe_modules, set_aux_grad_scale
from stalwart.train.parallel import clip_grad_norm_
from stalwart.train.parallel.pipeline import split_model
from stalwart.train.parallel.recompute import apply_recompute


def _model(name: str = "debug", seed: int = 0) -> torch.nn.Module:
    m = build_model(name, model_args(name, vocab_size=257, max_seq_len=16))
    m.init_weights(seed)
    return m


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 257, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def test_moe_model_shape_registry_and_determinism():
    a, b = _model("debug-moe"), _model("debug-moe")
    assert len(moe_modules(a)) == 4 and moe_args("debug") is None
    assert a.layers["0"].feed_forward.experts.w1.shape == (4, 256, 128)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    x, _ = _batch()
    assert a(x).shape == (2, 16, 257) and aux_loss(a) >= 1.0 - 1e-6  # E·Σ f·P ≥ 1 (1 = balanced)


def test_router_picks_top_k_and_weights_sum_to_one():
    moe = _model("debug-moe").layers["0"].feed_forward
    x = torch.randn(10, 128)
    weights, ids, aux = moe.route(x)
    probs = F.softmax(moe.router(x).float(), -1)
    assert torch.equal(ids, probs.topk(2, -1).indices)
    assert torch.allclose(weights.sum(-1), torch.ones(10))
    frac = torch.bincount(ids.flatten(), minlength=4).float() / ids.numel()
    assert torch.allclose(aux, 4 * (frac * probs.mean(0)).sum())


def test_moe_layer_equals_dense_loop_over_tokens():
    moe = _model("debug-moe").layers["1"].feed_forward
    x = torch.randn(1, 6, 128)
    out = moe(x)
    w, ids, _ = moe.route(x.view(-1, 128))
    e = moe.experts
    expected = torch.zeros(6, 128)
    for t in range(6):
        for k in range(2):
            j = ids[t, k]
            h = F.silu(x[0, t] @ e.w1[j].t()) * (x[0, t] @ e.w3[j].t())
            expected[t] += w[t, k] * (h @ e.w2[j].t())
    assert torch.allclose(out.view(6, 128), expected, atol=1e-5)


def test_aux_loss_gradient_is_that_of_the_explicit_objective():
    """Injected gradient == gradient of CE + coef·scale·Σ aux computed explicitly."""
    x, y = _batch()
    scale = 0.5
    injected = _model("debug-moe")
    set_aux_grad_scale(injected, scale)
    F.cross_entropy(injected(x).flatten(0, 1), y.flatten()).backward()

    explicit = _model("debug-moe")
    for m in moe_modules(explicit):
        m.coef = 0.0  # no injection; add the loss by hand
    auxes = []
    originals = {}
    for m in moe_modules(explicit):
        originals[m] = m.route

        def route(xx, m=m):
            w, i, a = originals[m](xx)
            auxes.append(a)
            return w, i, a

        m.route = route
    ce = F.cross_entropy(explicit(x).flatten(0, 1), y.flatten())
    (ce + 0.01 * scale * torch.stack(auxes).sum()).backward()
    gi, ge = _grads(injected), _grads(explicit)
    assert gi.keys() == ge.keys()
    for name in gi:
        assert torch.allclose(gi[name], ge[name], rtol=1e-5, atol=1e-8), name
    router = "layers.0.feed_forward.router.weight"
    plain = _model("debug-moe")
    for m in moe_modules(plain):
        m.coef = 0.0
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    assert not torch.allclose(_grads(plain)[router], gi[router]), "the aux loss must reach the router"


@pytest.mark.parametrize("name", ["debug", "debug-moe"])
@pytest.mark.parametrize("mode,every", [("full", 1), ("full", 2), ("selective", 1)])
def test_recompute_keeps_gradients_and_names(name, mode, every):
    x, y = _batch()
    ref, rc = _model(name), _model(name)
    wrapped = apply_recompute(rc.layers, mode, every)
    assert wrapped == (4 if every == 1 else 2)
    for m in (ref, rc):
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    gr, gc = _grads(ref), _grads(rc)
    assert gr.keys() == gc.keys()
    for k in gr:
        assert torch.allclose(gr[k], gc[k], rtol=1e-5, atol=1e-7), k
    assert set(rc.state_dict()) == set(ref.state_dict())  # checkpoints keep the model's names


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    x, y = _batch()
    a, b = _model(), _model()
    for m in (a, b):
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    na = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1, foreach=True)
    nb = clip_grad_norm_(list(b.parameters()), 0.1)
    assert torch.equal(na, nb)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("pp,v", [(2, 1), (2, 2), (4, 1)])
def test_pipeline_stages_compose_to_the_whole_model(pp, v):
    x, _ = _batch()
    whole = _model()
    expected = whole(x)
    stages = {}
    for rank in range(pp):
        ids, mods = split_model(_model(), rank, pp, v)
        stages.update(zip(ids, mods))
    h = x
    for s in range(pp * v):
        h = stages[s](h)
    assert torch.equal(h, expected)


def test_split_model_prunes_to_own_stages_with_original_names():
    model = _model()
    ids, stages = split_model(model, 1, 2, 2)  # rank 1 of pp=2 × v=2: stages 1 and 3 = layers 1, 3
    assert ids == [1, 3] and sorted(model.layers.keys()) == ["1", "3"]
    assert model.tok_embeddings is None and model.output is not None
    names = set(dict(model.named_parameters()))
    assert "layers.3.attention.wq.weight" in names and "output.weight" in names
    assert not any(n.startswith("tok_embeddings") for n in names)
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in model.parameters())


def test_state_hash_of_pipeline_parts_merged_equals_the_whole():
    """What `state_dict_hash(..., group=pp_group)` does with the stages' parts: digests merged by key,
    optimizer param groups merged element-wise with their parameter names concatenated."""
    from stalwart.utils.hashing import _digested, _merge, state_dict_hash

    whole = {"a": torch.arange(4.0), "b": torch.ones(2, 2), "c": torch.zeros(3)}
    first, last = {"a": whole["a"]}, {"b": whole["b"], "c": whole["c"]}
    assert state_dict_hash(_merge(_digested(first), _digested(last))) == state_dict_hash(whole)
    assert state_dict_hash(_merge(_digested(first), _digested({"b": whole["b"]}))) != state_dict_hash(whole)
    groups = _merge(
        {"param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.1, "params": []}]},
        {"param_groups": [{"lr": 0.1, "params": ["b"]}, {"lr": 0.1, "params": ["c"]}]},
    )
    assert groups == {"param_groups": [{"lr": 0.1, "params": ["a", "b"]}, {"lr": 0.1, "params": ["c"]}]}
    with pytest.raises(ValueError, match="disagree at .param_groups\\[0\\].lr"):
        _merge({"param_groups": [{"lr": 0.1}]}, {"param_groups": [{"lr": 0.2}]})


def _meta(name: str = "debug") -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(name, model_args(name, vocab_size=257, max_seq_len=16))


@pytest.mark.parametrize("name", ["debug", "debug-moe"])
def test_meta_build_materialises_the_same_weights_as_init_weights(name):
    """Each parameter is drawn from (seed, its name) alone: built on meta, wrapped for recompute (which
    renames parameters) and materialised, the model equals one initialised in memory, bitwise."""
    from stalwart.train.parallel.materialize import is_meta, materialize

    model = _meta(name)
    apply_recompute(model.layers, "full")
    assert is_meta(model)
    materialize(model, [], torch.device("cpu"), seed=5)
    assert not is_meta(model)
    want = _model(name, seed=5).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(model.rope, _model(name).rope), "buffers are recomputed after to_empty"
    assert not torch.equal(
        want["layers.0.attention.wq.weight"], _model(name, seed=6).state_dict()["layers.0.attention.wq.weight"]
    ), "the seed matters"


def test_init_of_a_parameter_does_not_depend_on_the_others():
    """Pruning (a pipeline stage) or sharding cannot shift another parameter's random stream."""
    from stalwart.train.parallel.materialize import materialize

    whole = _model(seed=2)

    pruned = _meta()
    _ids, stages = split_model(pruned, 1, 2)
    materialize(pruned, stages, torch.device("cpu"), seed=2)
    for name, p in pruned.named_parameters():
        assert torch.equal(p, whole.get_parameter(name)), name
    x, _ = _batch()
    h = whole.tok_embeddings(x)
    for i in ("0", "1"):
        h = whole.layers[i](h, whole.rope)
    assert torch.equal(stages[0](h), whole(x)), "the stage's own RoPE buffer was recomputed too"
