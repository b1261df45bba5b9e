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
from .rope import apply_rope

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
    """pages: [P, page_size, G, D]; new: [B, T, G, D]; slots: [B, T] flat slots. Returns the updated pages.

    Tokens whose slot is in the sink page (padding) are dropped rather than written there: nothing reads the sink,
    and every other slot is written by at most one token, so the scatter can promise unique indices (XLA then
    writes without guarding against collisions: an 8192-token prefill step of the 0.5B geometry ran ~1.5% faster,
    H200)."""
    num_pages, page_size = pages.shape[:2]
    index = slots.reshape(-1)
    if index.shape[0] == 1:
        # One token (a one-row decode step), written into the pages' own shape: a padding token may land in the
        # sink page, as no other token does. XLA's CPU backend turned the one-index scatter into an update of
        # the flat view and repeated it for each shape its readers used, copying every page (a one-row decode
        # step of a two-layer all-attention geometry took 396 ms on CPU, 2.6 ms written this way).
        row = new.reshape((1, 1) + new.shape[2:]).astype(pages.dtype)
        zero = jnp.zeros((), index.dtype)
        return jax.lax.dynamic_update_slice(pages, row, (index[0] // page_size, index[0] % page_size, zero, zero))
    index = jnp.where(index // page_size == SINK_PAGE, num_pages * page_size, index)  # out of bounds: dropped
    flat = pages.reshape((num_pages * page_size,) + pages.shape[2:])
    flat = flat.at[index].set(new.reshape((-1,) + new.shape[2:]).astype(pages.dtype), unique_indices=True,
                              mode="drop")
    return flat.reshape(pages.shape)


def check_paged_inputs(q, k_pages, v_pages, block_table, first_page, q_positions) -> None:
    """Shapes and dtypes of the paged-attention arguments (the kernels' common input checks), as ValueErrors that
    name the argument."""
    if q.ndim != 4:
        raise ValueError(f"q must be [S, T, H, D], got shape {q.shape}")
    rows, length, heads, head_dim = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [P, page_size, G, D]; got {k_pages.shape} and {v_pages.shape}")
    groups = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"head dim of the pages ({k_pages.shape[3]}) differs from q's ({head_dim})")
    if groups == 0 or heads % groups:
        raise ValueError(f"the {groups} KV heads must divide the {heads} query heads "
                         f"(query heads must be a multiple of KV heads)")
    if block_table.ndim != 2 or block_table.shape[0] != rows:
        raise ValueError(f"block_table must be [S={rows}, M], got {block_table.shape}")
    if first_page.shape != (rows,):
        raise ValueError(f"first_page must be [S={rows}], got {first_page.shape}")
    if q_positions.shape != (rows, length):
        raise ValueError(f"q_positions must be [S, T] = {(rows, length)}, got {q_positions.shape}")
    for name, x in (("block_table", block_table), ("first_page", first_page), ("q_positions", q_positions)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")


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


def rope_write_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slots: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    first_page: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An attention layer's decode step after its projections (one token per row): RoPE on the new query and
    key, the new key and value written to their page slot, then attention through the block tables: the oracle
    of the GPU kernel that does all of it at once (the modules take that kernel through ``dispatch.kernel`` and
    run this chain's dispatched ops where there is none).

    q: [S, H, D]; k, v: [S, G, D], before RoPE, or k = v = None with q [S, H + 2G, D] holding the keys and values
    after the query heads (the projections' outputs side by side: a merged Q/K/V matmul's output needs no copies
    to split it); cos, sin: [S, D] (``rope_cos_sin`` of the rows' positions);
    slots: [S] flat page slot of each row's token (``page_slots``; padding rows point into the sink page);
    the rest as ``paged_attention`` with q_positions [S, 1]. Returns the output [S, H, D] and the pages."""
    if k is None and v is None:
        groups = k_pages.shape[2]
        heads = q.shape[1] - 2 * groups
        q, k, v = q[:, :heads], q[:, heads : heads + groups], q[:, heads + groups :]
    q = apply_rope(q[:, None], cos[:, None], sin[:, None])
    k = apply_rope(k[:, None], cos[:, None], sin[:, None])
    k_pages = write_pages(k_pages, k, slots[:, None])
    v_pages = write_pages(v_pages, v[:, None], slots[:, None])
    out = paged_attention(q, k_pages, v_pages, block_table, first_page, q_positions, window)
    return out[:, 0], k_pages, v_pages
