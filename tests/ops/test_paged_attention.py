"""Page writes of the paged-attention reference (``apriel2_jax.ops.paged_attention``)."""

import jax.numpy as jnp
import numpy as np

from apriel2_jax.ops.paged_attention import page_slots, paged_attention, write_pages


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


def test_one_token_write_lands_in_its_slot_in_place():
    """A one-row decode step writes its token into its slot (a padding token only into the sink page), and the
    compiled update works in place: no copy of the pages (XLA's CPU backend once copied every page for it)."""
    import jax

    rng = np.random.default_rng(1)
    num_pages, page_size, groups, dim = 5, 4, 2, 8
    pages = jnp.asarray(rng.standard_normal((num_pages, page_size, groups, dim)), jnp.float32)
    table = jnp.asarray([[3, 1]], jnp.int32)
    new = jnp.asarray(rng.standard_normal((1, 1, groups, dim)), jnp.float32)
    for position, valid, page in ((6, True, 1), (2, True, 3), (6, False, None)):
        slots = page_slots(jnp.asarray([[position]]), jnp.asarray([[valid]]), table, jnp.zeros(1, jnp.int32), page_size)
        out = np.asarray(write_pages(pages, new, slots))
        want = np.asarray(pages).copy()
        if page is not None:
            want[page, position % page_size] = np.asarray(new[0, 0])
        np.testing.assert_array_equal(out[1:], want[1:])  # the sink page (0) is never read

    # In place where it mattered: the decode chain writes the token, attention reads the written pages, and
    # the pages are returned (donated), as in a step.
    def decode(k_pages, v_pages, q, k, v, slots):
        k_pages, v_pages = write_pages(k_pages, k, slots), write_pages(v_pages, v, slots)
        out = paged_attention(q, k_pages, v_pages, table, jnp.zeros(1, jnp.int32), jnp.asarray([[7]]))
        return out, k_pages, v_pages

    q = jnp.asarray(rng.standard_normal((1, 1, 4, dim)), jnp.float32)
    slots = jnp.asarray([[3 * page_size + 2]], jnp.int32)
    compiled = jax.jit(decode, donate_argnums=(0, 1)).lower(pages, pages, q, new, new, slots).compile().as_text()
    copies = [line for line in compiled.splitlines() if " copy(" in line and f"[{num_pages},{page_size}," in line]
    assert not copies, copies
