"""scripts/bench_attention.py's chained-layer section, in its CPU dry run (interpret mode, tiny shapes)."""

import argparse
import json

import pytest

from tests.helpers import load_script


def _script():
    return load_script("bench_attention")


def test_layers_section_times_each_batch_and_schedule(tmp_path):
    out = tmp_path / "rows.json"
    assert _script().main(["--section", "layers", "--dry-run", "--schedule", "default", "16x2",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["schedule"]) for r in rows] == [(1, "default"), (1, "16x2"), (2, "default"), (2, "16x2")]
    assert all(r["us_per_layer"] > 0 for r in rows)
    assert [(r["block_tokens"], r["splits"]) for r in rows if r["schedule"] == "16x2"] == [(16, 2), (16, 2)]


def test_a_malformed_schedule_is_refused_by_name():
    with pytest.raises(SystemExit):
        _script().main(["--section", "layers", "--dry-run", "--schedule", "12"])


def test_schedule_options_become_kernel_keywords():
    parse = _script().parse_schedule
    assert parse("128x4:scalar:w8:st2:pf0") == dict(block_tokens=128, splits=4, page_ids="scalar", num_warps=8,
                                                    num_stages=2, prefetch_ids=0)
    assert parse("default:vector") == {"page_ids": "vector"} and parse("default") == {}
    with pytest.raises(argparse.ArgumentTypeError, match="fast"):
        parse("128x4:fast")


def test_wider_tables_set_the_default_split_count(tmp_path):
    """--table-pages widens the block tables as the engine's are; the default schedule follows their width."""
    import jax.numpy as jnp

    from pallas_kernels.paged_attention_decode import default_schedule

    out = tmp_path / "rows.json"
    assert _script().main(["--section", "layers", "--dry-run", "--table-pages", "40", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    # the dry run's geometry: 2 KV heads, D = 16, pages of 8 tokens
    assert [r["splits"] for r in rows] == [default_schedule(r["batch"], 2, 40 * 8, 16, jnp.bfloat16)[1] for r in rows]
    assert rows[0]["splits"] != default_schedule(1, 2, 6 * 8, 16, jnp.bfloat16)[1]  # the context's own 6 pages
