import pytest
import torch

from stalwart.models import SPECS, ModelArgs, Transformer, count_params, get_spec, meta_param_count

PAPER_SHAPES = [
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "gpt3-175b",
    "bloom-176b",
    "falcon-180b",
    "opt-175b",
]


@pytest.mark.parametrize("name", PAPER_SHAPES)
def test_paper_shape_param_count_matches_published_total(name):
    spec = get_spec(name)
    assert spec.published_params and spec.source
    count = meta_param_count(spec.args)
    assert abs(count - spec.published_params) / spec.published_params < 0.02, (name, count)


def test_trainable_sizes():
    assert 1e6 <= meta_param_count(SPECS["debug"].args) <= 5e6
    assert 22e6 <= meta_param_count(SPECS["small"].args) <= 28e6


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'llama9'.*debug"):
        get_spec("llama9")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=100, n_heads=3), "divisible"),
        (dict(n_kv_heads=3), "multiple"),
        (dict(mlp="relu"), "model.mlp"),
    ],
)
def test_bad_shape_is_rejected(kwargs, match):
    base = dict(dim=64, n_layers=1, n_heads=4, vocab_size=50)
    with pytest.raises(ValueError, match=match):
        ModelArgs(**{**base, **kwargs})


def _tiny(**kw) -> Transformer:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden=96, max_seq_len=32, **kw)
    model = Transformer(args)
    model.init_weights(seed=3)
    return model


@pytest.mark.parametrize(
    "kw", [{}, {"pos": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True}, {"pos": "alibi"}]
)
def test_forward_shape_and_causality(kw):
    model = _tiny(**kw)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, 97)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 97
    # A later token must not change earlier positions' logits.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_gqa_uses_fewer_kv_parameters():
    mha = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=10, ffn_hidden=64)
    gqa = mha.with_(n_kv_heads=1)
    with torch.device("meta"):
        assert count_params(Transformer(mha)) - count_params(Transformer(gqa)) == 2 * 64 * (64 - 16)


def test_tied_embeddings_share_storage_and_count_once():
    model = _tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    untied = _tiny()
    assert count_params(untied) - count_params(model) == 97 * 64


def test_init_is_deterministic_and_seed_dependent():
    a, b, c = _tiny(), _tiny(), Transformer(_tiny().args)
    c.init_weights(seed=4)
    for (n, p), q, _r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert not all(torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        _tiny()(torch.zeros(1, 33, dtype=torch.long))
