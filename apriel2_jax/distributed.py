"""Several processes (hosts) as one JAX system, for a tensor-parallel mesh that spans them.

Every process runs the same command on the same requests: ``initialize`` joins them before anything touches a
device, after which ``jax.devices()`` lists every process's devices and ``LLM(..., tensor_parallel=N)`` builds a
mesh across them. Each process reads only its own devices' rows of the checkpoint, builds the same step inputs
and gets the same (replicated) outputs; ``is_primary`` says which one writes the results.
"""

from __future__ import annotations


class DistributedError(ValueError):
    """Bad or incomplete multi-process settings; the message names the flag or argument to fix."""


_SETTINGS = ("coordinator_address", "num_processes", "process_id")


def _spelled(names: dict[str, str] | None) -> dict[str, str]:
    """How the caller spells each setting in messages (command-line flags), else its own name."""
    return {setting: (names or {}).get(setting, setting) for setting in _SETTINGS}


def check_settings(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
                   names: dict[str, str] | None = None) -> None:
    """Raise ``DistributedError`` unless the three settings are all given and consistent, or all absent (a
    cluster manager, SLURM or Open MPI, supplies them). ``names`` says how the caller spells each setting
    (command-line flags)."""
    name = _spelled(names)
    values = dict(zip(_SETTINGS, (coordinator_address, num_processes, process_id)))
    missing = [name[setting] for setting, value in values.items() if value is None]
    every = f"{name['coordinator_address']}, {name['num_processes']} and {name['process_id']}"
    if missing and len(missing) < len(_SETTINGS):
        raise DistributedError(f"several processes need all of {every}; missing {', '.join(missing)}")
    if not missing:
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DistributedError(f"{name['coordinator_address']} must be HOST:PORT (process 0's host and a free "
                                   f"port), got {coordinator_address!r}")
        if num_processes < 1:
            raise DistributedError(f"{name['num_processes']} must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"{name['process_id']} must be in [0, {num_processes}) for "
                                   f"{name['num_processes']} {num_processes}, got {process_id}")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, names: dict[str, str] | None = None) -> None:
    """Join this process to the others (``jax.distributed.initialize``). Call it before anything touches a
    device. Without arguments, SLURM's or Open MPI's environment supplies them (JAX then gives each task one
    GPU: start one task per GPU). CPU devices exchange their collectives through gloo, so the same command also
    runs as several processes on one machine (tests)."""
    check_settings(coordinator_address, num_processes, process_id, names)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    except (RuntimeError, ValueError) as err:  # no coordinator found, unreachable, port taken, devices in use
        name = _spelled(names)
        where = (f"process {process_id} of {num_processes} at coordinator {coordinator_address}"
                 if coordinator_address is not None else "from the cluster manager's environment")
        raise DistributedError(
            f"could not join the other processes ({where}): {str(err).rstrip('.')}. Every process must run the "
            f"same command, with the same files, before anything else touches a device; without SLURM or Open MPI "
            f"give {name['coordinator_address']}, {name['num_processes']} and {name['process_id']}") from None


def agree_on_minimum(value: int, unit: int = 2**20) -> int:
    """The smallest of every process's ``value`` (rounded down to ``unit``), the same on every process; ``value``
    itself when the process runs alone. Settings derived from each host's own state (free device memory) must
    agree, or the processes would build differently shaped arrays of one mesh."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    # int32 units: JAX without x64 would truncate byte counts past 2 GiB.
    units = multihost_utils.process_allgather(np.asarray(value // unit, np.int32))
    return int(np.min(units)) * unit


def is_primary() -> bool:
    """Whether this process writes results (process 0; the only process when none were joined)."""
    import jax

    return jax.process_index() == 0
