"""The CUDA emulator: the project's ``cuda_src/*.cu`` kernels, unchanged, compiled
by g++ and run on the CPU, with the GPU's launch rules, stream ordering and
memory checks. See README.md beside this file.

Modules:

* ``backend``: ``EmulatedBackend`` (``backends.get("emulated")``), its streams,
  events, graphs and hazard checks;
* ``device_array``: ``DeviceArray``, its device arrays (CuPy's semantics);
* ``build``: g++ modules from kernel sources (cached on disk), against ``cuda/cuda_emu.h``;
* ``guarded_memory``: device memory flush against guard pages, fiber stacks;
* ``counting``: the counting build (memory sectors, shared-memory wavefronts, MMAs);
* ``pdl_order``: the programmatic-dependent-launch ordering check;
* ``differential_backend``: every launch re-run on a reference backend and compared.
"""
