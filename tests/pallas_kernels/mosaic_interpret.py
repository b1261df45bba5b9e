"""Mosaic GPU kernels on the CPU: jax 0.11.2's GPU interpret mode simulates a kernel's CTAs, shared memory, TMA
copies, barriers and wgmma in Python, and can record data races between them. Tests use it to check a kernel's
own numerics (indices, ring refills, roundings) where no GPU is present, and on the CPU where one is: the
interpreter runs the kernel's wgmma as XLA dots on the default device, and on an H200 the gate/up kernel's check
then put 40% of its outputs a bf16 step off the CPU oracle (a GPU may compute float32 dots at tf32)."""

from __future__ import annotations

import contextlib

import jax

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # race state: not exported by jax
from jax.experimental.pallas import mosaic_gpu as plgpu


@contextlib.contextmanager
def gpu_interpret():
    """Run every Mosaic GPU kernel called inside in interpret mode with race detection, and every computation
    inside on the CPU (compute the oracle inside too); yields a function that says whether a race was found so
    far."""
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        yield lambda: bool(interpret_pallas_call.get_races().races_found)
