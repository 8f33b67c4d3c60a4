// A pool as a PyTorch allocator: what PyTorch's CPU allocator (`cpu_allocator.cpp`) and the CUDA
// pluggable allocator's entry points (`cuda_allocator.cpp`) share. Compiled in the same unit as
// module.cpp, after it (it uses FastPath and the books' records), before both entries.
//
// One allocation (`place_from_pool`): placed natively first (`FastPath::place_for_allocator`: the
// books' mutex once, no GIL, no Python, no syscall): a record the books keep like any other, its
// face made only when the pool's Python code asks (pinned: PyTorch holds its raw pointer, so it never
// moves). Only when pages must be mapped, or a thread is inside the books, or the history log waits
// for Python, does it take the GIL and ask the pool's room (`FastPath::set_room`, registered by the
// pool: its ladder places the block, once, and the entry attaches that very record). The room's
// answer is an address, or a refusal (the pool's explained OOM) or a decline (the pool does not serve
// this request: closed, asleep, or the caller must not wait for Python); each entry turns those into
// its own outcome (both throw c10::OutOfMemoryError for a refusal; the CPU allocator declines to
// PyTorch's previous allocator, CUDA has none and throws). Nothing here throws but std::bad_alloc,
// and nothing calls Python while holding the books' mutex.
//
// One release (`release_pooled`): the record found by address in the books and released there
// (applied at once, or queued while a thread is inside the books); noexcept, no GIL (but
// `after_release`'s).
//
// Lifetime: install records (`Installed`), their books and FastPaths are never destroyed (leaked on
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
  std::shared_ptr<Books>* keep = nullptr;  // leaked: keeps `fast->books()` alive for late releases
  c10::Allocator* previous = nullptr;     // CPU allocator only: current before install; restored by uninstall
};

Installed g_installs[kMaxInstalls];   // trivially destructible: safe at exit
std::atomic<int> g_install_count{0};  // published entries of g_installs
std::atomic<bool> g_forked_child{false};
bool g_atfork_registered = false;  // with the GIL
// Depth of the pool's Python code an entry called on this thread (`ask_pool`): an allocation made
// meanwhile must never ask the pool again (a recursion into its lock).
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
  in.keep = new std::shared_ptr<Books>(fast->shared_books());
  g_install_count.store(count + 1, std::memory_order_release);
  return &in;
}

enum class Answer { kStocked, kRefused, kDecline };

// The pool's answer for `nbytes` it could not place natively (its room), with the GIL: placed (the
// address, its record attached here), refused (`refusal`: the explained OOM) or decline. `route`: the
// entry's pointer to `in`; when it changed meanwhile (the CPU allocator was uninstalled: the pool may
// be gone) the answer is decline. The pool's ladder stops before compacting: PyTorch may allocate in
// the middle of an op whose inputs' addresses it has read already (an output, a workspace), so moving
// pool tensors there is unsafe. The thread's pending Python error, if any, is kept; the pool's own
// allocations meanwhile never ask the pool (`t_pool_code`).
Answer ask_pool(Installed* in, const std::atomic<Installed*>& route, int64_t nbytes, uintptr_t stream,
                EntryCounters& counters, std::string& refusal, uintptr_t& address) {
  if (python_exiting()) return Answer::kDecline;
  counters.asked += 1;
  t_pool_code += 1;
  PyGILState_STATE gil = PyGILState_Ensure();
  Answer answer = Answer::kDecline;
  if (route.load(std::memory_order_acquire) == in && in->fast->room()) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* said = PyObject_CallFunction(in->fast->room().ptr(), "LiK", static_cast<long long>(nbytes),
                                           static_cast<int>(defrag_native::kAllocator),
                                           static_cast<unsigned long long>(stream));
    if (said == nullptr) {
      PyErr_Clear();  // the room never raises; if it did, the request fails plainly
      refusal = "defrag: the pool failed while making room for a PyTorch allocation";
      answer = Answer::kRefused;
    } else if (PyTuple_Check(said) && PyTuple_GET_SIZE(said) == 2) {
      const long long at = PyLong_AsLongLong(PyTuple_GET_ITEM(said, 0));
      if (at == -1 && PyErr_Occurred()) PyErr_Clear();
      address = at > 0 ? in->fast->adopt_for_allocator(at, PyTuple_GET_ITEM(said, 1), stream) : 0;
      answer = address != 0 ? Answer::kStocked : Answer::kDecline;
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
// another thread) never asks either: that other thread may hold the GIL or the pool's lock and wait
// for this very worker. `stream`: the one PyTorch allocates for (CUDA; 0 for the CPU). Throws only
// std::bad_alloc.
Placement place_from_pool(Installed* in, const std::atomic<Installed*>& route, int64_t nbytes, uintptr_t stream,
                          bool may_ask, EntryCounters& counters) {
  Placement out;
  FastPath::Refusal why;
  out.address = in->fast->place_for_allocator(nbytes, stream, why);
  if (out.address != 0) return out;
  const bool declines = !may_ask || why == FastPath::Refusal::kNoLease ||
                        (at::in_parallel_region() && PyGILState_GetThisThreadState() == nullptr);
  out.answer = declines ? Answer::kDecline : ask_pool(in, route, nbytes, stream, counters, out.refusal, out.address);
  if (out.answer == Answer::kDecline) counters.declined += 1;
  if (out.answer == Answer::kRefused) counters.ooms += 1;
  return out;
}

// The allocator block at `address` of `books`, released; false when `books` hold no such block.
bool release_pooled(const std::shared_ptr<Books>& books, uintptr_t address) noexcept {
  Aftermath after;
  {
    std::lock_guard<std::mutex> guard(books->mu);
    Record* r = books->find_locked(static_cast<int64_t>(address), nullptr);
    if (r == nullptr || r->origin != defrag_native::kAllocator || !r->attached || r->released) return false;
    books->release_locked(r, after);
  }
  after_release(books, after);
  return true;
}

// The block at `address`, released into whichever installed pool made it: `first` (the likely one)
// is tried first; false when no install made a block there.
bool release_installed(Installed* first, uintptr_t address) noexcept {
  if (first != nullptr && release_pooled(*first->keep, address)) return true;
  const int count = g_install_count.load(std::memory_order_acquire);
  for (int i = count - 1; i >= 0; --i) {
    if (&g_installs[i] != first && release_pooled(*g_installs[i].keep, address)) return true;
  }
  return false;
}

}  // namespace
