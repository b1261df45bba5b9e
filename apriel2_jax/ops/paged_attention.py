"""Attention over K/V stored in pages, read through block tables: the reference for the paged kernels.

Pages of one attention family: ``k_pages``/``v_pages`` [num_pages, page_size, G, D] per layer. A row's block
table lists page ids by *logical* page index, starting at ``first_page`` (window families keep only the pages
inside the window, so their tables are short); entries equal to the sink page (id 0) are empty. Key positions
are implied by the logical index, so the mask needs no stored positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention import attention

SINK_PAGE = 0


def page_slots(
    positions: jax.Array, token_mask: jax.Array, block_table: jax.Array, first_page: jax.Array, page_size: int
) -> jax.Array:
    """Flat slot (page * page_size + offset) of every token; padding tokens map into the sink page."""
    logical = positions // page_size - first_page[:, None]
    logical = jnp.clip(logical, 0, block_table.shape[1] - 1)
    pages = jnp.take_along_axis(block_table, logical, axis=1)
    pages = jnp.where(token_mask, pages, SINK_PAGE)
    return pages * page_size + positions % page_size


def write_pages(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """pages: [P, page_size, G, D]; new: [B, T, G, D]; slots: [B, T] flat slots. Returns the updated pages."""
    num_pages, page_size = pages.shape[:2]
    flat = pages.reshape((num_pages * page_size,) + pages.shape[2:])
    flat = flat.at[slots.reshape(-1)].set(new.reshape((-1,) + new.shape[2:]).astype(pages.dtype))
    return flat.reshape(pages.shape)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    first_page: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """q: [B, T, H, D]; k_pages, v_pages: [P, page_size, G, D]; block_table: [B, M] page ids; first_page: [B]
    logical index of table column 0; q_positions: [B, T]. The new tokens' K/V must already be written.
    Returns [B, T, H, D]."""
    batch, width = block_table.shape
    page_size = k_pages.shape[1]
    k = k_pages[block_table].reshape((batch, width * page_size) + k_pages.shape[2:])
    v = v_pages[block_table].reshape((batch, width * page_size) + v_pages.shape[2:])
    logical = first_page[:, None] + jnp.arange(width)[None, :]
    kv_positions = (logical[:, :, None] * page_size + jnp.arange(page_size)).reshape(batch, width * page_size)
    kv_valid = jnp.repeat(block_table != SINK_PAGE, page_size, axis=1)
    return attention(q, k, v, q_positions, kv_positions, kv_valid, window)
