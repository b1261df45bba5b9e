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


@pytest.mark.parametrize(
    "spec, message",
    [
        ([None] * 5, "lists 5 mixers, but the model has 6"),
        ([None] * 5 + ["kda"], "layer 5: unknown mixer 'kda'"),
        ([None] * 6, "no mixer for stochastic layer 5"),
        (["gdn"] + [None] * 4 + ["gdn"], "layer 0 is a fixed attention layer"),
        ({"0": "attention"}, "does not name a mixer for stochastic layer 5"),
        ({"9": "gdn"}, "model has 6 layers"),
        ({"x": "gdn"}, "not a layer index"),
        ("nope", "unknown placement 'nope'"),
    ],
)
def test_bad_placements(config, spec, message):
    with pytest.raises(PlacementError, match=message):
        resolve_placement(config, spec, {"main": {"5": "attention"}})


def test_fixed_layer_takes_its_type_or_its_block_name(config):
    # Layer 3 is the fixed sliding-window attention block 'swa'; a conversion that leaves a supernet layer one
    # mixer names its block after that mixer, so placements written for the supernet keep resolving.
    assert resolve_placement(config, [None, None, None, "swa", None, "gdn"])[-1] == "gdn"
    assert resolve_placement(config, {"3": "swa", "0": "attention", "5": "gdn"})[-1] == "gdn"
    assert resolve_placement(config, {"0": "attn", "5": "gdn"})[-1] == "gdn"  # aliases of the type, as in lists
    with pytest.raises(PlacementError, match=r"layer 3 is a fixed attention layer; .* 'gdn' \(a fixed layer takes "
                       r"its type 'attention' or its block name 'swa'\)"):
        resolve_placement(config, {"3": "gdn", "5": "gdn"})


def test_malformed_placements_file_is_named(tmp_path):
    path = tmp_path / "placements.json"
    path.write_text("{main: 1}")
    with pytest.raises(PlacementError, match=f"{path}: not valid JSON"):
        load_placements(tmp_path)


def test_fixed_layer_takes_the_name_of_a_numbered_block():
    # Layers left with the same mixer but otherwise different get blocks 'NAME', 'NAME_2'... (convert/thinning.py).
    data = tiny_config()
    data["decoder"]["blocks"]["sliding_window_2"] = data["decoder"]["blocks"].pop("swa")
    data["decoder"]["pattern"][3] = "sliding_window_2"
    config = parse_config(data)
    assert resolve_placement(config, {"3": "sliding_window", "5": "gdn"})[-1] == "gdn"
    with pytest.raises(PlacementError, match="layer 3 is a fixed attention layer"):
        resolve_placement(config, {"3": "sliding", "5": "gdn"})
