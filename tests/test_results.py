"""The result layer: a bad file is recomputed, a bug in a state reader surfaces."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gatekeeper.cache.results import ResultLayer
from gatekeeper.identity import file_digest

TOKENS = [1, 2, 3, 4]
EDGES = [2]


def write(state, path):
    save_file(state, str(path))


def saved(tmp_path):
    layer = ResultLayer(tmp_path / "results", {"engine": "test"})
    data = layer.save(TOKENS, EDGES, {"keys": np.arange(64, dtype=np.float32)}, write)
    return layer, data


def rewrite(data, content: bytes):
    """Replace the state file and put its record's digest back in line, so only parsing can catch it."""
    data.write_bytes(content)
    meta = data.with_suffix(".json")
    record = json.loads(meta.read_text())
    record["sha256"] = file_digest(data, memo=False)
    meta.write_text(json.dumps(record))


def test_saved_state_loads(tmp_path):
    layer, _ = saved(tmp_path)
    state, why = layer.load(TOKENS, EDGES, load_file)
    assert why == "loaded" and np.array_equal(state["keys"], np.arange(64, dtype=np.float32))
    assert layer.load(TOKENS, [3], load_file) == (None, "missing")


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_unparseable_file_with_a_matching_digest_is_tampered(tmp_path, how):
    layer, data = saved(tmp_path)
    raw = data.read_bytes()
    rewrite(data, {"truncated": raw[: len(raw) // 2], "garbage": b"not a safetensors file " * 8, "empty": b""}[how])
    assert layer.load(TOKENS, EDGES, load_file) == (None, "tampered")


def test_real_torch_reader_on_a_truncated_file_is_tampered(tmp_path):
    from safetensors.torch import load_file as torch_load

    layer, data = saved(tmp_path)
    rewrite(data, data.read_bytes()[:-16])
    assert layer.load(TOKENS, EDGES, torch_load) == (None, "tampered")


def test_missing_key_in_the_file_is_tampered(tmp_path):
    layer, _ = saved(tmp_path)
    assert layer.load(TOKENS, EDGES, lambda p: load_file(p)["values"]) == (None, "tampered")


@pytest.mark.parametrize("record", ["{not json", "[1, 2]", '{"tokens": 4}', '{"sha256": 7}'])
def test_invalid_record_is_tampered(tmp_path, record):
    layer, data = saved(tmp_path)
    data.with_suffix(".json").write_text(record)
    assert layer.load(TOKENS, EDGES, load_file) == (None, "tampered")


def test_altered_file_is_tampered(tmp_path):
    layer, data = saved(tmp_path)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert layer.load(TOKENS, EDGES, load_file) == (None, "tampered")


@pytest.mark.parametrize("error", [TypeError("a bug"), AttributeError("a bug"), RuntimeError("a bug"), ValueError("a bug")])
def test_a_bug_in_the_reader_propagates(tmp_path, error):
    layer, _ = saved(tmp_path)

    def reader(path):
        load_file(path)  # the file itself is fine
        raise error

    with pytest.raises(type(error), match="a bug"):
        layer.load(TOKENS, EDGES, reader)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_mlx_reader_on_an_unparseable_file_is_tampered(tmp_path, how):
    from mlx_lm.models.cache import load_prompt_cache

    layer, data = saved(tmp_path)
    raw = data.read_bytes()
    rewrite(data, {"truncated": raw[: len(raw) // 2], "garbage": b"not a safetensors file " * 8, "empty": b""}[how])
    assert layer.load(TOKENS, EDGES, load_prompt_cache) == (None, "tampered")
