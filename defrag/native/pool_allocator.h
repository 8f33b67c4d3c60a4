// A pool as a PyTorch allocator: what PyTorch's CPU allocator (`cpu_allocator.cpp`) and the CUDA
// pluggable allocator's entry points (`cuda_allocator.cpp`) share. Compiled in the same unit as
// module.cpp, after it (it uses FastPath, State and Slot), before both entries.
//
// One allocation (`place_from_pool`): placed natively first (`FastPath::place_for_allocator`: the
// books' mutex once, no GIL, no Python, no syscall), exactly like the fast path's `native_empty`,
// and recorded by the core at its next sync, pinned (PyTorch holds its raw pointer: it never moves).
// Only when pages must be mapped, or releases wait for Python, or Python holds the books, does it
// take the GIL and ask the pool (`ask_pool`: `Pool._stock_for_allocator`, the ladder places a block
// and keeps its range for this size), then place again. Its answer is an address, or a refusal (the
// pool's explained OOM) or a decline (the pool does not serve this request: closed, asleep, or the
// caller must not wait for Python); each entry turns those into its own outcome
// (both throw c10::OutOfMemoryError for a refusal; the CPU allocator declines to PyTorch's previous
// allocator, CUDA has none and throws). Nothing here throws but std::bad_alloc, and nothing calls
// Python while holding the books' mutex.
//
// One release (`release_pooled`): the slot found by address (`State::by_address`), given back to the
// books or queued for Python (module.cpp's `release_locked`); noexcept, no GIL (but `after_release`'s).
//
// Lifetime: install records (`Installed`), their States and FastPaths are never destroyed (leaked on
// purpose): PyTorch may free a block at any time, in any thread, at exit after Python is gone; the
// release touches only them. A record's pool reference (`fast_object`) is strong and leaked too.
//
// fork: `g_forked_child` is set in the child (`pthread_atfork`, registered by the first install of
// either entry): the pool's pages are the parent's (memfd pages shared with it, or device memory the
// child cannot use), so a child never allocates from, nor frees into, the parent's pool.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <string>

namespace {

constexpr int kMaxInstalls = 64;  // install records per process (one per pool ever installed, either entry)
constexpr int64_t kLargestRequest = int64_t(1) << 62;

// One pool installed as (one of) PyTorch's allocators. Never freed; published once (with the GIL).
struct Installed {
  FastPath* fast = nullptr;               // alive forever: `fast_object` is never dropped
  PyObject* fast_object = nullptr;        // a strong reference, leaked on purpose
  std::shared_ptr<State>* keep = nullptr;  // leaked: keeps `fast->state()` alive for late releases
  c10::Allocator* previous = nullptr;     // CPU allocator only: current before install; restored by uninstall
};

Installed g_installs[kMaxInstalls];   // trivially destructible: safe at exit
std::atomic<int> g_install_count{0};  // published entries of g_installs
std::atomic<bool> g_forked_child{false};
bool g_atfork_registered = false;  // with the GIL
// Depth of the pool's Python code an entry called on this thread (`ask_pool`): an allocation made
// meanwhile must never ask the pool again (a recursion into its gate).
thread_local int t_pool_code = 0;

// Counters of one entry (process-wide for the CPU allocator, per device for CUDA).
struct EntryCounters {
  std::atomic<int64_t> asked{0};     // trips to the pool's Python code
  std::atomic<int64_t> declined{0};  // requests the pool did not serve (the entry's fallback)
  std::atomic<int64_t> ooms{0};      // OutOfMemoryErrors thrown
};

// The entries' own step in the child right after fork() (the CPU allocator's, defined in its file).
void cpu_allocator_after_fork() noexcept;

void after_fork_in_child() {
  g_forked_child.store(true);
  cpu_allocator_after_fork();
}

// With the GIL: the child handler is registered once per process.
void ensure_fork_handler() {
  if (g_atfork_registered) return;
  if (pthread_atfork(nullptr, nullptr, &after_fork_in_child) != 0)
    throw std::runtime_error("defrag.install: pthread_atfork failed");
  g_atfork_registered = true;
}

// The install record for `fast_object`'s pool: reused when this pool was installed before (by either
// entry), else a new one, published (with the GIL).
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
// GIL: stocked (place again), refused (`refusal`: the explained OOM) or decline. `route`: the entry's
// pointer to `in`; when it changed meanwhile (the CPU allocator was uninstalled: the pool may be gone,
// its reference borrowed) the answer is decline.
// `no_room`: pages must be mapped (the ladder climbs); else releases wait for Python or Python held
// the books (the pool only applies the releases: climbing the ladder there would record every live
// block again, whose frees then queue again, and threads asking together would never get out).
// The pool's ladder stops before compacting: PyTorch may allocate in the middle of an op whose inputs'
// addresses it has read already (an output, a workspace), so moving pool tensors there is unsafe.
// The thread's pending Python error, if any, is kept; the pool's own allocations meanwhile never ask
// the pool (`t_pool_code`).
Answer ask_pool(Installed* in, const std::atomic<Installed*>& route, int64_t nbytes, bool no_room,
                EntryCounters& counters, std::string& refusal) {
  if (!python_callable()) return Answer::kDecline;
  counters.asked += 1;
  t_pool_code += 1;
  PyGILState_STATE gil = PyGILState_Ensure();
  Answer answer = Answer::kDecline;
  if (route.load(std::memory_order_acquire) == in) {
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

// What `place_from_pool` got: an address, else why not.
struct Placement {
  uintptr_t address = 0;             // the block's; 0: none
  Answer answer = Answer::kStocked;  // with no address: kRefused (`refusal` says why) or kDecline
  std::string refusal;
};

// A block of `nbytes` (> 0) for PyTorch from `in`'s pool (see the header comment). `may_ask`: false
// when the calling thread must not ask the pool's Python code (it runs that code now): a native miss
// then declines. A worker of a parallel region (a thread Python never saw, running part of an op for
// another thread) never asks either: that other thread may hold the GIL or the pool's gate and wait
// for this very worker. Throws only std::bad_alloc (no host memory for the slot).
Placement place_from_pool(Installed* in, const std::atomic<Installed*>& route, int64_t nbytes, bool may_ask,
                          EntryCounters& counters) {
  // Only climbs of the ladder count: applying releases always makes progress (each applies what
  // other threads queued meanwhile, and only blocks recorded at the last climb queue).
  int climbs = 0;
  for (;;) {
    Placement out;
    FastPath::Refusal why;
    out.address = in->fast->place_for_allocator(nbytes, why);
    if (out.address != 0) return out;
    const bool no_room = why == FastPath::Refusal::kNoRoom;
    const bool declines = !may_ask || why == FastPath::Refusal::kNoLease ||
                          (at::in_parallel_region() && PyGILState_GetThisThreadState() == nullptr);
    out.answer = Answer::kDecline;
    if (!declines && no_room && climbs++ == kNativeAttempts) {
      // Every range stocked for this size was taken first by other threads (never by all of them).
      out.answer = Answer::kRefused;
      out.refusal = "defrag: out of memory: " + std::to_string(nbytes) + " bytes for PyTorch, after " +
                    std::to_string(kNativeAttempts) + " tries that other threads' allocations got first";
    } else if (!declines) {
      out.answer = ask_pool(in, route, nbytes, no_room, counters, out.refusal);
    }
    if (out.answer == Answer::kDecline) counters.declined += 1;
    if (out.answer == Answer::kRefused) counters.ooms += 1;
    if (out.answer != Answer::kStocked) return out;
  }
}

// The pool block at `address` made for an entry by `st`, released; false when `st` made none there.
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

// The block at `address`, released into whichever installed pool made it: `first` (the likely one)
// is tried first; false when no install made a block there.
bool release_installed(Installed* first, uintptr_t address) noexcept {
  if (first != nullptr && release_pooled(first->fast->state(), address)) return true;
  const int count = g_install_count.load(std::memory_order_acquire);
  for (int i = count - 1; i >= 0; --i) {
    if (&g_installs[i] != first && release_pooled(g_installs[i].fast->state(), address)) return true;
  }
  return false;
}

}  // namespace
