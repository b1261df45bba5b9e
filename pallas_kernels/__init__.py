"""Pallas GPU kernels. Each implements the signature of an ``apriel2_jax.ops`` function and is registered with
the dispatch point for the GPU backend; ``apriel2_jax.dispatch`` imports this package on first use off CPU."""

from apriel2_jax import dispatch

from . import (
    causal_conv1d,
    decode_gated_product,
    decode_matmul_add,
    decode_projections,
    decode_gemv,
    delta_rule_decode,
    delta_rule_prefill,
    paged_attention_decode,
    paged_attention_prefill,
    selective_scan,
    sequence_forms,
)


def paged_attention(q, k_pages, v_pages, block_table, first_page, q_positions, window=None):
    """One entry for the attention op: the decode kernel for one-token rows, the prefill kernel otherwise (each
    falls back to the jnp op for shapes it cannot take)."""
    module = paged_attention_decode if q.shape[1] == 1 else paged_attention_prefill
    return module.paged_attention(q, k_pages, v_pages, block_table, first_page, q_positions, window)


def register_all() -> None:
    dispatch.register("delta_rule_decode_slots", "gpu", delta_rule_decode.decode_slots)
    dispatch.register("delta_rule_decode_slots_packed", "gpu", delta_rule_decode.decode_slots_packed)
    # The update with its gates and output norm: each would be an XLA fusion of its own per layer.
    dispatch.register("gdn_decode_gated_slots", "gpu", delta_rule_decode.gdn_decode_gated_slots)
    # KDA's with its three convs: each (head, row) program owns its head's conv channels (GDN's key heads are
    # shared by several value heads, whose programs would race on their q/k conv state).
    dispatch.register("kda_decode_conv_gated_slots", "gpu", delta_rule_decode.kda_decode_conv_gated_slots)
    # The fused decode kernels (conv + gates + update in one kernel, ``delta_rule_decode_fused``) are not
    # registered: in device time at B=256 H=32 K=V=128 on an H100 the unfused chain of dispatched kernels is
    # faster (GDN 409 vs 452 us, KDA 424 vs 523 us; an earlier run 479 vs 480 and 459 vs 556), since the update
    # kernel launches a head's slabs together (docs/BENCHMARKS.md, session 4). Without a registration the modules
    # take that chain.
    dispatch.register("delta_rule_varlen_slots", "gpu", delta_rule_prefill.prefill_slots)
    dispatch.register("selective_scan_varlen_slots", "gpu", selective_scan.varlen_slots)
    dispatch.register("selective_scan_decode_slots", "gpu", selective_scan.decode_slots)
    dispatch.register("causal_conv1d_varlen_slots", "gpu", causal_conv1d.varlen_slots)
    dispatch.register("causal_conv1d_decode_slots", "gpu", causal_conv1d.decode_slots)
    dispatch.register("paged_attention", "gpu", paged_attention)
    dispatch.register("rope_write_paged_attention", "gpu", paged_attention_decode.rope_write_paged_attention)
    # Decode projections of a few rows as GEMVs fused with the norm before them and the activation product or
    # residual add after them (``decode_gemv``); each entry runs the jnp chain beyond its limits by rows and weight
    # bytes (``decode_gemv.KERNEL_MAX_WEIGHT_BYTES``), where XLA streams the weights faster.
    # From eight rows the input norm's projections (attention's Q/K/V) run as a Mosaic GPU kernel streaming the
    # weights by TMA (``decode_projections``); one or two rows keep the GEMV kernel.
    dispatch.register("norm_projections", "gpu", decode_projections.norm_projections)
    # GDN's conv on its q|k|v tiles of the projections kernel (a depthwise conv's channel needs only its feature)
    dispatch.register("norm_projections_conv", "gpu", decode_gemv.norm_projections_conv)
    # From eight rows the gate/up pair and its product run as a Mosaic GPU kernel streaming the weights by TMA
    # (``decode_gated_product``); one row keeps the GEMV kernel, and two to seven rows XLA's GEMV fusions.
    dispatch.register("norm_gated_mlp", "gpu", decode_gated_product.norm_gated_mlp)
    # From eight rows the MLP's down projection with the residual add runs as a Mosaic GPU kernel whose clusters
    # split the input width and sum the partials in a fixed order through distributed shared memory
    # (``decode_matmul_add``); the output projection stays XLA's there, and one or two rows keep the GEMV kernel.
    dispatch.register("matmul_add", "gpu", decode_matmul_add.matmul_add)
    # The whole MLP as one persistent kernel (``decode_mlp``) is not registered. Side by side in the engine (0.5B,
    # H200, 2026-11-27, two processes each) it takes ~2% off the B=8 and B=32 steps (all-attention B=32 1.117-1.125
    # ms against 1.142-1.146, a12-g1-k11 1.282-1.289 against 1.313-1.322). But its float32 reduce-add stores land
    # in no fixed order, so decode outputs would vary by a rounding between runs. ``bench_generate.py
    # --decode-mlp-kernel`` registers it.
    # The plain sequence / one-token forms (non-engine paths) run on the same kernels.
    for name, fn in (
        ("gated_delta_rule", sequence_forms.gated_delta_rule),
        ("kda_delta_rule", sequence_forms.kda_delta_rule),
        ("gated_delta_rule_step", sequence_forms.gated_delta_rule_step),
        ("kda_delta_rule_step", sequence_forms.kda_delta_rule_step),
        ("selective_scan", sequence_forms.selective_scan_seq),
        ("selective_scan_step", sequence_forms.selective_scan_step),
        ("causal_conv1d", sequence_forms.causal_conv1d_seq),
        ("causal_conv1d_step", sequence_forms.causal_conv1d_step),
    ):
        dispatch.register(name, "gpu", fn)


register_all()
