// The pool's side of the C ABI in pool_abi.h (what PyTorch's CUDA allocator backend may ask of the pool
// installed for a device). Compiled in the same unit as module.cpp, after cuda_allocator.cpp: the
// allocation and release are that entry's (`cuda_alloc`, the install records of pool_allocator.h),
// without exceptions; the rest asks the pool's Python side (`Pool.stats`, `reset_peak_stats`, `trim`)
// with the GIL, never while holding the books' mutex.
//
// This file is the only one that knows both the ABI and the pool's internals: when the books hold
// every figure natively, these functions read them there instead, and the ABI stays as it is.
#include "pool_abi.h"

#include <cstring>

namespace {

// What the ABI keeps per device beside the route: the pool's geometry (fixed once the pool is made)
// and the accumulated counters' baseline (`defrag_pool_reset_accumulated`). Leaked, as the routes.
// The accumulated counters (`defrag_pool_reset_accumulated` zeroes them): each one's key in the pool's
// stats and its field in DefragPoolStats.
struct Accumulated {
  const char* key;
  int64_t DefragPoolStats::*field;
};
constexpr Accumulated kAccumulated[] = {
    {"num_allocs", &DefragPoolStats::num_allocs},
    {"num_frees", &DefragPoolStats::num_frees},
    {"num_alloc_retries", &DefragPoolStats::num_alloc_retries},
    {"num_ooms", &DefragPoolStats::num_ooms},
    {"num_device_alloc", &DefragPoolStats::num_device_alloc},
    {"num_device_free", &DefragPoolStats::num_device_free},
};
constexpr size_t kAccumulatedCount = sizeof(kAccumulated) / sizeof(kAccumulated[0]);

struct AbiDevice {
  std::mutex mu;
  int64_t capacity = -1, device_total = -1;
  int64_t base[kAccumulatedCount] = {};  // each accumulated counter at the last reset, in kAccumulated order
};
AbiDevice* const g_abi_devices = new AbiDevice[kMaxCudaDevices];

void say(char* why, size_t why_len, const char* text) noexcept {
  if (why == nullptr || why_len == 0) return;
  std::snprintf(why, why_len, "%s", text);
}

Installed* installed_for(int32_t device) {
  CudaRoute* route = cuda_route(device);
  return route != nullptr ? route->in.load(std::memory_order_acquire) : nullptr;
}

// Run `ask(pool)` with the GIL held for the pool installed for `device`: its status, or NO_POOL, or
// BUSY when this thread must not call the pool's Python side now (it runs the pool's own code, Python
// exits, a forked child). The thread's pending Python error, if any, is kept; one `ask` leaves is
// cleared. Allocations the pool's code makes meanwhile never ask the pool again (`t_pool_code`).
template <class Ask>
int32_t ask_the_pool(int32_t device, Ask ask) noexcept {
  Installed* in = installed_for(device);
  if (in == nullptr) return DEFRAG_POOL_NO_POOL;
  if (g_forked_child.load() || t_pool_code > 0 || defrag_native::books_held_here > 0 || python_exiting())
    return DEFRAG_POOL_BUSY;
  t_pool_code += 1;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  int32_t status;
  try {
    PyObject* pool = in->fast->books().keeper();
    status = pool != nullptr ? ask(pool) : DEFRAG_POOL_NO_POOL;
  } catch (...) {
    status = DEFRAG_POOL_ERROR;
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyErr_Restore(type, value, traceback);
  PyGILState_Release(gil);
  t_pool_code -= 1;
  return status;
}

// An int of a Python dict (0 when missing or not an int), with the GIL.
int64_t figure(PyObject* dict, const char* key) {
  PyObject* v = PyDict_GetItemString(dict, key);
  if (v == nullptr || !PyLong_Check(v)) return 0;
  long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  return x;
}

// `pool.stats()` (a new reference), or nullptr; with the GIL.
PyObject* pool_stats(PyObject* pool) {
  PyObject* stats = PyObject_CallMethod(pool, "stats", nullptr);
  if (stats != nullptr && !PyDict_Check(stats)) {
    Py_DECREF(stats);
    return nullptr;
  }
  return stats;
}

// The pool's capacity and its device's memory, asked once (with the GIL) and kept.
bool learn_geometry(AbiDevice& d, PyObject* pool) {
  {
    std::lock_guard<std::mutex> guard(d.mu);
    if (d.capacity >= 0) return true;
  }
  PyObject* capacity = PyObject_GetAttrString(pool, "capacity");
  PyObject* driver = PyObject_GetAttrString(pool, "driver");
  PyObject* total = driver != nullptr ? PyObject_GetAttrString(driver, "total_memory") : nullptr;
  long long c = capacity != nullptr ? PyLong_AsLongLong(capacity) : -1;
  long long t = total != nullptr ? PyLong_AsLongLong(total) : -1;
  Py_XDECREF(capacity);
  Py_XDECREF(driver);
  Py_XDECREF(total);
  if (PyErr_Occurred()) PyErr_Clear();
  if (c <= 0 || t <= 0) return false;
  std::lock_guard<std::mutex> guard(d.mu);
  d.capacity = c;
  d.device_total = t;
  return true;
}

// The geometry of `device`'s pool: from what was kept, else asked once.
int32_t geometry(int32_t device, int64_t& capacity, int64_t& total) {
  AbiDevice& d = g_abi_devices[device];
  {
    std::lock_guard<std::mutex> guard(d.mu);
    if (d.capacity >= 0) {
      capacity = d.capacity;
      total = d.device_total;
      return DEFRAG_POOL_OK;
    }
  }
  int32_t status = ask_the_pool(device, [&](PyObject* pool) {
    return learn_geometry(d, pool) ? DEFRAG_POOL_OK : DEFRAG_POOL_ERROR;
  });
  if (status != DEFRAG_POOL_OK) return status;
  std::lock_guard<std::mutex> guard(d.mu);
  capacity = d.capacity;
  total = d.device_total;
  return DEFRAG_POOL_OK;
}

bool valid_device(int32_t device) { return device >= 0 && device < kMaxCudaDevices; }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int32_t defrag_pool_abi_version(void) { return DEFRAG_POOL_ABI_VERSION; }

__attribute__((visibility("default"))) int64_t defrag_pool_stats_size(void) {
  return static_cast<int64_t>(sizeof(DefragPoolStats));
}

__attribute__((visibility("default"))) int32_t defrag_pool_alloc(int32_t device, size_t size, void* stream, void** out,
                                                                 char* why, size_t why_len) {
  if (out == nullptr) {
    say(why, why_len, "defrag_pool_alloc: no place for the address (out is NULL)");
    return DEFRAG_POOL_ERROR;
  }
  *out = nullptr;
  if (installed_for(device) == nullptr) {
    say(why, why_len, ("defrag: PyTorch asked for memory on cuda:" + std::to_string(device) +
                       ", a device no pool was installed for (defrag.install(pool) serves the device of each "
                       "pool installed)").c_str());
    return DEFRAG_POOL_NO_POOL;
  }
  if (size > static_cast<size_t>(kLargestRequest)) {
    say(why, why_len, ("defrag: PyTorch asked for " + std::to_string(size) + " bytes, more than any pool can hold")
                          .c_str());
    return DEFRAG_POOL_OUT_OF_MEMORY;
  }
  try {
    *out = cuda_alloc(static_cast<ssize_t>(size), device, stream);
    return DEFRAG_POOL_OK;
  } catch (const c10::OutOfMemoryError& e) {
    say(why, why_len, e.what_without_backtrace());
    return DEFRAG_POOL_OUT_OF_MEMORY;
  } catch (const c10::Error& e) {
    say(why, why_len, e.what_without_backtrace());
    return DEFRAG_POOL_ERROR;
  } catch (const std::bad_alloc&) {
    say(why, why_len, "defrag: no host memory for the block's record");
    return DEFRAG_POOL_OUT_OF_MEMORY;
  } catch (...) {
    say(why, why_len, "defrag: the pool failed while placing a block for PyTorch");
    return DEFRAG_POOL_ERROR;
  }
}

__attribute__((visibility("default"))) int64_t defrag_pool_free(int32_t device, void* ptr, int32_t* device_out) {
  if (ptr == nullptr || g_forked_child.load(std::memory_order_relaxed)) return -1;
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  // The block at `address` released in the pool of device `d`: its size, or -1 when that pool made none.
  auto release_on = [address](int d) -> int64_t {
    Installed* in = installed_for(d);
    if (in == nullptr) return -1;
    const std::shared_ptr<Books>& books = *in->keep;
    int64_t size = -1;
    Aftermath after;
    {
      std::lock_guard<std::mutex> guard(books->mu);
      Record* r = books->find_locked(static_cast<int64_t>(address), nullptr);
      if (r == nullptr || r->origin != defrag_native::kAllocator || !r->attached || r->released) return -1;
      size = r->size;
      books->release_locked(r, after);
    }
    after_release(books, after);
    g_cuda[d].frees += 1;
    return size;
  };
  // The likely device first, then every other route (a block's device is PyTorch's word).
  const int first = valid_device(device) ? device : -1;
  for (int i = -1; i < kMaxCudaDevices; ++i) {
    const int d = i < 0 ? first : i;
    if (d < 0 || (i >= 0 && d == first)) continue;
    const int64_t size = release_on(d);
    if (size >= 0) {
      if (device_out != nullptr) *device_out = d;
      return size;
    }
  }
  g_cuda_foreign_frees += 1;
  return -1;
}

__attribute__((visibility("default"))) int32_t defrag_pool_stats(int32_t device, DefragPoolStats* out) {
  if (out == nullptr || out->struct_size < static_cast<int64_t>(sizeof(int64_t))) return DEFRAG_POOL_ERROR;
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  int64_t capacity = 0, total = 0;
  int32_t status = geometry(device, capacity, total);
  if (status != DEFRAG_POOL_OK) return status;
  DefragPoolStats s;
  std::memset(&s, 0, sizeof s);
  AbiDevice& d = g_abi_devices[device];
  status = ask_the_pool(device, [&](PyObject* pool) {
    PyObject* st = pool_stats(pool);
    if (st == nullptr) return DEFRAG_POOL_ERROR;
    s.allocated_bytes = figure(st, "allocated_bytes.all.current");
    s.allocated_bytes_peak = figure(st, "allocated_bytes.all.peak");
    s.active_bytes = figure(st, "active_bytes.all.current");
    s.active_bytes_peak = figure(st, "active_bytes.all.peak");
    s.reserved_bytes = figure(st, "reserved_bytes.all.current");
    s.reserved_bytes_peak = figure(st, "reserved_bytes.all.peak");
    s.requested_bytes = figure(st, "requested_bytes.all.current");
    s.inactive_split_bytes = figure(st, "stranded_bytes");
    s.live_blocks = figure(st, "live_blocks");
    s.num_allocs = figure(st, "num_allocs");
    s.num_frees = figure(st, "num_frees");
    s.num_alloc_retries = figure(st, "num_alloc_retries");
    s.num_ooms = figure(st, "num_ooms");
    s.num_device_alloc = figure(st, "num_device_alloc");
    s.num_device_free = figure(st, "num_device_free");
    s.mapped_pages = figure(st, "pages.mapped");
    s.page_size = figure(st, "page_size");
    s.largest_mapped_free = figure(st, "largest_mapped_free_bytes");
    Py_DECREF(st);
    return DEFRAG_POOL_OK;
  });
  if (status != DEFRAG_POOL_OK) return status;
  {
    std::lock_guard<std::mutex> guard(d.mu);
    for (size_t i = 0; i < kAccumulatedCount; ++i) s.*kAccumulated[i].field -= d.base[i];
  }
  s.capacity_bytes = capacity;
  s.device_total_bytes = total;
  const int64_t wanted = out->struct_size;
  s.struct_size = std::min<int64_t>(wanted, sizeof s);
  std::memcpy(out, &s, static_cast<size_t>(s.struct_size));
  return DEFRAG_POOL_OK;
}

__attribute__((visibility("default"))) int32_t defrag_pool_reset_peaks(int32_t device) {
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  return ask_the_pool(device, [](PyObject* pool) {
    PyObject* done = PyObject_CallMethod(pool, "reset_peak_stats", nullptr);
    Py_XDECREF(done);
    return done != nullptr ? DEFRAG_POOL_OK : DEFRAG_POOL_ERROR;
  });
}

__attribute__((visibility("default"))) int32_t defrag_pool_reset_accumulated(int32_t device) {
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  AbiDevice& d = g_abi_devices[device];
  return ask_the_pool(device, [&](PyObject* pool) {
    PyObject* st = pool_stats(pool);
    if (st == nullptr) return DEFRAG_POOL_ERROR;
    std::lock_guard<std::mutex> guard(d.mu);
    for (size_t i = 0; i < kAccumulatedCount; ++i) d.base[i] = figure(st, kAccumulated[i].key);
    Py_DECREF(st);
    return DEFRAG_POOL_OK;
  });
}

__attribute__((visibility("default"))) int32_t defrag_pool_largest_block(int32_t device, int64_t* out) {
  if (out == nullptr) return DEFRAG_POOL_ERROR;
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  return ask_the_pool(device, [&](PyObject* pool) {
    PyObject* st = pool_stats(pool);
    if (st == nullptr) return DEFRAG_POOL_ERROR;
    *out = figure(st, "largest_mapped_free_bytes");
    Py_DECREF(st);
    return DEFRAG_POOL_OK;
  });
}

__attribute__((visibility("default"))) int32_t defrag_pool_empty_cache(int32_t device, int64_t* released) {
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  return ask_the_pool(device, [&](PyObject* pool) {
    // No meshing here: an empty cache only gives back what holds nothing (no byte of a live block is
    // copied while PyTorch's kernels may use it).
    PyObject* trim = PyObject_GetAttrString(pool, "trim");
    PyObject* args = PyTuple_New(0);
    PyObject* kwargs = Py_BuildValue("{s:O}", "mesh", Py_False);
    PyObject* done = trim != nullptr && args != nullptr && kwargs != nullptr ? PyObject_Call(trim, args, kwargs)
                                                                            : nullptr;
    Py_XDECREF(trim);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    if (done == nullptr) return DEFRAG_POOL_ERROR;
    const long long bytes = PyLong_Check(done) ? PyLong_AsLongLong(done) : 0;
    Py_DECREF(done);
    if (released != nullptr) *released = bytes;
    // A budget set below what the pool held (`defrag_pool_set_budget`) is reached as pages empty.
    if (PyObject_HasAttrString(pool, "_budget_pages")) {
      PyObject* module = PyImport_ImportModule("defrag.cuda_backend");
      PyObject* applied = module != nullptr ? PyObject_CallMethod(module, "apply_pool_budget", "O", pool) : nullptr;
      Py_XDECREF(module);
      Py_XDECREF(applied);
      if (applied != nullptr) {
        int64_t capacity = -1;
        PyObject* c = PyObject_GetAttrString(pool, "capacity");
        if (c != nullptr) capacity = PyLong_AsLongLong(c);
        Py_XDECREF(c);
        if (capacity > 0) {
          AbiDevice& d = g_abi_devices[device];
          std::lock_guard<std::mutex> guard(d.mu);
          d.capacity = capacity;
        }
      }
      if (PyErr_Occurred()) PyErr_Clear();
    }
    return DEFRAG_POOL_OK;
  });
}

// What both fraction entries check first: a pool on `device`, a fraction in (0, 1] (else `why` says so),
// and the pool's capacity and the device's total memory.
static int32_t fraction_geometry(int32_t device, double fraction, char* why, size_t why_len, int64_t& capacity,
                          int64_t& total) {
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    say(why, why_len, ("defrag: a memory fraction must be in (0, 1], got " + std::to_string(fraction)).c_str());
    return DEFRAG_POOL_ERROR;
  }
  return geometry(device, capacity, total);
}

__attribute__((visibility("default"))) int32_t defrag_pool_memory_fraction(int32_t device, double* out) {
  if (out == nullptr) return DEFRAG_POOL_ERROR;
  if (!valid_device(device)) return DEFRAG_POOL_NO_POOL;
  int64_t capacity = 0, total = 0;
  int32_t status = geometry(device, capacity, total);
  if (status == DEFRAG_POOL_OK) *out = static_cast<double>(capacity) / static_cast<double>(total);
  return status;
}

__attribute__((visibility("default"))) int32_t defrag_pool_set_memory_fraction(int32_t device, double fraction,
                                                                               char* why, size_t why_len) {
  int64_t capacity = 0, total = 0;
  int32_t status = fraction_geometry(device, fraction, why, why_len, capacity, total);
  if (status != DEFRAG_POOL_OK) return status;
  const double allowed = fraction * static_cast<double>(total);
  if (allowed + 0.5 >= static_cast<double>(capacity)) return DEFRAG_POOL_OK;  // the capacity stays the limit
  say(why, why_len,
      ("defrag: the pool serving cuda:" + std::to_string(device) + " has a capacity of " + std::to_string(capacity) +
       " bytes (a fraction " + std::to_string(static_cast<double>(capacity) / static_cast<double>(total)) +
       " of the device), fixed when it was made; it cannot shrink to a fraction " + std::to_string(fraction) +
       " (" + std::to_string(static_cast<long long>(allowed)) + " bytes) while the program runs. Give the "
       "capacity you want up front: `defrag run --capacity " + std::to_string(static_cast<long long>(allowed)) +
       " ...` or defrag.Pool(capacity=...)")
          .c_str());
  return DEFRAG_POOL_ERROR;
}

__attribute__((visibility("default"))) int32_t defrag_pool_set_budget(int32_t device, double fraction, char* why,
                                                                      size_t why_len) {
  int64_t capacity = 0, total = 0;
  int32_t status = fraction_geometry(device, fraction, why, why_len, capacity, total);
  if (status != DEFRAG_POOL_OK) return status;
  const auto wanted = static_cast<long long>(fraction * static_cast<double>(total));
  std::string failure;
  long long now = -1;
  status = ask_the_pool(device, [&](PyObject* pool) {
    // The pool's capacity lives in its Python side (core, page store): defrag.cuda_backend sets it.
    PyObject* module = PyImport_ImportModule("defrag.cuda_backend");
    PyObject* done = module != nullptr ? PyObject_CallMethod(module, "set_pool_budget", "OL", pool, wanted) : nullptr;
    Py_XDECREF(module);
    if (done == nullptr) {
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      PyObject* text = value != nullptr ? PyObject_Str(value) : nullptr;
      const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
      failure = utf8 != nullptr ? utf8 : "defrag: the pool's budget could not be set";
      Py_XDECREF(text);
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      return DEFRAG_POOL_ERROR;
    }
    now = PyLong_Check(done) ? PyLong_AsLongLong(done) : -1;
    Py_DECREF(done);
    return now > 0 ? DEFRAG_POOL_OK : DEFRAG_POOL_ERROR;
  });
  if (status == DEFRAG_POOL_ERROR) say(why, why_len, failure.empty() ? "defrag: the pool's budget could not be set" : failure.c_str());
  if (status != DEFRAG_POOL_OK) return status;
  AbiDevice& d = g_abi_devices[device];
  std::lock_guard<std::mutex> guard(d.mu);
  d.capacity = now;
  return DEFRAG_POOL_OK;
}

__attribute__((visibility("default"))) int32_t defrag_pool_capture(int32_t device, void* stream, int32_t begin) {
  if (!valid_device(device)) return DEFRAG_POOL_ERROR;
  try {
    if (begin)
      defrag_native::captures().begin(reinterpret_cast<uintptr_t>(stream));
    else
      defrag_native::captures().end(reinterpret_cast<uintptr_t>(stream));
  } catch (...) {
    return DEFRAG_POOL_ERROR;
  }
  return DEFRAG_POOL_OK;
}

__attribute__((visibility("default"))) int32_t defrag_pool_capture_counts(int32_t device, int64_t* violations,
                                                                          int64_t* unordered) {
  Installed* in = valid_device(device) ? installed_for(device) : nullptr;
  if (unordered != nullptr) *unordered = defrag_native::captures().unordered_count();
  if (violations != nullptr) {
    defrag_native::FakeEventOps* fake = in != nullptr ? in->fast->books().fake_streams() : nullptr;
    *violations = fake != nullptr ? fake->capture_violations() : -1;
  }
  return in != nullptr ? DEFRAG_POOL_OK : DEFRAG_POOL_NO_POOL;
}

__attribute__((visibility("default"))) int32_t defrag_pool_record_stream(int32_t device, void* ptr, void* stream) {
  Installed* in = valid_device(device) ? installed_for(device) : nullptr;
  if (in == nullptr || ptr == nullptr) return DEFRAG_POOL_NO_POOL;
  const bool found = in->fast->books().record_stream_at(static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)),
                                                       reinterpret_cast<uintptr_t>(stream), defrag_native::kAllocator);
  return found ? DEFRAG_POOL_OK : DEFRAG_POOL_NO_POOL;
}

}  // extern "C"
