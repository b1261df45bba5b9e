import pytest

from apriel2_jax.config import parse_config
from apriel2_jax.placement import PlacementError, load_placements, resolve_placement
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def config():
    return parse_config(tiny_config())


def test_default_is_main_mixer(config):
    assert resolve_placement(config) == (None, None, None, None, None, "attention")


def test_list_mapping_named_and_aliases(config):
    assert resolve_placement(config, [None, "gdn", None, "attention", None, "gdn"])[-1] == "gdn"
    assert resolve_placement(config, {"5": "attn"})[-1] == "attention"
    named = {"fast": {"5": "gdn"}}
    assert resolve_placement(config, "fast", named)[-1] == "gdn"
    # A fixed layer may be named by its type, an alias of it, or (a sliding window) sliding_window / swa.
    assert resolve_placement(config, ["attn", "gdn", "kda", "sliding_window", "mamba", "attn"])[-1] == "attention"
    assert resolve_placement(config, {"0": "attention", "3": "swa", "5": "gdn"})[-1] == "gdn"
    assert resolve_placement(config, {"3": "attention", "5": "gdn"})[-1] == "gdn"  # its type in config.json


@pytest.mark.parametrize(
    "spec, message",
    [
        ([None] * 5, "lists 5 mixers, but the model has 6"),
        ([None] * 5 + ["kda"], "layer 5: unknown mixer 'kda'"),
        ([None] * 6, "no mixer for stochastic layer 5"),
        (["gdn"] + [None] * 4 + ["gdn"], "layer 0 is a fixed attention layer"),
        (["swa"] + [None] * 4 + ["gdn"], "layer 0 is a fixed attention layer; the placement asks for 'swa'"),
        ({"1": "attention", "5": "gdn"}, "layer 1 is a fixed gdn layer; the placement asks for 'attention'"),
        ({"0": "attention"}, "does not name a mixer for stochastic layer 5"),
        ({"9": "gdn"}, "model has 6 layers"),
        ({"x": "gdn"}, "not a layer index"),
        ("nope", "unknown placement 'nope'"),
        ("bad", "placement 'bad': layer 5: unknown mixer 'nonsense'"),
    ],
)
def test_bad_placements(config, spec, message):
    named = {"main": {"5": "attention"}, "bad": {"5": "nonsense"}}
    with pytest.raises(PlacementError, match=message):
        resolve_placement(config, spec, named)


def test_malformed_placements_file_is_named(tmp_path):
    path = tmp_path / "placements.json"
    path.write_text("{main: 1}")
    with pytest.raises(PlacementError, match=f"{path}: not valid JSON"):
        load_placements(tmp_path)
