"""The engine's device-side contract: one ``PagedBatch`` of metadata per step, shared by every layer.

Rows are sequences, padded to the step's bucket: [S rows, T tokens]. Attention layers read and write K/V pages
of their family through ``tables[family]``; recurrent layers gather their state rows from the state-slot pools
by ``slots`` and scatter them back. Padding rows have slot 0 and empty (sink) tables, padding tokens a False
``token_mask``: they only ever touch the sink page and sink slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..ops.slots import slot_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    positions: jax.Array  # [S, T] int32 absolute positions
    token_mask: jax.Array  # [S, T] bool, False for padding
    last_index: jax.Array  # [S] int32, index of each row's last valid token (whose logits are returned)
    slots: jax.Array  # [S] int32 state slot, 0 (sink) for padding rows
    fresh: jax.Array  # [S] bool, True where a row's recurrent state starts from zeros (first chunk)
    tables: dict  # family -> [S, M] int32 page ids by logical page, 0 = empty
    first_page: dict  # family -> [S] int32 logical index of table column 0

    def varlen(self) -> tuple[jax.Array, jax.Array]:
        """The rows as sequences packed in one token buffer (row-major [S*T]): start offsets and lengths."""
        rows, length = self.token_mask.shape
        starts = jnp.arange(rows, dtype=jnp.int32) * length
        return starts, jnp.sum(self.token_mask, axis=1).astype(jnp.int32)


def gather_rows(pool: dict, slots: jax.Array, fresh: jax.Array) -> dict:
    """State rows for the step; a fresh row starts from zeros whatever its slot held before."""
    return jax.tree.map(lambda a: slot_rows(a, slots, fresh), pool)



def scatter_rows(pool: dict, slots: jax.Array, rows: dict) -> dict:
    return jax.tree.map(lambda a, r: a.at[slots].set(r.astype(a.dtype)), pool, rows)
