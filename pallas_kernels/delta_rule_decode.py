"""GDN/KDA decode update in Pallas (Triton backend): one token per sequence, state read from and written back to
the state-slot pool in place.

One program per (row, group of value heads, V-slab); the heads of a group run in a loop that Triton pipelines.
For each head it loads the [K, BV] slab of its row's state (fp32), applies the
decay (a scalar per head for GDN, a vector over K for KDA), the delta write and the read, and stores the slab
and the output slab; q/k L2 normalisation and the q scale happen in the kernel. Decode is memory-bound: the
state is read and written once, nothing else of that size moves. Slabs over V are independent because every
reduction of the update runs over K.

The reference (and CPU path) is ``apriel2_jax.ops.delta_rule.delta_rule_decode_slots``. ``delta_rule_decode_packed``
reads q, k and v from GDN's conv output buffer [B, 2 H_k K + H V] at their offsets (oracle
``delta_rule_decode_slots_packed``): three arrays would cost the step three slice copies per GDN layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax.ops.norms import softplus

from . import causal_conv1d as conv
from .paged_attention_decode import ONE_WAVE_PROGRAMS

F32 = jnp.float32


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(q: jax.Array, v: jax.Array, g: jax.Array) -> bool:
    """The Triton backend needs power-of-two loads: K, and V (sliced in slabs) must be powers of two."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    return _is_power_of_two(key_dim) and _is_power_of_two(value_dim) and g.shape[-1] in (1, key_dim)


def step_slab(state_ref, slot, head, cols, fresh, q, k, v, decay, beta, scale, state=None):
    """One head's [K, BV] slab of the state, one token: q/k L2 norm (q scaled), decay, delta write, read. Stores
    the slab and returns the output slab [BV] in fp32. q, k: [K] raw fp32; v: [BV]; decay: broadcastable to
    [K, BV]; beta: scalar. ``state``: the slab as loaded earlier by the caller (its load then overlaps the work
    that computes q, k, v and the gates), else loaded here."""
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    s = state_ref[slot, head, :, cols] if state is None else state
    s = jnp.where(fresh, jnp.zeros_like(s), s) * decay
    u = beta * (v - jnp.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    state_ref[slot, head, :, cols] = s
    return jnp.sum(s * q[:, None], axis=0)


def update_slab(state_ref, o_ref, slot, row, head, cols, fresh, q, k, v, decay, beta, scale):
    """``step_slab`` storing the output slab in ``o_ref``. Shared with the fused kernel."""
    o_ref[row, head, cols] = step_slab(state_ref, slot, head, cols, fresh, q, k, v, decay, beta,
                                       scale).astype(o_ref.dtype)


def launch_grid(batch: int, groups: int, slabs: int, slab_fastest: bool) -> tuple[int, int, int]:
    """The grid of (row, group of heads, V-slab) programs. CUDA schedules the first grid axis fastest: with
    ``slab_fastest`` the programs that share a head's state rows (its slabs) run together, so each 512-byte row of
    a 128-wide fp32 state is fetched while its other half is also in flight, instead of one pass over the pool per
    slab."""
    return (slabs, groups, batch) if slab_fastest else (batch, groups, slabs)


def program_ids(slab_fastest: bool):
    """(row, group, slab) of this program under ``launch_grid``."""
    if slab_fastest:
        return pl.program_id(2), pl.program_id(1), pl.program_id(0)
    return pl.program_id(0), pl.program_id(1), pl.program_id(2)


def _kernel(slots_ref, fresh_ref, *refs, rep, scale, bv, hp, slab_fastest, packed):
    if packed is None:
        q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, o_ref, state_ref = refs
    else:  # one [B, 2 H_k K + H V] buffer: q heads, k heads, v heads
        mixed_ref, g_ref, beta_ref, state_in_ref, o_ref, state_ref = refs
    del state_in_ref  # aliased with state_ref: the pool is updated in place
    row, group, slab = program_ids(slab_fastest)
    slot = slots_ref[row]
    fresh = fresh_ref[row] != 0
    cols = pl.ds(slab * bv, bv)

    def qkv(key_head, head):
        if packed is None:
            return q_ref[row, key_head, :], k_ref[row, key_head, :], v_ref[row, head, cols]
        key_heads, key_dim, value_dim = packed
        key_size = key_heads * key_dim
        return (mixed_ref[row, pl.ds(key_head * key_dim, key_dim)],
                mixed_ref[row, pl.ds(key_size + key_head * key_dim, key_dim)],
                mixed_ref[row, pl.ds(2 * key_size + head * value_dim + slab * bv, bv)])

    def one_head(i, carry):
        # ``hp`` heads per program, in a loop that Triton can software-pipeline (the next slab loads while this
        # one is updated): more bytes in flight per SM than one slab per program.
        head = group * hp + i
        key_head = head // rep
        decay = jnp.exp(g_ref[row, head, :].astype(F32))  # [1] (GDN) or [K] (KDA)
        q, k, v = qkv(key_head, head)
        update_slab(state_ref, o_ref, slot, row, head, cols, fresh, q.astype(F32), k.astype(F32), v.astype(F32),
                    decay[:, None], beta_ref[row, head].astype(F32), scale)
        return carry

    jax.lax.fori_loop(0, hp, one_head, 0)


_STATIC = ("block_v", "num_warps", "heads_per_program", "num_stages", "slab_fastest", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state_pool",))
def delta_rule_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    block_v: int = 64,
    num_warps: int = 2,
    heads_per_program: int = 1,
    num_stages: int = 1,
    slab_fastest: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q, k: [B, H_k, K] raw; v: [B, H, V]; g: [B, H] (GDN) or [B, H, K] (KDA) log decay; beta: [B, H];
    state_pool: [N, H, K, V] fp32, updated in place (donated); slots: [B] int32 pool rows (repeats only for the
    sink); fresh: [B] bool, rows whose state starts from zeros (a one-token prompt in a reused slot).
    Returns o [B, H, V] in v's dtype and the pool."""
    key_heads, key_dim = q.shape[1:]
    return _launch((q, k, v), key_heads, key_dim, v.shape[2], g, beta, state_pool, slots, fresh, v.dtype,
                   packed=False, block_v=block_v, num_warps=num_warps, heads_per_program=heads_per_program,
                   num_stages=num_stages, slab_fastest=slab_fastest, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("key_heads", "key_dim") + _STATIC, donate_argnames=("state_pool",))
def delta_rule_decode_packed(
    mixed: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    key_heads: int,
    key_dim: int,
    block_v: int = 64,
    num_warps: int = 2,
    heads_per_program: int = 1,
    num_stages: int = 1,
    slab_fastest: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``delta_rule_decode`` reading q, k and v from one buffer (the oracle
    ``apriel2_jax.ops.delta_rule.delta_rule_decode_slots_packed``): mixed [B, 2 H_k K + H V]."""
    heads = beta.shape[1]
    value_size = mixed.shape[-1] - 2 * key_heads * key_dim
    if mixed.ndim != 2 or value_size <= 0 or value_size % heads:
        raise ValueError(f"packed q|k|v must be [B, 2 * {key_heads} * {key_dim} + {heads} * V], got "
                         f"{list(mixed.shape)}")
    return _launch((mixed,), key_heads, key_dim, value_size // heads, g, beta, state_pool, slots, fresh,
                   mixed.dtype, packed=True, block_v=block_v, num_warps=num_warps,
                   heads_per_program=heads_per_program, num_stages=num_stages, slab_fastest=slab_fastest,
                   interpret=interpret)


def _launch(qkv, key_heads, key_dim, value_dim, g, beta, state_pool, slots, fresh, dtype, *, packed, block_v,
            num_warps, heads_per_program, num_stages, slab_fastest, interpret):
    batch, heads = beta.shape
    block_v = min(block_v, value_dim)
    if g.ndim == 2:
        g = g[..., None]
    if heads % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} must divide the {heads} heads")
    kernel = functools.partial(_kernel, rep=heads // key_heads, scale=key_dim**-0.5, bv=block_v, hp=heads_per_program,
                               slab_fastest=slab_fastest, packed=(key_heads, key_dim, value_dim) if packed else None)
    inputs = (slots.astype(jnp.int32), fresh.astype(jnp.int32), *qkv, g.astype(F32), beta, state_pool)
    return pl.pallas_call(
        kernel,
        name="delta_rule_decode",
        grid=launch_grid(batch, heads // heads_per_program, value_dim // block_v, slab_fastest),
        out_shape=(jax.ShapeDtypeStruct((batch, heads, value_dim), dtype), jax.ShapeDtypeStruct(state_pool.shape, F32)),
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*inputs)


DISPATCH_CONFIG = dict(block_v=64, num_warps=4, heads_per_program=1, num_stages=1, slab_fastest=True)


def decode_slots(q, k, v, g, beta, state_pool, slots, fresh):
    """The dispatch entry: the kernel where the Triton backend can take the shapes, the jnp op otherwise."""
    from apriel2_jax.ops.delta_rule import delta_rule_decode_slots

    if not supported(q, v, g if g.ndim == 3 else g[..., None]):
        return delta_rule_decode_slots(q, k, v, g, beta, state_pool, slots, fresh)
    # Best of scripts/sweep_decode.py for both mixers (H100, 2026-11-22, device time, two runs): 64-wide slabs,
    # 4 warps, slabs of a head launched together; 99-102% (GDN) and 96-101% (KDA) of measured HBM bandwidth.
    return delta_rule_decode(q, k, v, g, beta, state_pool, slots, fresh, **DISPATCH_CONFIG)


def decode_slots_packed(mixed, g, beta, state_pool, slots, fresh, *, key_heads, key_dim):
    """Dispatch entry for "delta_rule_decode_slots_packed" (GDN's conv output read in place)."""
    from apriel2_jax.ops.delta_rule import delta_rule_decode_slots_packed, split_packed_qkv

    q, _, v = jax.eval_shape(lambda m: split_packed_qkv(m, key_heads, key_dim, beta.shape[1]), mixed)
    if not supported(q, v, g if g.ndim == 3 else g[..., None]):
        return delta_rule_decode_slots_packed(mixed, g, beta, state_pool, slots, fresh, key_heads=key_heads,
                                              key_dim=key_dim)
    return delta_rule_decode_packed(mixed, g, beta, state_pool, slots, fresh, key_heads=key_heads, key_dim=key_dim,
                                    **DISPATCH_CONFIG)


# ---------------------------------------------------------------------------------------------------------------
# The update with its gates and output norm (GDN and KDA decode from their convs' outputs to the output projection)


def _head_convs(proj_ref, weight_refs, bias_refs, pool_refs, row, slot, fresh, head, dim, *, barrier):
    """KDA's q, k and v convs (silu) on one head's channels for one row: inputs at columns i H D + head D of the
    projections buffer, weights [Kc, H D], the pools [P, Kc-1, H D] updated in place (each (head, row) program
    owns its channels of its row's slot). Returns q, k, v [D] rounded to the buffer's dtype, as the conv kernel
    stores them, in fp32."""
    size = weight_refs[0].shape[1]
    cols, dtype = pl.ds(head * dim, dim), proj_ref.dtype
    windows, inputs, outs = [], [], []
    for i, (w_ref, b_ref, pool_ref) in enumerate(zip(weight_refs, bias_refs, pool_refs)):
        windows.append(conv.previous_inputs(pool_ref, slot, fresh, cols, dtype))
        inputs.append(proj_ref[row, pl.ds(i * size + head * dim, dim)])
        outs.append(conv.decode_output(windows[-1], inputs[-1], w_ref, b_ref, cols).astype(dtype).astype(F32))
    if barrier:  # every load of the old state before a store of the new one
        pltriton.debug_barrier()
    for pool_ref, window, x in zip(pool_refs, windows, inputs):
        conv.store_state(pool_ref, slot, cols, window, x)
    return outs


def _gated_kernel(slots_ref, fresh_ref, *refs, mixer, rep, scale, key_dim, value_dim, heads, offsets, eps,
                  norm_act, barrier=False, early_loads=False):
    """One program per (head, row), the head's whole [K, V] state. GDN: refs = (q|k|v buffer, projections buffer
    (z, b, a), A_log, dt_bias, norm weight, pool in, y, pool). KDA: refs = (projections buffer (q, k, v, f_a, g_a,
    beta), the three convs' weights, biases and pools in, f_b and g_b weights, A_log, dt_bias, norm weight, pool
    in, y, the conv pools, pool): each program runs its head's channels of the three convs (``_head_convs``) and
    computes its head's rows of the two low-rank gates (2 x [D, R] weights, from L2 after the first row), which
    were two XLA GEMVs per layer. ``offsets`` are the static columns of the inputs read in place."""
    head, row = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[row]
    fresh = fresh_ref[row] != 0
    heads_v = pl.ds(head * value_dim, value_dim)
    if mixer == "gdn":
        mixed_ref, proj_ref, alog_ref, dtb_ref, nw_ref, _, y_ref, state_ref = refs
        key_head, key_size = head // rep, heads // rep * key_dim
        q = mixed_ref[row, pl.ds(key_head * key_dim, key_dim)]
        k = mixed_ref[row, pl.ds(key_size + key_head * key_dim, key_dim)]
        v = mixed_ref[row, pl.ds(2 * key_size + head * value_dim, value_dim)]
        gate = proj_ref[row, pl.ds(offsets["z"] + head * value_dim, value_dim)]
        b = proj_ref[row, offsets["ba"] + head]
        a = proj_ref[row, offsets["ba"] + heads + head]
        beta = jax.nn.sigmoid(b.astype(F32)).astype(b.dtype).astype(F32)  # the model dtype's sigmoid, as the module
        g = -jnp.exp(alog_ref[head].astype(F32)) * softplus(a.astype(F32) + dtb_ref[head].astype(F32))
        decay = jnp.exp(g)
        state = None
    else:
        proj_ref, conv_refs = refs[0], refs[1:10]
        fb_ref, gb_ref, alog_ref, dtb_ref, nw_ref, _, y_ref = refs[10:17]
        conv_out_refs, state_ref = refs[17:20], refs[20]
        rank = pl.ds(0, fb_ref.shape[1])
        # While the programs fit in one wave, latency rules: every load that does not depend on the convs goes out
        # first, so the state slab and the low-rank gates' operands are in flight while the convs run (behind
        # their barrier they add their latency). Past one wave they go out where they are used: the early
        # slab's and weights' registers cost more than the latency.
        loads = {
            "f_b": lambda: fb_ref[heads_v, rank], "g_b": lambda: gb_ref[heads_v, rank],
            "f_a": lambda: proj_ref[row, pl.ds(offsets["f_a"], rank.size)],
            "g_a": lambda: proj_ref[row, pl.ds(offsets["g_a"], rank.size)],
            "beta": lambda: proj_ref[row, offsets["beta"] + head], "a_log": lambda: alog_ref[head],
            "dt_bias": lambda: dtb_ref[heads_v],
        }
        state = state_ref[slot, head, :, pl.ds(0, value_dim)] if early_loads else None
        early = {name: load() for name, load in loads.items()} if early_loads else {}

        def get(name):
            return early[name] if early_loads else loads[name]()

        q, k, v = _head_convs(proj_ref, conv_refs[0:3], conv_refs[3:6], conv_out_refs, row, slot, fresh, head,
                              value_dim, barrier=barrier)

        def low_rank(name):
            """This head's rows of a low-rank gate's second projection, rounded as ``Linear`` rounds them."""
            x = get(f"{name}_a").astype(F32)
            return jnp.sum(get(f"{name}_b").astype(F32) * x[None, :], axis=1).astype(v.dtype).astype(F32)

        gate = low_rank("g")
        beta = jax.nn.sigmoid(get("beta").astype(F32))
        g = -jnp.exp(get("a_log").astype(F32)) * softplus(low_rank("f") + get("dt_bias").astype(F32))
        decay = jnp.exp(g)[:, None]
    o = step_slab(state_ref, slot, head, pl.ds(0, value_dim), fresh, q.astype(F32), k.astype(F32), v.astype(F32),
                  decay, beta, scale, state=state)
    # ``gated_rms_norm`` of the output rounded to the dtype, as the module rounds it between the two
    o = o.astype(y_ref.dtype).astype(F32)
    normed = o * jax.lax.rsqrt(jnp.sum(o * o) / value_dim + eps)
    gate = gate.astype(F32)
    act = gate * jax.nn.sigmoid(gate) if norm_act == "silu" else jax.nn.sigmoid(gate)
    y_ref[row, head, :] = (nw_ref[...].astype(F32) * normed * act).astype(y_ref.dtype)


def _gated_call(mixer, inputs, A_log, dt_bias, norm_weight, state_pool, slots, fresh, *, rep, key_dim, value_dim,
                offsets, eps, norm_act, dtype, num_warps, interpret, conv_pools=(), early_loads=False):
    """``conv_pools`` (KDA): the conv pools, ``inputs``' third- to fifth-last, updated in place too; their outputs
    come between y and the state pool."""
    heads = A_log.shape[0]
    batch = slots.shape[0]
    kernel = functools.partial(_gated_kernel, mixer=mixer, rep=rep, scale=key_dim**-0.5, key_dim=key_dim,
                               value_dim=value_dim, heads=heads, offsets=offsets, eps=eps, norm_act=norm_act,
                               barrier=not interpret, early_loads=early_loads)
    args = (slots.astype(jnp.int32), fresh.astype(jnp.int32), *inputs, A_log, dt_bias, norm_weight, state_pool)
    first_pool = 2 + len(inputs) - len(conv_pools) - 2  # the conv pools come before f_b and g_b
    aliases = {first_pool + i: 1 + i for i in range(len(conv_pools))}
    return pl.pallas_call(
        kernel,
        name=f"{mixer}_decode_gated",
        grid=(heads, batch),  # a row's heads side by side, as ``launch_grid``'s slabs
        out_shape=(jax.ShapeDtypeStruct((batch, heads, value_dim), dtype),
                   *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in conv_pools),
                   jax.ShapeDtypeStruct(state_pool.shape, F32)),
        input_output_aliases={**aliases, len(args) - 1: 1 + len(conv_pools)},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(*args)


GATED_ACTIVATIONS = ("silu", "sigmoid")


def gated_unsupported(key_dim: int, value_dim: int, norm_act: str) -> str | None:
    """Why the gated kernel cannot take a geometry (None where it can): Triton's power-of-two loads, the whole head
    in one program, the norm activations it has."""
    if not (_is_power_of_two(key_dim) and _is_power_of_two(value_dim)):
        return f"key and value head sizes must be powers of two (got {key_dim}, {value_dim})"
    if value_dim > 128:
        return f"one program holds a head's [K, V] state: V <= 128 (got {value_dim})"
    if norm_act not in GATED_ACTIVATIONS:
        return f"output norm activation {norm_act!r} is not one of {GATED_ACTIVATIONS}"
    return None


@functools.partial(jax.jit, static_argnames=("key_heads", "key_dim", "z_offset", "ba_offset", "eps", "num_warps",
                                              "interpret"), donate_argnames=("state_pool",))
def gdn_decode_gated(mixed, proj, A_log, dt_bias, norm_weight, state_pool, slots, fresh, *, key_heads, key_dim,
                     z_offset, ba_offset, eps, num_warps=4, interpret=False):
    """The kernel of ``apriel2_jax.ops.delta_rule.gdn_decode_gated_slots`` (same signature)."""
    heads, value_dim = A_log.shape[0], norm_weight.shape[0]
    reason = gated_unsupported(key_dim, value_dim, "silu")
    if reason is None and (mixed.ndim != 2 or mixed.shape[1] < 2 * key_heads * key_dim + heads * value_dim):
        reason = f"q|k|v must be the first columns of a [B, *] buffer, got {list(mixed.shape)}"
    if reason is not None:
        raise ValueError(f"gdn_decode_gated: {reason}")
    return _gated_call("gdn", (mixed, proj), A_log, dt_bias, norm_weight, state_pool, slots, fresh,
                       rep=heads // key_heads, key_dim=key_dim, value_dim=value_dim,
                       offsets={"z": z_offset, "ba": ba_offset}, eps=eps, norm_act="silu", dtype=mixed.dtype,
                       num_warps=num_warps, interpret=interpret)


_KDA_STATIC = ("f_a_offset", "g_a_offset", "beta_offset", "eps", "norm_activation")


@functools.partial(jax.jit, static_argnames=_KDA_STATIC + ("num_warps", "early_loads", "interpret"),
                   donate_argnames=("conv_pools", "state_pool"))
def kda_decode_conv_gated(proj, conv_weights, conv_biases, conv_pools, f_b_weight, g_b_weight, A_log, dt_bias,
                          norm_weight, state_pool, slots, fresh, *, f_a_offset, g_a_offset, beta_offset, eps,
                          norm_activation, num_warps=4, early_loads=None, interpret=False):
    """The kernel of ``apriel2_jax.ops.delta_rule.kda_decode_conv_gated_slots`` (same signature): the gated update
    with the three convs on each program's head. ``early_loads``: issue the state slab's and the gates' loads
    before the convs (default: while the (head, row) programs fit in one wave of the GPU, where latency rules;
    past it they cost more than they save: docs/BENCHMARKS.md, "KDA's update issues its loads early")."""
    heads = A_log.shape[0]
    if early_loads is None:
        early_loads = heads * slots.shape[0] <= ONE_WAVE_PROGRAMS
    size = conv_weights[0].shape[0]
    reason = kda_conv_gated_unsupported(proj, conv_weights, conv_pools, f_b_weight.shape[1], heads, norm_activation)
    if reason is not None:
        raise ValueError(f"kda_decode_conv_gated: {reason}")
    biases = tuple(jnp.zeros((size,), F32) if b is None else b for b in conv_biases)
    inputs = (proj, *(w.T for w in conv_weights), *biases, *conv_pools, f_b_weight, g_b_weight)
    y, *pools, state_pool = _gated_call(
        "kda", inputs, A_log, dt_bias, norm_weight, state_pool, slots, fresh, rep=1, key_dim=size // heads,
        value_dim=size // heads, offsets={"f_a": f_a_offset, "g_a": g_a_offset, "beta": beta_offset}, eps=eps,
        norm_act=norm_activation, dtype=proj.dtype, num_warps=num_warps, interpret=interpret, conv_pools=conv_pools,
        early_loads=early_loads)
    return y, tuple(pools), state_pool


def kda_conv_gated_unsupported(proj, conv_weights, conv_pools, rank: int, heads: int, norm_act: str) -> str | None:
    """``kda_gated_unsupported`` plus the convs' shapes: three [H D, Kc] weights with [P, Kc-1, H D] pools, their
    inputs side by side at the start of the projections buffer."""
    size, taps = conv_weights[0].shape
    if any(w.shape != (size, taps) for w in conv_weights) or taps < 2:
        return f"the three conv weights must be [H D, Kc >= 2] alike (got {[list(w.shape) for w in conv_weights]})"
    if any(p.shape[1:] != (taps - 1, size) for p in conv_pools):
        return f"conv pools must be [P, {taps - 1}, {size}] (got {[list(p.shape) for p in conv_pools]})"
    if proj.ndim != 2 or proj.shape[1] < 3 * size or size % heads:
        return f"q, k and v must be the first 3 x {size} columns of a [B, *] buffer (got {list(proj.shape)})"
    return kda_gated_unsupported(size // heads, rank, norm_act)


def kda_gated_unsupported(dim: int, rank: int, norm_act: str) -> str | None:
    """``gated_unsupported`` for KDA, whose low-rank gates' inner width is loaded whole too."""
    if not _is_power_of_two(rank):
        return f"the low-rank gates' width must be a power of two (got {rank})"
    return gated_unsupported(dim, dim, norm_act)


def gdn_decode_gated_slots(mixed, proj, A_log, dt_bias, norm_weight, state_pool, slots, fresh, *, key_heads,
                           key_dim, z_offset, ba_offset, eps):
    """Dispatch entry for "gdn_decode_gated_slots": the kernel where it takes the geometry, else the jnp op."""
    from apriel2_jax.ops import delta_rule as ops

    value_dim = norm_weight.shape[0]
    kwargs = dict(key_heads=key_heads, key_dim=key_dim, z_offset=z_offset, ba_offset=ba_offset, eps=float(eps))
    if gated_unsupported(key_dim, value_dim, "silu") is not None:
        return ops.gdn_decode_gated_slots(mixed, proj, A_log, dt_bias, norm_weight, state_pool, slots, fresh,
                                          **kwargs)
    return gdn_decode_gated(mixed, proj, A_log, dt_bias, norm_weight, state_pool, slots, fresh, **kwargs)


def kda_decode_conv_gated_slots(proj, conv_weights, conv_biases, conv_pools, f_b_weight, g_b_weight, A_log, dt_bias,
                                norm_weight, state_pool, slots, fresh, *, f_a_offset, g_a_offset, beta_offset, eps,
                                norm_activation):
    """Dispatch entry for "kda_decode_conv_gated_slots"."""
    from apriel2_jax.ops import delta_rule as ops

    args = (proj, tuple(conv_weights), tuple(conv_biases), tuple(conv_pools), f_b_weight, g_b_weight, A_log, dt_bias,
            norm_weight, state_pool, slots, fresh)
    kwargs = dict(f_a_offset=f_a_offset, g_a_offset=g_a_offset, beta_offset=beta_offset, eps=float(eps),
                  norm_activation=norm_activation)
    if kda_conv_gated_unsupported(proj, conv_weights, conv_pools, f_b_weight.shape[1], A_log.shape[0],
                                  norm_activation) is not None:
        return ops.kda_decode_conv_gated_slots(*args, **kwargs)
    return kda_decode_conv_gated(*args, **kwargs)
