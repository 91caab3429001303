"""Two environment fixes for running SGLang 0.5.23 on a CPU-only machine (rollout-gateway test
bed; see docs/gateway.md "Real SGLang in the test bed").

This directory goes on ``PYTHONPATH`` of the launched ``python -m sglang.launch_server``; Python
imports this module at start-up in the server and in every process it spawns (the scheduler and
the detokenizer are started with multiprocessing "spawn" and inherit the environment). Nothing
in SGLang's or torchvision's files is edited: a meta-path finder wraps the loader of two modules
and adjusts them right when they are imported.

1. ``torchvision._meta_registrations``: PyPI's torchvision 0.28.0 is built against CUDA torch;
   beside the CPU torch its C ops do not load, and the module's unguarded
   ``torch.library.register_fake("torchvision::nms")`` then raises "operator torchvision::nms
   does not exist", so ``import torchvision`` fails (``sglang.srt.configs`` imports it
   unconditionally). While that module runs and ``torchvision.extension._has_ops()`` is False,
   ``register_fake`` for ``torchvision::*`` ops returns the function unregistered: the fake
   (meta) kernels of ops that do not exist are skipped, nothing else changes. With working ops
   the module runs untouched.
2. ``sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS`` has no ``"cpu"`` entry: its
   default pins host memory with cudaHostRegister, so ``--enable-return-routed-experts`` (which
   allocates its host buffer through it, keyed by the model's device) crashes at start-up on
   the CPU with "Torch not compiled with CUDA enabled" (an SGLang bug on CPU). A ``"cpu"``
   entry that allocates the same buffer without registering it (there is no device to pin
   for) is added; every other device keeps SGLang's own function.

The stand-in ``sgl_kernel`` package beside this file is the third piece.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_APPLIED: list[str] = []  # which fixes ran in this process (read by tests through the log)


def _torchvision_meta_registrations(exec_module, module) -> None:
    import torch.library
    import torchvision.extension

    if torchvision.extension._has_ops():
        exec_module(module)
        return
    original = torch.library.register_fake

    def register_fake(op, func=None, /, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            return (lambda fn: fn) if func is None else func
        return original(op, func, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        exec_module(module)
    finally:
        torch.library.register_fake = original
    _APPLIED.append("torchvision-meta-registrations-skipped")


def _alloc_plain_cpu(dims, dtype, device, pin_memory, allocator,
                     registration_granularity_bytes=None):
    """``alloc_with_host_register`` without the cudaHostRegister: on the CPU the buffer is the
    memory itself, there is nothing to pin it for."""
    import torch

    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def _pool_host_common(exec_module, module) -> None:
    exec_module(module)
    funcs = module.ALLOC_MEMORY_FUNCS
    if "cpu" not in funcs:  # never replace an entry SGLang has itself
        funcs["cpu"] = _alloc_plain_cpu
        _APPLIED.append("pool-host-cpu-alloc")


_PATCHES = {
    "torchvision._meta_registrations": _torchvision_meta_registrations,
    "sglang.srt.mem_cache.pool_host.common": _pool_host_common,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._patch(self._loader.exec_module, module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, name)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


if os.environ.get("ROLLOUT_GATEWAY_SGLANG_CPU_FIXES", "1") != "0":
    sys.meta_path.insert(0, _PatchingFinder())
