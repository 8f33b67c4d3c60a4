// PyTorch's pluggable CUDA allocator over pools' books (`defrag.install(pool)` of a CUDA pool): the C
// entry points `defrag_cuda_alloc` and `defrag_cuda_free`, which
// `torch.cuda.memory.CUDAPluggableAllocator(<this library>, "defrag_cuda_alloc", "defrag_cuda_free")`
// finds with dlsym (dlopen of this already-loaded library returns its handle). Compiled in the same
// unit as module.cpp, after `pool_allocator.h` (the placement ladder, install records and release it
// shares with PyTorch's CPU allocator, `cpu_allocator.cpp`). The module is built without CUDA headers:
// cudaStream_t is `void*` here (the same pointer-sized argument in the C ABI).
//
// alloc (PyTorch's every CUDA tensor, any thread): a block of the pool installed for `device`, placed
// natively with no GIL and no Python; the GIL only when pages must be mapped (`place_from_pool`), and
// then the pool's ladder stops before compacting (PyTorch may allocate in the middle of an op whose
// kernel has read its inputs' addresses already: moving them there is unsafe, as for `capture`). A
// request the pool cannot serve throws c10::OutOfMemoryError with the pool's explained OOM: PyTorch's
// malloc lets it through, and the op raises torch.OutOfMemoryError (nothing was placed or counted:
// the program may catch it and go on). There is no other allocator to fall back to (PyTorch's
// caching allocator was replaced, process-wide), so what the CPU allocator declines to its previous
// allocator throws here too: c10::OutOfMemoryError when the pool cannot serve it now (closed, asleep,
// asked by the pool's own code while it makes room; a parallel region's worker
// that cannot place natively; the interpreter exiting), c10::Error for a device no pool was
// installed for, a negative size, a forked child. Size 0 is NULL (what PyTorch expects), no error.
//
// free (any thread, any time, at exit after Python is gone): noexcept; the block found by address
// (`release_installed`), given back to the books, or queued for Python as any fast-path release is.
// A pointer no install handed out is counted (`foreign_frees`), noted (`last_error`, and one stderr
// line for the first few) and ignored: never a crash. A forked child forgets every free.
//
// Lifetime: one install per device index, for the life of the process (PyTorch cannot swap its CUDA
// allocator back): the route, its install record, books and FastPath are never destroyed, and the
// install's lease keeps its pool alive. The routes are leaked on purpose (frees may come after
// static destructors ran).
//
// Streams: each block is placed for the stream PyTorch names, and the books order its reuse across
// streams (streams.h: a range freed by one stream is placed for another only after a fence on the
// device). Allocations for another stream than the default are counted (`other_stream_allocs`).
#include <sys/types.h>

#include <cstdio>

namespace {

constexpr int kMaxCudaDevices = 64;
constexpr int kForeignFreesReported = 8;  // stderr lines; every one is counted

// One device's route: the pool installed for it, and what its entry did.
struct CudaRoute {
  std::atomic<Installed*> in{nullptr};  // set once (with the GIL), never cleared
  EntryCounters counters;               // asked, declined, ooms
  std::atomic<int64_t> allocs{0}, frees{0}, failures{0}, other_stream_allocs{0};
};

CudaRoute* const g_cuda = new CudaRoute[kMaxCudaDevices];  // leaked: frees may come at exit
std::atomic<int64_t> g_cuda_foreign_frees{0};               // process-wide (a foreign pointer's device is PyTorch's word)
std::mutex* const g_cuda_note_mu = new std::mutex();         // leaked, as the routes
char g_cuda_note[512] = "";                                  // the last failure or foreign free, in words

CudaRoute* cuda_route(int device) {
  return device >= 0 && device < kMaxCudaDevices ? &g_cuda[device] : nullptr;
}

// The last failure or foreign free, in words (a C string: a release notes it without allocating).
void note(const char* text) noexcept {
  std::lock_guard<std::mutex> guard(*g_cuda_note_mu);
  std::snprintf(g_cuda_note, sizeof g_cuda_note, "%s", text);
}

// Counted, noted and thrown: c10::OutOfMemoryError (`oom`) or c10::Error.
[[noreturn]] void fail(CudaRoute* route, bool oom, const std::string& text) {
  if (route != nullptr) route->failures += 1;
  note(text.c_str());
  if (oom) TORCH_CHECK_WITH(OutOfMemoryError, false, text);
  TORCH_CHECK(false, text);
  __builtin_unreachable();
}

void* cuda_alloc(ssize_t size, int device, void* stream) {
  if (size == 0) return nullptr;  // an empty tensor on any device: nothing to place or free
  CudaRoute* route = cuda_route(device);
  Installed* in = route != nullptr ? route->in.load(std::memory_order_acquire) : nullptr;
  // Words for a failure only: the hot path builds no string.
  auto what = [&] { return std::to_string(size) + " bytes on cuda:" + std::to_string(device); };
  if (in == nullptr)
    fail(nullptr, false, "defrag: PyTorch asked for " + what() + ", a device no pool was installed for "
                         "(defrag.install(pool) serves the device of each pool installed; PyTorch's own CUDA "
                         "allocator was replaced for every device)");
  if (size < 0) fail(route, false, "defrag: PyTorch asked for " + what());
  if (g_forked_child.load(std::memory_order_relaxed))
    fail(route, false, "defrag: PyTorch asked for " + what() + " in a forked child of the process that "
                       "installed the pool; a child never allocates from its parent's pool");
  if (size > kLargestRequest) {
    route->counters.ooms += 1;
    fail(route, true, "defrag: PyTorch asked for " + what() + ", more than any pool can hold");
  }
  const bool declined_now = !in->fast->serves_allocator.load(std::memory_order_relaxed);
  Placement placed;
  if (!declined_now) {
    // The pool's own code (inside its gate, or inside the Python call an entry made) never asks the
    // pool again: a native placement only.
    const bool may_ask = t_pool_code == 0 && defrag_native::books_held_here == 0;
    placed = place_from_pool(in, route->in, static_cast<int64_t>(size), reinterpret_cast<uintptr_t>(stream), may_ask,
                             route->counters);
    if (placed.address != 0) {
      route->allocs += 1;
      if (stream != nullptr) route->other_stream_allocs += 1;
      return reinterpret_cast<void*>(placed.address);
    }
    if (placed.answer == Answer::kRefused) fail(route, true, placed.refusal);
  } else {
    route->counters.declined += 1;
  }
  route->counters.ooms += 1;
  fail(route, true,
       "defrag: out of memory: the pool installed for cuda:" + std::to_string(device) + " cannot serve " +
           std::to_string(size) + " bytes for PyTorch now: it is closed or asleep, or the "
           "request came from the pool's own code while it made room, from a parallel region's worker that "
           "must not wait for Python, or while Python exits (on CUDA no other allocator can serve it)");
}

void cuda_free(void* ptr, ssize_t size, int device) noexcept {
  if (ptr == nullptr) return;
  if (g_forked_child.load(std::memory_order_relaxed)) return;  // the parent's pool: forgotten
  CudaRoute* route = cuda_route(device);
  Installed* in = route != nullptr ? route->in.load(std::memory_order_acquire) : nullptr;
  if (release_installed(in, reinterpret_cast<uintptr_t>(ptr))) {
    if (route != nullptr) route->frees += 1;
    return;
  }
  const int64_t count = ++g_cuda_foreign_frees;
  char text[256];
  std::snprintf(text, sizeof text,
                "defrag: PyTorch freed %p (%lld bytes, cuda:%d), which no installed pool handed out; ignored",
                ptr, static_cast<long long>(size), device);
  note(text);
  if (count <= kForeignFreesReported) std::fprintf(stderr, "%s\n", text);
}

// Serve `device` from the pool of `fast_object` (with the GIL), for the life of the process: what
// install does before handing the entry points to PyTorch. The same pool again is a no-op.
void register_cuda_pool(py::object fast_object, int device) {
  if (g_forked_child.load())
    throw std::runtime_error("defrag.install: this process is a fork of one that installed a pool");
  CudaRoute* route = cuda_route(device);
  if (route == nullptr)
    throw std::invalid_argument("defrag.install: cuda:" + std::to_string(device) + " is not a device index "
                                "this allocator serves (0 to " + std::to_string(kMaxCudaDevices - 1) + ")");
  Installed* current = route->in.load();
  if (current != nullptr) {
    if (current->fast == fast_object.cast<FastPath*>()) return;
    throw std::runtime_error("defrag.install: cuda:" + std::to_string(device) + " has a pool installed already "
                             "(one per device, for the life of the process)");
  }
  Installed* in = record_for(fast_object);
  ensure_fork_handler();
  in->fast->take_lease();  // never dropped: the route lives as long as the process
  route->in.store(in, std::memory_order_release);
}

py::dict cuda_counters(int device) {
  CudaRoute* route = cuda_route(device);
  if (route == nullptr) throw std::invalid_argument("cuda_allocator_counters: no such device index");
  py::dict out;
  Installed* in = route->in.load();
  out["installed"] = in != nullptr;
  out["forked_child"] = g_forked_child.load();
  out["allocs"] = route->allocs.load();
  out["frees"] = route->frees.load();
  out["failures"] = route->failures.load();
  out["ooms"] = route->counters.ooms.load();
  out["declined"] = route->counters.declined.load();
  out["asked"] = route->counters.asked.load();
  out["other_stream_allocs"] = route->other_stream_allocs.load();
  out["foreign_frees"] = g_cuda_foreign_frees.load();
  {
    std::lock_guard<std::mutex> guard(*g_cuda_note_mu);
    out["last_error"] = std::string(g_cuda_note);
  }
  return out;
}

// The test hooks (`cuda_allocator_call`, `cuda_allocator_free`): the exported entry points called
// from C++, as PyTorch's malloc calls them (GIL released), with their C++ exceptions turned into
// Python's (ctypes cannot carry one): c10::OutOfMemoryError becomes torch.OutOfMemoryError.
uintptr_t call_alloc(int64_t size, int device, uintptr_t stream);
void call_free(uintptr_t ptr, int64_t size, int device, uintptr_t stream);

void bind_cuda_allocator(py::module_& m) {
  m.def("register_cuda_pool", &register_cuda_pool, py::arg("fast_path"), py::arg("device"),
        "Serve `device` from this FastPath's pool through defrag_cuda_alloc/free, for the life of the process.");
  m.def("cuda_allocator_counters", &cuda_counters, py::arg("device"));
  m.def("cuda_allocator_call", &call_alloc, py::arg("size"), py::arg("device"), py::arg("stream") = 0,
        "defrag_cuda_alloc from C++ (a test hook): the address, or torch.OutOfMemoryError / RuntimeError.");
  m.def("cuda_allocator_free", &call_free, py::arg("ptr"), py::arg("size"), py::arg("device"), py::arg("stream") = 0,
        "defrag_cuda_free from C++ (a test hook).");
}

}  // namespace

// The entry points PyTorch's CUDAPluggableAllocator finds by name (see the header comment).
extern "C" __attribute__((visibility("default"))) void* defrag_cuda_alloc(ssize_t size, int device, void* stream) {
  return cuda_alloc(size, device, stream);
}

extern "C" __attribute__((visibility("default"))) void defrag_cuda_free(void* ptr, ssize_t size, int device,
                                                                        void* /*stream*/) noexcept {
  cuda_free(ptr, size, device);
}

namespace {

uintptr_t call_alloc(int64_t size, int device, uintptr_t stream) {
  void* out = nullptr;
  std::string oom, error;
  {
    py::gil_scoped_release nogil;
    try {
      out = defrag_cuda_alloc(static_cast<ssize_t>(size), device, reinterpret_cast<void*>(stream));
    } catch (const c10::OutOfMemoryError& e) {
      oom = e.what_without_backtrace();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  if (!oom.empty()) {
    py::object type = py::module_::import("torch").attr("OutOfMemoryError");
    PyErr_SetString(type.ptr(), oom.c_str());
    throw py::error_already_set();
  }
  if (!error.empty()) throw std::runtime_error(error);
  return reinterpret_cast<uintptr_t>(out);
}

void call_free(uintptr_t ptr, int64_t size, int device, uintptr_t stream) {
  py::gil_scoped_release nogil;
  defrag_cuda_free(reinterpret_cast<void*>(ptr), static_cast<ssize_t>(size), device, reinterpret_cast<void*>(stream));
}

}  // namespace
