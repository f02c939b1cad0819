import json

import numpy as np
import pytest

from stalwart.data import GlobalSampler, TokenDataset, prepare
from stalwart.data.prepare import stdlib_files, verify
from stalwart.data.tokenizer import load_tokenizer


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("hello world\n" * 50)
    (src / "sub" / "b.md").write_text("héllo ünïcode ✓\n" * 30)
    (src / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"document number {i}"}) for i in range(20)))
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    return src


def test_byte_prepare_roundtrip(corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare([str(corpus)], out, tokenizer="byte", shard_tokens=500)
    texts = [
        (corpus / "a.txt").read_text(),
        *[f"document number {i}" for i in range(20)],
        (corpus / "sub" / "b.md").read_text(),
    ]
    expected_tokens = sum(len(t.encode()) + 1 for t in texts)
    assert manifest["n_tokens"] == expected_tokens
    assert manifest["n_documents"] == 22 and manifest["n_shards"] == -(-expected_tokens // 500)
    assert manifest["dtype"] == "uint16" and len(manifest["sources"]) == 3
    index = json.loads((out / "index.json").read_text())
    assert sum(s["n_tokens"] for s in index["shards"]) == expected_tokens
    # The stream is the documents in file order, each followed by EOS (256).
    stream = np.concatenate([np.fromfile(out / s["file"], dtype=np.uint16) for s in index["shards"]])
    first = np.frombuffer(texts[0].encode(), dtype=np.uint8)
    assert np.array_equal(stream[: len(first)], first) and stream[len(first)] == 256
    assert load_tokenizer(out).decode(stream[: len(first)].tolist()) == texts[0]
    assert verify(out) == []


def test_dataset_samples_cross_shard_boundaries(corpus, tmp_path):
    out = tmp_path / "out"
    prepare([str(corpus)], out, shard_tokens=97)
    ds = TokenDataset(out, seq_len=16)
    index = json.loads((out / "index.json").read_text())
    stream = np.concatenate([np.fromfile(out / s["file"], dtype=np.uint16) for s in index["shards"]])
    assert len(ds) == (len(stream) - 1) // 16
    for i in (0, 5, len(ds) - 1):
        assert np.array_equal(ds[i], stream[i * 16 : i * 16 + 17])
    x, y = ds.batch(np.array([3, 1]))
    assert x.shape == y.shape == (2, 16)
    assert np.array_equal(x[0, 1:].numpy(), y[0, :-1].numpy())


def test_bpe_prepare(corpus, tmp_path):
    out = tmp_path / "bpe"
    manifest = prepare([str(corpus)], out, tokenizer="bpe", vocab_size=300)
    tok = load_tokenizer(out)
    assert manifest["tokenizer"]["name"] == "bpe" and tok.vocab_size <= 300
    assert tok.decode(tok.encode("hello world")) == "hello world"
    # BPE merges make the stream shorter than raw bytes.
    assert manifest["n_tokens"] < sum(len(p.read_bytes()) for p in corpus.rglob("*.txt"))


def test_corruption_is_detected(corpus, tmp_path):
    out = tmp_path / "out"
    prepare([str(corpus)], out, shard_tokens=200)
    shard = out / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify(out) == ["shard_00001.bin"]


@pytest.mark.parametrize(
    "setup, kwargs, match",
    [
        (lambda d: None, {}, "has no text files"),
        (lambda d: (d / "x.txt").write_bytes(b"abc\x00def"), {}, "looks binary"),
        (lambda d: (d / "x.txt").write_bytes(b"\xff\xfe\xfa"), {}, "not UTF-8"),
        (lambda d: (d / "x.jsonl").write_text('{"text": "ok"}\n{broken\n'), {}, r"x.jsonl:2: invalid JSON"),
        (lambda d: (d / "x.jsonl").write_text('{"body": "no text"}\n'), {}, "string field 'text'"),
        (lambda d: (d / "x.txt").write_text("fine"), {"tokenizer": "wordpiece"}, "unknown tokenizer 'wordpiece'"),
        (lambda d: (d / "x.txt").write_text(""), {}, "hold no text"),
    ],
)
def test_bad_input_is_a_clear_error_and_leaves_nothing(tmp_path, setup, kwargs, match):
    src = tmp_path / "in"
    src.mkdir()
    setup(src)
    with pytest.raises(ValueError, match=match):
        prepare([str(src)], tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_existing_dataset_needs_overwrite(corpus, tmp_path):
    prepare([str(corpus)], tmp_path / "out")
    with pytest.raises(ValueError, match="--overwrite"):
        prepare([str(corpus)], tmp_path / "out")
    prepare([str(corpus)], tmp_path / "out", overwrite=True)


def test_missing_input_and_missing_dataset(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        prepare([str(tmp_path / "nope")], tmp_path / "out")
    with pytest.raises(ValueError, match="stalwart data prepare"):
        TokenDataset(tmp_path, seq_len=8)


def test_default_corpus_needs_no_download():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" and f.exists() for f in files)
    assert sum(f.stat().st_size for f in files) > 1 << 20


def test_stdlib_dataset_is_usable(stdlib_data):
    ds = TokenDataset(stdlib_data, seq_len=128)
    assert ds.vocab_size == 257 and len(ds) > 5000
    sampler = GlobalSampler(len(ds), global_batch=16, seed=1)
    x, _ = ds.batch(sampler.next_batch(0, 2))
    assert x.shape == (8, 128)
