"""Native kernels that XLA runs as FFI custom calls. ``cpu_matmul``: the small-T weight
products of a CPU forward pass (``docs/cpu_kernel.md``); ``jaxspec.models.linear`` decides
when to use it."""
