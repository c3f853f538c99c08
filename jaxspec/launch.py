"""Multi-host launch: join a ``jax.distributed`` job, then run the ``jaxspec`` command.

Run the SAME command on every host of a slice (every process then sees all the slice's
chips in ``jax.devices()``, builds the same mesh and runs the same program; only process 0
prints)::

    # Cloud TPU VM slice (v5e-8 is one host; v5p-16 and larger are several):
    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command \\
      "python -m jaxspec.launch generate 'Hello' --model gs://bucket/llama3-70b-orbax --mesh 1x16"

    # anywhere else, one line per process (here two CPU processes of 4 devices each):
    python -m jaxspec.launch --coordinator localhost:12355 --num-processes 2 --process-id 0 \\
      --cpu-devices 4 generate ...

On Cloud TPU, ``jax.distributed.initialize()`` finds the coordinator, the process count and
this process's id from the TPU metadata, so no flags are needed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               cpu_devices: int | None = None) -> None:
    """Join the distributed job (``jax.distributed.initialize``); call before any other JAX use.

    Args:
      coordinator: ``host:port`` of process 0; None: auto-detected (Cloud TPU, SLURM, ...).
      num_processes, process_id: this job's size and this process's rank (0-based).
      cpu_devices: on the CPU backend, devices per process (``jax_num_cpu_devices``); the
        CPU collectives then go through gloo, the implementation that works across processes.

    Raises:
      ValueError: only some of coordinator / num_processes / process_id given, or a
        process_id outside ``[0, num_processes)``.
    """
    import jax

    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError("give all of coordinator, num_processes and process_id, or none (auto-detect)")
    if all(given) and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}")
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def main(argv=None) -> int:
    """``python -m jaxspec.launch [launch options] generate ...``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m jaxspec.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", help="host:port of process 0 (default: auto-detect, e.g. Cloud TPU)")
    parser.add_argument("--num-processes", type=int, help="processes in the job")
    parser.add_argument("--process-id", type=int, help="this process's rank, 0-based")
    parser.add_argument("--cpu-devices", type=int, help="CPU backend only: devices per process")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the jaxspec command, e.g. generate PROMPT --mesh 2x4")
    args = parser.parse_args(argv)
    try:
        initialize(args.coordinator, args.num_processes, args.process_id, args.cpu_devices)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    import jax

    from jaxspec import cli

    if jax.process_index() == 0:
        return cli.main(args.command)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return cli.main(args.command)


if __name__ == "__main__":
    sys.exit(main())
