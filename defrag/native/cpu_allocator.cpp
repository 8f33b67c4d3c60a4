// PyTorch's CPU allocator over one pool's books (`defrag.install(pool)` on the emulated device, whose
// pool pages are host memory): every CPU tensor the program makes afterwards lives in the pool.
// Compiled in the same unit as module.cpp, after it (it uses FastPath, State and Slot).
//
// Hot path (`allocate`, `free_pooled`): no Python, no GIL, no syscall; the books' mutex once each
// way. A block is placed exactly like the fast path's `native_empty` (`FastPath::place_for_allocator`)
// and recorded by the core at its next sync, pinned (PyTorch holds its raw pointer: it never moves).
// Only when pages must be mapped, or releases wait for Python, or Python holds the books, does
// `allocate` take the GIL and ask the pool (`Pool._stock_for_allocator`: the ladder places a block and
// keeps its range for this size); when the pool cannot, the pool's explained OOM becomes
// c10::OutOfMemoryError, which reaches Python as torch.OutOfMemoryError (thrown before any counter
// changed: the program may catch it and go on).
//
// Invariants:
// - An allocation goes to the allocator that was current before install ("previous") when the
//   calling thread runs the pool's own code (inside a pool's gate: `books_held_here`; or inside the
//   Python call this allocator makes: `t_pool_code`): never a recursion into the pool, never a
//   deadlock on its gate. Also when the fast path is off (pool asleep, closed, recording history),
//   when a worker of a parallel region (a thread Python never saw, running part of another thread's
//   op) cannot place natively (asking Python there could deadlock: that other thread may hold the
//   GIL or the pool's gate while it waits for this very worker), during interpreter finalization,
//   and in a forked child. Any other thread waits for the pool's answer.
// - A DataPtr's context is its data pointer (torch's copy-on-write and lazy clones require it); the
//   deleter finds the slot by address in the installs' `by_address` maps.
// - Installs, their States and FastPaths are never destroyed (leaked on purpose): the deleter may
//   run at any time, in any thread, at exit after Python is gone; it is noexcept and touches only
//   them. The allocator object itself is never destroyed either (PyTorch keeps its pointer).
// - fork: the child switches PyTorch back to the previous allocator (`pthread_atfork`) and its
//   deleter forgets blocks it inherited: the pool's pages are memfd pages shared with the parent, so
//   the child must never allocate from, nor free into, the parent's pool.
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <string>

namespace {

constexpr int kMaxInstalls = 64;        // installs per process (uninstall + install again counts anew per pool)
constexpr uint8_t kAllocatorPriority = 0;  // the default allocator's: SetCPUAllocator replaces on >=
constexpr int64_t kLargestRequest = int64_t(1) << 62;

// One pool as PyTorch's CPU allocator. Never freed; only `previous` changes (at each install, with the GIL).
struct Installed {
  FastPath* fast = nullptr;               // alive forever: `fast_object` is never dropped
  PyObject* fast_object = nullptr;        // a strong reference, leaked on purpose
  std::shared_ptr<State>* keep = nullptr;  // leaked: keeps `fast->state()` alive for late deleters
  c10::Allocator* previous = nullptr;     // current before install; restored by uninstall
};

Installed g_installs[kMaxInstalls];          // trivially destructible: safe at exit
std::atomic<int> g_install_count{0};         // published entries of g_installs
std::atomic<Installed*> g_current{nullptr};  // the pool allocations go to; nullptr: none
std::atomic<c10::Allocator*> g_previous{nullptr};
std::atomic<bool> g_forked_child{false};
bool g_atfork_registered = false;  // with the GIL
std::atomic<int64_t> g_declined{0}, g_asked{0}, g_ooms{0};
// Depth of the pool's Python code this allocator called on this thread (see the invariants).
thread_local int t_pool_code = 0;

void free_pooled(void* data) noexcept;

class PoolCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &free_pooled; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static c10::DataPtr previous_allocate(size_t n);
  static c10::DataPtr from_pool(Installed* in, int64_t nbytes);
};

PoolCpuAllocator* const g_allocator = new PoolCpuAllocator();  // leaked: PyTorch may call it at exit

c10::DataPtr PoolCpuAllocator::previous_allocate(size_t n) {
  c10::Allocator* previous = g_previous.load(std::memory_order_acquire);
  if (previous == nullptr) previous = c10::GetDefaultCPUAllocator();
  return previous->allocate(n);
}

c10::DataPtr PoolCpuAllocator::allocate(size_t n) {
  Installed* in = g_current.load(std::memory_order_acquire);
  if (in == nullptr || t_pool_code > 0 || defrag_native::books_held_here > 0 ||
      g_forked_child.load(std::memory_order_relaxed) || !in->fast->enabled.load(std::memory_order_relaxed)) {
    return previous_allocate(n);
  }
  if (n == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));  // nothing to place or free
  if (n > static_cast<size_t>(kLargestRequest)) {
    g_ooms += 1;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "defrag: PyTorch asked the pool for ", n,
                     " bytes, more than any pool can hold");
  }
  return from_pool(in, static_cast<int64_t>(n));
}

// Whether the pool's Python code may be called from this thread now (not while Python exits).
bool python_callable() {
  if (!Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

enum class Answer { kStocked, kRefused, kDecline };

// The pool's answer for `nbytes` it could not place natively (`Pool._stock_for_allocator`), with the
// GIL: stocked (place again), refused (`refusal`: the explained OOM) or decline (previous allocator).
// `no_room`: pages must be mapped (the ladder climbs); else releases wait for Python or Python held
// the books (the pool only applies the releases: climbing the ladder there would record every live
// block again, whose frees then queue again, and threads asking together would never get out).
// The thread's pending Python error, if any, is kept; allocations meanwhile go to the previous
// allocator (`t_pool_code`).
Answer ask_pool(Installed* in, int64_t nbytes, bool no_room, std::string& refusal) {
  if (!python_callable()) return Answer::kDecline;
  g_asked += 1;
  t_pool_code += 1;
  PyGILState_STATE gil = PyGILState_Ensure();
  Answer answer = Answer::kDecline;
  // Uninstalled meanwhile (uninstall holds the GIL): the pool may be gone, its reference borrowed.
  if (g_current.load(std::memory_order_acquire) == in) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* said = PyObject_CallMethod(in->fast->state().pool, "_stock_for_allocator", "LO",
                                         static_cast<long long>(nbytes), no_room ? Py_True : Py_False);
    if (said == nullptr) {
      PyErr_Clear();  // the method never raises; if it did, the request fails plainly
      refusal = "defrag: the pool failed while making room for a PyTorch allocation";
      answer = Answer::kRefused;
    } else if (said == Py_None) {
      answer = Answer::kStocked;
    } else if (PyUnicode_Check(said)) {
      const char* text = PyUnicode_AsUTF8(said);
      if (text == nullptr) PyErr_Clear();
      refusal = text != nullptr ? text : "defrag: out of memory";
      answer = Answer::kRefused;
    }
    Py_XDECREF(said);
    PyErr_Restore(type, value, traceback);
  }
  PyGILState_Release(gil);
  t_pool_code -= 1;
  return answer;
}

c10::DataPtr PoolCpuAllocator::from_pool(Installed* in, int64_t nbytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  // Only climbs of the ladder count: applying releases always makes progress (each applies what
  // other threads queued meanwhile, and only blocks recorded at the last climb queue).
  int climbs = 0;
  for (;;) {
    FastPath::Refusal why;
    const uintptr_t address = in->fast->place_for_allocator(nbytes, why);
    if (address != 0) {
      void* data = reinterpret_cast<void*>(address);
      return c10::DataPtr(data, data, &free_pooled, cpu);
    }
    const bool no_room = why == FastPath::Refusal::kNoRoom;
    // A worker of a parallel region (a thread Python never saw, running part of an op for another
    // thread) never waits for Python: that other thread may hold the GIL or the pool's gate and wait
    // for this very worker.
    const bool declines = why == FastPath::Refusal::kNoLease ||
                          (at::in_parallel_region() && PyGILState_GetThisThreadState() == nullptr);
    std::string refusal;
    Answer answer = Answer::kDecline;
    if (!declines && no_room && climbs++ == kNativeAttempts) {
      // Every range stocked for this size was taken first by other threads (never by all of them).
      answer = Answer::kRefused;
      refusal = "defrag: out of memory: " + std::to_string(nbytes) + " bytes for PyTorch, after " +
                std::to_string(kNativeAttempts) + " tries that other threads' allocations got first";
    } else if (!declines) {
      answer = ask_pool(in, nbytes, no_room, refusal);
    }
    if (answer == Answer::kDecline) {
      g_declined += 1;
      return previous_allocate(static_cast<size_t>(nbytes));
    }
    if (answer == Answer::kRefused) {
      g_ooms += 1;
      TORCH_CHECK_WITH(OutOfMemoryError, false, refusal);
    }
  }
}

// The pool block at `address` made for the allocator by `st`, released; false when `st` made none there.
bool release_pooled(State& st, uintptr_t address) noexcept {
  Slot* slot;
  bool last, notify = false;
  {
    std::lock_guard<std::mutex> guard(st.books->mu);
    auto it = st.by_address.find(address);
    if (it == st.by_address.end()) return false;
    slot = it->second;
    st.by_address.erase(it);
    last = release_locked(st, slot, notify);
  }
  delete slot;
  after_release(st, last, notify);
  return true;
}

// The deleter of every DataPtr this allocator made (and its raw_deleter): any thread, any time.
void free_pooled(void* data) noexcept {
  if (data == nullptr) return;
  // A block inherited from the parent: the pool and its pages are the parent's. Forgotten (the
  // child's copy of the books is never used again); likewise a raw allocation made before the fork.
  if (g_forked_child.load(std::memory_order_relaxed)) return;
  const auto address = reinterpret_cast<uintptr_t>(data);
  Installed* current = g_current.load(std::memory_order_acquire);
  if (current != nullptr && release_pooled(current->fast->state(), address)) return;
  const int count = g_install_count.load(std::memory_order_acquire);
  for (int i = count - 1; i >= 0; --i) {  // a block of an earlier install (uninstalled since)
    if (&g_installs[i] != current && release_pooled(g_installs[i].fast->state(), address)) return;
  }
  // Not a pool block: the previous allocator's, handed out through our raw_allocate (`allocate`
  // declined); its DataPtr's context was its data pointer, so its raw deleter frees it.
  c10::Allocator* previous = g_previous.load(std::memory_order_acquire);
  if (previous != nullptr) {
    c10::DeleterFnPtr deleter = previous->raw_deleter();
    if (deleter != nullptr) deleter(data);
  }
}

// In the child right after fork(): PyTorch's previous allocator for everything from now on.
void after_fork_in_child() {
  g_forked_child.store(true);
  Installed* in = g_current.load();
  if (in != nullptr) c10::SetCPUAllocator(in->previous, kAllocatorPriority);
}

// The install record for `fast_object`'s pool: reused when this pool was installed before, else a
// new one, published (with the GIL).
Installed* record_for(py::object fast_object) {
  auto* fast = fast_object.cast<FastPath*>();
  const int count = g_install_count.load();
  for (int i = 0; i < count; ++i) {
    if (g_installs[i].fast == fast) return &g_installs[i];
  }
  if (count == kMaxInstalls)
    throw std::runtime_error("defrag.install: " + std::to_string(kMaxInstalls) + " pools were installed in this "
                             "process already; no more can be (each stays reachable for its late frees)");
  Installed& in = g_installs[count];
  in.fast = fast;
  in.fast_object = fast_object.release().ptr();
  in.keep = new std::shared_ptr<State>(fast->shared_state());
  g_install_count.store(count + 1, std::memory_order_release);
  return &in;
}

// Lease on the pool for as long as it is installed (with the GIL): blocks made meanwhile never take
// the first pool reference themselves (that needs the GIL).
void take_lease(State& st) {
  std::lock_guard<std::mutex> guard(st.books->mu);
  if (st.live++ == 0) Py_INCREF(st.pool);
}

void drop_lease(State& st) {
  bool last;
  {
    std::lock_guard<std::mutex> guard(st.books->mu);
    last = --st.live == 0;
  }
  if (last) Py_DECREF(st.pool);
}

// Make this pool PyTorch's CPU allocator (with the GIL). The caller checked the pool is open.
void install(py::object fast_object) {
  if (g_forked_child.load())
    throw std::runtime_error("defrag.install: this process is a fork of one that installed a pool; "
                             "a forked child uses PyTorch's own allocator");
  if (g_current.load() != nullptr) throw std::runtime_error("defrag.install: a pool is installed already");
  Installed* in = record_for(fast_object);
  c10::Allocator* previous = c10::GetCPUAllocator();
  if (previous == g_allocator) throw std::runtime_error("defrag.install: defrag's CPU allocator is current already");
  if (!g_atfork_registered) {
    if (pthread_atfork(nullptr, nullptr, &after_fork_in_child) != 0)
      throw std::runtime_error("defrag.install: pthread_atfork failed");
    g_atfork_registered = true;
  }
  take_lease(in->fast->state());
  in->previous = previous;
  g_previous.store(previous, std::memory_order_release);
  g_current.store(in, std::memory_order_release);
  c10::SetCPUAllocator(g_allocator, kAllocatorPriority);
  if (c10::GetCPUAllocator() != g_allocator) {  // someone set one with a higher priority
    g_current.store(nullptr);
    drop_lease(in->fast->state());
    throw std::runtime_error("defrag.install: PyTorch kept its current CPU allocator (set with a higher priority "
                             "than the default's)");
  }
}

// PyTorch's previous CPU allocator again (with the GIL); false when none was installed. Blocks made
// meanwhile stay valid and go back to their pool when freed.
bool uninstall() {
  Installed* in = g_current.load();
  if (in == nullptr) return false;
  if (!g_forked_child.load()) c10::SetCPUAllocator(in->previous, kAllocatorPriority);
  g_current.store(nullptr, std::memory_order_release);
  if (!g_forked_child.load()) drop_lease(in->fast->state());  // a child leaves the parent's pool alone
  return true;
}

py::dict counters() {
  py::dict out;
  Installed* in = g_current.load();
  out["installed"] = in != nullptr && !g_forked_child.load();
  out["current"] = c10::GetCPUAllocator() == g_allocator;
  out["forked_child"] = g_forked_child.load();
  out["declined"] = g_declined.load();
  out["asked"] = g_asked.load();
  out["ooms"] = g_ooms.load();
  int64_t blocks = 0;
  if (in != nullptr) {
    std::lock_guard<std::mutex> guard(in->fast->state().books->mu);
    blocks = in->fast->state().allocator_blocks;
  }
  out["blocks"] = blocks;
  return out;
}

// Whether `tensor`'s memory was made by this allocator (its DataPtr's deleter is ours).
bool made_here(const at::Tensor& tensor) {
  return tensor.storage().data_ptr().get_deleter() == &free_pooled;
}

void bind_cpu_allocator(py::module_& m) {
  m.def("install_cpu_allocator", &install, py::arg("fast_path"),
        "Make the pool of this FastPath PyTorch's CPU allocator (see cpu_allocator.cpp).");
  m.def("uninstall_cpu_allocator", &uninstall, "PyTorch's previous CPU allocator again; False when none was installed.");
  m.def("cpu_allocator_counters", &counters);
  m.def("cpu_allocator_made", &made_here, py::arg("tensor"));
}

}  // namespace
