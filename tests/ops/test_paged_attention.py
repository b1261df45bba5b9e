"""Page writes of the paged-attention reference (``apriel2_jax.ops.paged_attention``)."""

import jax.numpy as jnp
import numpy as np

from apriel2_jax.ops.paged_attention import page_slots, write_pages


def test_write_pages_writes_each_valid_token_to_its_slot_and_drops_padding():
    """Two rows through random tables: row 0 has 5 valid tokens from position 6 (across a page boundary), row 1
    is padding only. Valid tokens land in their page slots; padding leaves the sink page and every other slot as
    they were."""
    rng = np.random.default_rng(0)
    num_pages, page_size, groups, dim = 6, 8, 2, 4
    pages = jnp.asarray(rng.standard_normal((num_pages, page_size, groups, dim)), jnp.float32)
    table = jnp.asarray([[4, 2, 0], [0, 0, 0]], jnp.int32)
    positions = jnp.asarray([np.arange(6, 12), np.arange(6)], jnp.int32)
    token_mask = jnp.asarray([[True] * 5 + [False], [False] * 6])
    new = jnp.asarray(rng.standard_normal((2, 6, groups, dim)), jnp.float32)
    slots = page_slots(positions, token_mask, table, jnp.zeros(2, jnp.int32), page_size)
    out = np.asarray(write_pages(pages, new, slots))
    want = np.asarray(pages).copy()
    for t, position in enumerate(range(6, 11)):
        page = [4, 2][position // page_size]
        want[page, position % page_size] = np.asarray(new[0, t])
    np.testing.assert_array_equal(out, want)
