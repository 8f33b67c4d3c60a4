"""A tiny C++ extension that exchanges two storages' memory, for torch without `_swap_data_ptr_`.

torch >= 2.12 has `UntypedStorage._swap_data_ptr_`. Older torch (2.11 on the
GPU machines, every user on torch < 2.12) has no Python way to give a storage
other memory while its views follow; `resize_` does replace the DataPtr in
place, but only with memory from the storage's own allocator, which Python
cannot set. So this module compiles, on first need and once per torch build,
one C++ function that does the exchange on the `c10::StorageImpl`s directly.

Built with `torch.utils.cpp_extension.load` from a source that includes only
`c10/core/StorageImpl.h` and pybind11 (about 10 s on a 2-core machine; the
`load_inline` route includes all of `torch/extension.h` and takes about 3x
longer). CPU-only sources: no CUDA compiler is needed, and the same function
moves CUDA storages (a DataPtr is device-agnostic). The build goes to
`$DEFRAG_EXT_DIR`, else `$XDG_CACHE_HOME/defrag` or `~/.cache/defrag`, in a
folder per Python and torch version; later processes only re-link-check it.

The build machinery is `defrag.extensions`. This module only builds and
calls; `defrag.tensors.swap_mode()` decides whether it is used.
"""

from __future__ import annotations

import torch

from .extensions import CppExtension, missing_tools

_NAME = "defrag_storage_swap"

_SOURCE = r"""
// Exchange the memory of two c10::StorageImpls: what UntypedStorage._swap_data_ptr_
// does on torch >= 2.12, written against the StorageImpl API of torch 2.1+.
//
// Guarantees: on return, each storage holds the other's DataPtr (pointer, deleter
// and deleter context, device), allocator and resizable flag, so every tensor and
// view over either storage sees the other's memory, and each old memory is freed
// by its own deleter when the storage now holding it dies. Sizes are not touched.
// Either everything is exchanged or, if a check throws, nothing is.
//
// The caller must ensure: both storages are alive, on the same device, with the
// same nbytes; no other thread uses either storage's memory or fields meanwhile.
#include <pybind11/pybind11.h>
#include <c10/core/StorageImpl.h>
#include <cstdint>

static void swap_memory(std::uintptr_t a_cdata, std::uintptr_t b_cdata) {
  auto* a = reinterpret_cast<c10::StorageImpl*>(a_cdata);
  auto* b = reinterpret_cast<c10::StorageImpl*>(b_cdata);
  if (a == b) {
    return;
  }
  // Checks first: these may throw (copy-on-write materialization, storages that
  // forbid data access); nothing has changed yet if they do.
  TORCH_CHECK(a->device() == b->device(), "swap_memory: storages on different devices");
  TORCH_CHECK(!a->resizable() || a->allocator(), "swap_memory: resizable storage without allocator");
  TORCH_CHECK(!b->resizable() || b->allocator(), "swap_memory: resizable storage without allocator");
  c10::DataPtr& a_ptr = a->mutable_data_ptr();
  c10::DataPtr& b_ptr = b->mutable_data_ptr();
  // From here on nothing throws.
  c10::DataPtr held = std::move(a_ptr);
  a->set_data_ptr_noswap(std::move(b_ptr));
  b->set_data_ptr_noswap(std::move(held));
  c10::Allocator* a_allocator = a->allocator();
  bool a_resizable = a->resizable();
  a->set_allocator(b->allocator());
  b->set_allocator(a_allocator);
  a->set_resizable(b->resizable());
  b->set_resizable(a_resizable);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swap_memory", &swap_memory,
        "Exchange the memory of two StorageImpls (UntypedStorage._cdata ints).");
}
"""

_EXTENSION = CppExtension(_NAME, "storage_swap", _SOURCE, "the storage-swap extension", "about 10-30 s")
build_directory = _EXTENSION.build_directory
load = _EXTENSION.load
failure = _EXTENSION.failure
build_seconds = _EXTENSION.build_seconds
_missing_tools = missing_tools
_reset_for_tests = _EXTENSION.reset_for_tests


def swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of `a` and `b` (same device and nbytes, checked by the caller)."""
    module = load()
    if module is None:
        raise RuntimeError(f"the storage-swap extension is unavailable: {failure()}")
    module.swap_memory(a._cdata, b._cdata)
