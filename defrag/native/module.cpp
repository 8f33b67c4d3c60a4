// defrag's native module: the pool's books (`books.h`, over `heap.h`) and the
// allocation fast path, `pool.empty()` and the tensor's release in C++.
//
// The fast path serves `pool.empty()` of any size that mapped free space holds,
// in one call: the books place the block (a kept range of the exact size, else
// best fit: `Books::place_mapped_locked`, the core's own placement when no page
// must be mapped), the tensor is made with `at::for_blob` over it, and its
// storage gets a deleter that gives the range back to the books without the
// GIL. The Python core learns what happened at its next safe point
// (`collect()`, called from `Core.drain` and `Core.flush_reuse` with the
// pool's gate held): the blocks made since, which it then records as Blocks.
//
// Guarantees (what the Python side relies on):
// - `empty()` never blocks and never raises: it returns None whenever the
//   request is not the common case (the pool's gate is held or waited for by
//   any thread, the fast path is disabled, pages would have to be mapped,
//   unusual arguments, a stale access to report, a non-default CUDA stream),
//   and the Python path then does everything, errors included.
// - A range handed out here is never handed out again before its tensor's
//   storage is freed; a released range that Python never saw goes straight
//   back to the books (or, while Python holds them or releases wait in the
//   queue, is queued in order); one that Python saw (collected) is reported
//   by serial number and freed by Python.
// - `collect()` hands Python every block made since the last call that still
//   lives, with a weak reference to its storage, its owner thread and dtype,
//   and the counters (allocations, frees, the peak of allocated bytes).
// - The deleter takes only the books' mutex, and never waits for the GIL.
//   It runs Python only to drop the pool reference when the last live block
//   made here dies, and after the pool closed (to let the pool release its
//   memory): at once, taking the GIL, in a Python thread (one dropping a
//   tensor); else as a pending call the main thread runs at its next check (a
//   C++ worker thread Python never saw, freeing a tensor: waiting for the GIL
//   there could abort the process if the interpreter began finalizing
//   meanwhile). No exception crosses it.
//
// Every Python-facing method runs with the GIL held; the deleter synchronizes
// on the books' mutex.
//
// PyTorch's CPU allocator over these books (`defrag.install` on the emulated device) is
// `cpu_allocator.cpp`, and PyTorch's pluggable CUDA allocator's entry points (`defrag.install` of a
// CUDA pool) are `cuda_allocator.cpp`, both over `pool_allocator.h`, compiled in this same unit
// after this file.
//
// Also here: `swap_storages`, a compaction wave's storage swaps in one call
// (torch >= 2.13).
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>  // at::empty: included by other headers on newer torch, not on 2.11
#include <ATen/ops/from_blob.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <sys/stat.h>

#include <new>
#include <stdexcept>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <tuple>
#include <utility>
#include <vector>

#include "books.h"

namespace py = pybind11;
using defrag_native::Books;
using defrag_native::Heap;

namespace {

constexpr int64_t kAlignment = 512;  // defrag.heap.ALIGNMENT
constexpr int kMaxDims = 8;
constexpr int kDtypes = 64;
// How many times a thread Python never saw asks the pool to stock a range for it before it gives
// up: each time the range can be taken first by another thread of the same size (never by all).
constexpr int kNativeAttempts = 64;
// Events the allocator entries log for the pool's history before a placement waits for Python to take
// them (see place_for_allocator): 1 MiB of log at most between two syncs.
constexpr size_t kEventsBeforeSync = 32768;

struct State;

// One release for Python to apply. kind 0: a collected block (id: its serial);
// 1: a block of the Python path (id: the token Python gave, queue_python); 2: a
// range of a block Python never saw, to keep (size, region, address).
struct Entry {
  int kind;
  uint64_t id;
  int64_t size;
  int32_t region;
  uintptr_t address;
};

// One block made here: the deleter's context. Linked in State::fresh until
// Python collects it; after that only its serial matters.
struct Slot {
  std::shared_ptr<State> state;
  uintptr_t address = 0;
  int64_t size = 0;    // rounded to kAlignment: the heap's size
  int64_t nbytes = 0;  // what was asked for
  int32_t region = 0;
  int8_t dtype = 0;
  int8_t ndim = 0;
  bool collected = false;
  bool counted = false;  // in the allocation counters (only once its tensor exists)
  uint64_t serial = 0;
  PyObject* owner = nullptr;  // strong: the owner thread's weakref (defrag.threads.owner_ref())
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  std::array<int64_t, kMaxDims> shape{};
  Slot* prev = nullptr;
  Slot* next = nullptr;
};

struct State {
  std::shared_ptr<Books> books;  // its mutex guards everything here too
  Slot fresh;  // sentinel of the list of blocks Python has not collected
  // Releases Python must apply, in the order they happened (see Entry). While it is
  // not empty, a block Python never saw is queued too, and empty() declines: the
  // ranges then reach the books in release order, as on the Python path.
  std::vector<Entry> queue;
  std::vector<PyObject*> garbage;  // owner refs to drop when the GIL is next held
  int64_t allocs = 0, frees = 0, allocated = 0, peak = 0;  // since the last collect()
  int64_t live = 0;  // blocks made here whose storage lives (collected or not)
  uint64_t next_serial = 1;
  bool closed = false;
  PyObject* pool = nullptr;  // borrowed; strong (one reference) while live > 0
  // Blocks of PyTorch's CPU allocator (cpu_allocator.cpp) by address: their DataPtr's context must be
  // the data pointer itself (torch's copy-on-write checks it), so the deleter finds its slot here.
  std::unordered_map<uintptr_t, Slot*> by_address;
  int64_t allocator_blocks = 0;  // made for the CPU allocator, ever
  // While the pool records history: the allocator entries' blocks made and released here, in order,
  // as (1 alloc / 2 free, address, requested bytes, wall-clock microseconds), until Python takes them
  // (`FastPath::take_events`). Only a block's release before Python collected it is logged here: a
  // collected block's release reaches the pool's Python code, which records it.
  bool recording = false;
  std::vector<std::array<int64_t, 4>> events;
  int64_t events_lost = 0;  // no host memory to log them (never thrown from a deleter)
  explicit State(std::shared_ptr<Books> b) : books(std::move(b)) { fresh.prev = fresh.next = &fresh; }
};

// A block made here is whole (the books' mutex held): counted as an allocation, with its peak,
// and appended to the blocks Python has not collected yet.
void link_made_locked(State& st, Slot* s) {
  s->counted = true;
  s->prev = st.fresh.prev;
  s->next = &st.fresh;
  st.fresh.prev->next = s;
  st.fresh.prev = s;
  st.allocs += 1;
  st.allocated += s->size;
  if (st.allocated > st.peak) st.peak = st.allocated;
}

// Log one event of `st` for the pool's history (books' mutex held; see State::events). Never throws.
void log_event_locked(State& st, int64_t kind, uintptr_t address, int64_t nbytes) noexcept {
  const auto now = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch());
  try {
    st.events.push_back({kind, static_cast<int64_t>(address), nbytes, static_cast<int64_t>(now.count())});
  } catch (...) {
    st.events_lost += 1;
  }
}

void unlink(Slot* s) {
  if (s->prev == nullptr) return;  // never linked (its tensor was never finished)
  s->prev->next = s->next;
  s->next->prev = s->prev;
  s->prev = s->next = nullptr;
}

// The Python side of a release, with the GIL held: after close, let the pool
// give its memory back; when the last live block made here died, drop the pool
// reference that block held (see FastPath::empty), even if a new block raced in.
void pool_work(PyObject* pool, bool notify, bool last) {
  if (notify) {
    PyObject* result = PyObject_CallMethod(pool, "_release_after_close", nullptr);
    if (result == nullptr) {
      PyErr_WriteUnraisable(pool);  // never across the C boundary: logged by Python's hook
    } else {
      Py_DECREF(result);
    }
  }
  if (last) Py_DECREF(pool);
}

struct PoolWork {
  PyObject* pool;
  bool notify, last;
};

// A pending call (Py_AddPendingCall): runs in the main thread with the GIL held.
int run_pool_work(void* arg) {
  auto* work = static_cast<PoolWork*>(arg);
  pool_work(work->pool, work->notify, work->last);
  delete work;
  return 0;  // an error is already reported: a pending call must not leave one set
}

// A block made here is released (books' mutex held): back to the books, or queued for Python in
// order (see Entry). Returns whether it was the last live block made here; `notify`: the pool closed
// and must hear of it (a collected block's release).
bool release_locked(State& st, Slot* slot, bool& notify) {
  if (slot->collected) {
    st.queue.push_back(Entry{0, slot->serial, 0, 0, 0});
    notify = st.closed;
  } else {
    unlink(slot);
    if (st.queue.empty() && !st.books->held_locked()) {
      st.books->release_range_locked(slot->size, slot->region, static_cast<int64_t>(slot->address));
    } else {
      st.queue.push_back(Entry{2, 0, slot->size, slot->region, slot->address});
    }
    if (slot->counted) {
      st.frees += 1;
      st.allocated -= slot->size;
      if (st.recording) log_event_locked(st, 2, slot->address, slot->nbytes);
    }
    if (slot->owner != nullptr) st.garbage.push_back(slot->owner);
    slot->owner = nullptr;
  }
  return --st.live == 0;
}

// The Python side of a release, after the books' mutex is let go (see pool_work): nothing unless the
// last live block died or the pool closed. Never raises, never waits for the GIL in a thread Python
// never saw.
void after_release(State& st, bool last, bool notify) noexcept {
  if (!last && !notify) return;
  if (!Py_IsInitialized()) return;
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return;
#else
  if (_Py_IsFinalizing()) return;
#endif
  PyObject* pool = st.pool;
  if (pool == nullptr) return;
  if (PyGILState_GetThisThreadState() != nullptr) {
    // The usual case: a Python thread dropped the tensor (torch may have let go
    // of the GIL while it frees the storage; this thread takes it back).
    PyGILState_STATE gil = PyGILState_Ensure();
    pool_work(pool, notify, last);
    PyGILState_Release(gil);
    return;
  }
  // A thread Python never saw (a C++ worker freeing a tensor): never wait for the GIL here.
  // A thread that blocks on the GIL while the interpreter starts finalizing is
  // ended by Python (a forced unwind through this noexcept function, which
  // aborts the process). The main thread does the work at its next check for
  // pending calls; if it never comes (the process is exiting), nothing is lost.
  // Only for the last block, whose pool reference keeps the pool alive until
  // then: an earlier release after close needs nothing (the last one lets the
  // pool give everything back), and the pool it would name may be gone by then.
  if (!last) return;
  auto* work = new (std::nothrow) PoolWork{pool, notify, last};
  if (work == nullptr || Py_AddPendingCall(run_pool_work, work) != 0) {
    delete work;  // the queue is full: the pool reference stays (a leak, not a crash)
  }
}

// Runs when the storage of a block made here is freed: any thread, GIL or not.
void release_slot(void* ctx) noexcept {
  auto* slot = static_cast<Slot*>(ctx);
  std::shared_ptr<State> st = std::move(slot->state);
  bool last = false, notify = false;
  {
    std::lock_guard<std::mutex> guard(st->books->mu);
    last = release_locked(*st, slot, notify);
  }
  delete slot;
  after_release(*st, last, notify);
}

class FastPath {
 public:
  // books: the pool's books (the core's). gate_inside: the dict of the pool's Gate that names threads waiting at or
  // inside the gate (any entry makes the fast path decline). owner_ref: a
  // callable giving the calling thread's owner reference. dtypes: the torch
  // dtypes the pool hands out. stale_fd: a file whose allocated blocks mean a
  // stale access to report (-1: none). cuda_default_stream: the c10 stream
  // id of the CUDA device's default stream (ignored on CPU).
  FastPath(std::shared_ptr<Books> books, py::object pool, py::dict gate_inside, py::object owner_ref, py::list dtypes,
           std::string device_type, int device_index, int stale_fd, int64_t cuda_default_stream)
      : st_(std::make_shared<State>(std::move(books))),
        gate_inside_(gate_inside),
        owner_ref_(owner_ref),
        stale_fd_(stale_fd),
        cuda_default_stream_(cuda_default_stream) {
    st_->pool = pool.ptr();
    cuda_ = device_type == "cuda";
    device_ = cuda_ ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index))
                    : c10::Device(c10::DeviceType::CPU);
    dtype_objects_.fill(nullptr);
    for (py::handle d : dtypes) {
      if (!THPDtype_Check(d.ptr())) throw py::type_error("dtypes must be torch.dtype objects");
      int st = static_cast<int>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
      if (st < 0 || st >= kDtypes) continue;
      dtype_objects_[st] = d.ptr();
      Py_INCREF(d.ptr());
    }
    owner_key_ = py::str("defrag.fastpath.owner");
  }

  ~FastPath() {
    for (PyObject* d : dtype_objects_) Py_XDECREF(d);
  }

  std::atomic<bool> enabled{false};  // read by threads Python never saw
  // Whether PyTorch's allocator entries (cpu_allocator.cpp, cuda_allocator.cpp) may place blocks: as
  // `enabled`, but on while the pool records history (they log to State::events; `empty` and
  // `native_empty` leave it to the Python path, which records each allocation's frames).
  std::atomic<bool> serves_allocator{false};
  // Releases Python has taken from the queue but not applied yet (they wait for its next drain):
  // declining until then keeps the ranges reaching the books in release order, as on the Python path.
  bool backlog = false;
  int64_t hits = 0, misses = 0;                       // the Python-facing empty (GIL held)
  std::atomic<int64_t> native_hits{0}, native_misses{0};  // native_empty (any thread)

  // pool.empty(*shape, dtype=dtype) when it is the common case, else None.
  py::object empty(py::tuple args, py::handle dtype) {
    PyObject* tensor = try_empty(PySequence_Fast_ITEMS(args.ptr()), PyTuple_GET_SIZE(args.ptr()), dtype.ptr());
    if (tensor != nullptr) return py::reinterpret_steal<py::object>(tensor);
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::none();
  }

  // The fast path's `empty` over the shape's items (as `pool.empty` received them: ints, or one
  // tuple, list or torch.Size): a new reference to the tensor, or nullptr for a miss (no error
  // set) or, only if wrapping the finished tensor fails, with the error set.
  PyObject* try_empty(PyObject* const* items, Py_ssize_t nitems, PyObject* dtype) {
    if (!enabled || backlog || PyDict_GET_SIZE(gate_inside_.ptr()) != 0) return miss();
    if (stale_fd_ >= 0) {
      struct stat info;
      if (fstat(stale_fd_, &info) != 0 || info.st_blocks != 0) return miss();
    }
    std::array<int64_t, kMaxDims> shape{};
    int ndim = 0;
    int64_t numel = 1;
    if (!parse_shape(items, nitems, shape, ndim, numel)) return miss();
    c10::ScalarType stype;
    if (dtype == Py_None) {
      stype = c10::typeMetaToScalarType(c10::get_default_dtype());
    } else if (THPDtype_Check(dtype)) {
      stype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    } else {
      return miss();
    }
    int st_index = static_cast<int>(stype);
    if (st_index < 0 || st_index >= kDtypes || dtype_objects_[st_index] == nullptr) return miss();
    int64_t nbytes;
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(stype)), &nbytes) || nbytes <= 0 ||
        nbytes > (int64_t(1) << 62))
      return miss();
    if (cuda_ && !on_default_stream()) return miss();
    PyObject* owner = current_owner();
    if (owner == nullptr) return miss();
    drop_garbage();
    int64_t size = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    Py_INCREF(owner);  // the slot's from here (dropped with the GIL: `garbage`)
    at::Tensor tensor = make_block_tensor(size, nbytes, stype, shape, ndim, owner, /*foreign=*/false);
    if (!tensor.defined()) return miss();
    hits += 1;
    return THPVariable_Wrap(std::move(tensor));
  }

  // A tensor of `nbytes` bytes (uint8) over the books for a thread Python never saw: no GIL, no
  // Python, unless pages must be mapped or the ladder must climb: then it takes the GIL and asks
  // the pool (`Pool._stock_for_native`, which places a block through the ladder and keeps its range
  // for this size), and places again. Undefined when the pool cannot serve it (closed, asleep, out
  // of memory, or every range it stocked was taken by other threads first). Only while a
  // lease is held (`churn`): the pool then outlives every block made here without a Python
  // reference taken here. Blocks made here belong to no Python thread: when the core records them
  // they are pinned (a compaction never moves what such a thread may be using).
  at::Tensor native_empty(int64_t nbytes) {
    if (nbytes <= 0) return at::Tensor();
    const int64_t size = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    std::array<int64_t, kMaxDims> shape{};
    shape[0] = nbytes;
    for (int attempt = 0; attempt <= kNativeAttempts; ++attempt) {
      if (enabled.load()) {
        at::Tensor tensor = make_block_tensor(size, nbytes, c10::ScalarType::Byte, shape, 1, nullptr, true);
        if (tensor.defined()) {
          native_hits += 1;
          return tensor;
        }
      }
      if (attempt == kNativeAttempts) break;
      native_misses += 1;
      PyGILState_STATE gil = PyGILState_Ensure();
      PyObject* done = PyObject_CallMethod(st_->pool, "_stock_for_native", "L", static_cast<long long>(nbytes));
      bool stocked = done != nullptr && PyObject_IsTrue(done) == 1;
      if (done == nullptr) PyErr_Clear();  // the ladder's error (an OOM): this allocation fails
      Py_XDECREF(done);
      PyGILState_Release(gil);
      if (!stocked) break;
    }
    return at::Tensor();
  }

  // Why `place_for_allocator` placed nothing.
  enum class Refusal { kNone, kHeld, kQueued, kNoRoom, kNoLease };

  // A block of `nbytes` for PyTorch's CPU allocator (cpu_allocator.cpp): any thread, no GIL, one
  // critical section under the books' mutex. Placed like `native_empty`'s (same slot, counters and
  // list: the core records it at its next sync, pinned, since it has no owner: PyTorch holds its raw
  // pointer and it must never move) and found again by its address (`State::by_address`). Its
  // address, or 0 with the reason: Python holds the books, releases wait for Python, no lease (no
  // install holds the pool), or pages must be mapped.
  uintptr_t place_for_allocator(int64_t nbytes, Refusal& why) {
    const int64_t size = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    auto* slot = new Slot();  // before the mutex: the one step that may throw (std::bad_alloc)
    slot->size = size;
    slot->nbytes = nbytes;
    slot->dtype = static_cast<int8_t>(static_cast<int>(c10::ScalarType::Byte));
    slot->ndim = 1;
    slot->shape[0] = nbytes;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      // While recording, a log that Python has not taken for kEventsBeforeSync events also waits for
      // Python (`kQueued`: the pool's next sync takes them), so it stays bounded between syncs.
      why = st_->books->held_locked() ? Refusal::kHeld
            : !st_->queue.empty() || (st_->recording && st_->events.size() >= kEventsBeforeSync) ? Refusal::kQueued
            : st_->live == 0          ? Refusal::kNoLease  // the pool reference is taken only with the GIL
                                      : Refusal::kNone;
      std::optional<std::pair<int, int64_t>> where;
      if (why == Refusal::kNone) {
        try {
          where = st_->books->place_mapped_locked(size);
        } catch (...) {  // books that disagree with themselves: the Python path reports it
          where.reset();
        }
        if (!where) why = Refusal::kNoRoom;
      }
      if (where) {
        slot->region = where->first;
        slot->address = static_cast<uintptr_t>(where->second);
        try {
          st_->by_address.emplace(slot->address, slot);
        } catch (...) {  // no host memory for the map: the range goes back, the caller sees bad_alloc
          st_->books->release_range_locked(size, slot->region, where->second);
          delete slot;
          throw;
        }
        slot->serial = st_->next_serial++;
        link_made_locked(*st_, slot);
        st_->live += 1;
        st_->allocator_blocks += 1;
        if (st_->recording) log_event_locked(*st_, 1, slot->address, nbytes);
        return slot->address;
      }
    }
    delete slot;
    return 0;
  }

  State& state() { return *st_; }
  const std::shared_ptr<State>& shared_state() const { return st_; }

  // Threads Python never saw, allocating and dropping (the benchmark's and the tests' C++ threads):
  // `threads` std::threads, each `iterations` times replacing one of `live` slots (round robin)
  // with a new uint8 tensor of the next of `sizes` bytes (each thread from its own offset), over
  // this pool's books (`native`: native_empty) or torch's own allocator (at::empty on this device).
  // `verify`: every tensor is filled with a byte of its own and checked whole, through the pointer
  // the thread kept, before it is dropped (a tensor moved meanwhile counts as corrupted). Holds a lease (the pool outlives every block made meanwhile) and releases the GIL.
  // Returns (seconds of wall time, failed allocations, corrupted tensors).
  py::tuple churn(std::vector<int64_t> sizes, int64_t iterations, int threads, int live, bool native, bool verify) {
    if (sizes.empty() || iterations < 0 || threads < 1 || live < 1)
      throw py::value_error("churn needs sizes, iterations >= 0, threads >= 1 and live >= 1");
    for (int64_t n : sizes)
      if (n <= 0) throw py::value_error("churn: every size must be positive");
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      if (st_->live++ == 0) Py_INCREF(st_->pool);  // the lease
    }
    std::atomic<int64_t> failed{0}, corrupted{0};
    double seconds = 0;
    {
      py::gil_scoped_release unlocked;
      auto work = [&](int t) {
        std::vector<at::Tensor> slots(static_cast<size_t>(live));
        std::vector<uint8_t> marks(static_cast<size_t>(live), 0);
        std::vector<const uint8_t*> where(static_cast<size_t>(live), nullptr);  // as a C++ user keeps it
        const at::TensorOptions options = at::TensorOptions().dtype(at::kByte).device(device_);
        for (int64_t i = 0; i < iterations; ++i) {
          const size_t j = static_cast<size_t>(i % live);
          const int64_t n = sizes[static_cast<size_t>((i + t * 7) % static_cast<int64_t>(sizes.size()))];
          if (verify && slots[j].defined()) {
            const uint8_t* p = where[j];
            bool intact = slots[j].data_ptr() == p;  // moved under it: the raw pointer it kept is stale
            for (int64_t k = 0; intact && k < slots[j].numel(); ++k) intact = p[k] == marks[j];
            if (!intact) corrupted += 1;
          }
          slots[j] = native ? native_empty(n) : at::empty({n}, options);
          if (!slots[j].defined()) {
            failed += 1;
            continue;
          }
          if (verify) {
            marks[j] = static_cast<uint8_t>(t * 31 + i);
            where[j] = static_cast<const uint8_t*>(slots[j].data_ptr());
            std::memset(slots[j].data_ptr(), marks[j], static_cast<size_t>(n));
          }
        }
      };
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
      for (auto& th : pool) th.join();
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    bool last;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      last = --st_->live == 0;
    }
    if (last) Py_DECREF(st_->pool);
    return py::make_tuple(seconds, failed.load(), corrupted.load());
  }

  // `storage` for many blocks in one call (a compaction wave's destinations): (storages, first
  // serial); the i-th storage's serial is first + i.
  py::tuple storages(const std::vector<uintptr_t>& addresses, const std::vector<int64_t>& nbytes) {
    if (addresses.size() != nbytes.size()) throw py::value_error("storages: addresses and nbytes differ in length");
    for (int64_t n : nbytes)
      if (n <= 0) throw py::value_error("a pool storage needs at least one byte");
    const size_t n = addresses.size();
    uint64_t first;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      first = st_->next_serial;
      st_->next_serial += n;
      if (n > 0 && st_->live == 0) Py_INCREF(st_->pool);
      st_->live += static_cast<int64_t>(n);
    }
    py::list out(n);
    for (size_t i = 0; i < n; ++i) {
      auto* slot = new Slot();
      slot->state = st_;
      slot->address = addresses[i];
      slot->collected = true;
      slot->serial = first + i;
      // From here the storage owns the slot: if anything below fails, its deleter queues the
      // serial, which Python, not knowing it, ignores.
      c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes[i],
                           c10::DataPtr(reinterpret_cast<void*>(addresses[i]), slot, &release_slot, device_), nullptr,
                           false);
      PyObject* wrapped = THPStorage_Wrap(std::move(storage));
      if (wrapped == nullptr) {
        // The storages not made yet were counted live: give those counts back (no slot will).
        bool last;
        {
          std::lock_guard<std::mutex> guard(st_->books->mu);
          st_->live -= static_cast<int64_t>(n - i - 1);
          last = n - i - 1 > 0 && st_->live == 0;
        }
        if (last) Py_DECREF(st_->pool);
        throw py::error_already_set();
      }
      out[i] = py::reinterpret_steal<py::object>(wrapped);
    }
    return py::make_tuple(out, first);
  }

  // A compaction wave's commit, for storages whose memory this object made: `users[i]` moves
  // from `old_addresses[i]` to `new_addresses[i]` (the copy is done; the books hold the new
  // range and took the old one back). Every user is checked first: an UntypedStorage on this
  // device whose memory is a collected block made here, at its old address. Then each gets a
  // DataPtr over its new address with its own slot, re-addressed (its serial kept: Python's block
  // for that serial is re-addressed, not replaced); nothing is released (the books took the old
  // range back).
  // Returns -1; i when user i is not at its old address or not of `nbytes[i]` bytes; -2 when
  // some user's memory was not made here (the caller swaps through temporary storages instead).
  // Nothing changes unless all pass.
  int64_t rebase(const py::list& users, const std::vector<uintptr_t>& new_addresses,
                   const std::vector<uintptr_t>& old_addresses, const std::vector<int64_t>& nbytes) {
    const size_t n = users.size();
    if (new_addresses.size() != n || old_addresses.size() != n || nbytes.size() != n)
      throw py::value_error("rebase: users, addresses and nbytes differ in length");
    // In passes, each over independent loads (the storages, then their DataPtrs, then the slots):
    // after the wave's copy these are cold in the caches, and loads that do not wait on each
    // other overlap.
    std::vector<c10::StorageImpl*> impls(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* user = users[i].ptr();
      if (!THPStorage_Check(user)) throw py::value_error("rebase: expects UntypedStorages");
      impls[i] = THPStorage_Unpack(user).unsafeGetStorageImpl();
    }
    std::vector<Slot*> olds(n);
    for (size_t i = 0; i < n; ++i) {
      const c10::DataPtr& data = impls[i]->data_ptr();
      if (data.get_deleter() != &release_slot || data.device() != device_) return -2;
      if (reinterpret_cast<uintptr_t>(data.get()) != old_addresses[i] ||
          static_cast<int64_t>(impls[i]->nbytes()) != nbytes[i])
        return static_cast<int64_t>(i);
      olds[i] = static_cast<Slot*>(data.get_context());
    }
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);  // slots' fields are read and written under it
      for (size_t i = 0; i < n; ++i) {
        const Slot* slot = olds[i];
        if (slot->state != st_ || !slot->collected) return -2;
        if (slot->address != old_addresses[i]) return static_cast<int64_t>(i);
      }
      // All pass. Each storage keeps its slot (serial, size, region), now at its new address:
      // nothing is allocated, so nothing below can fail.
      for (size_t i = 0; i < n; ++i) olds[i]->address = new_addresses[i];
    }
    for (size_t i = 0; i < n; ++i) {
      c10::DataPtr old = impls[i]->set_data_ptr(
          c10::DataPtr(reinterpret_cast<void*>(new_addresses[i]), olds[i], &release_slot, device_));
      old.release_context();  // the same slot: the storage's new DataPtr owns it
    }
    return -1;
  }

  // An UntypedStorage of `nbytes` at `address` for a block Python placed itself
  // (compaction destinations, adopt): (storage, serial). Its release is queued
  // by serial like a collected block's; the caller maps the serial to its block
  // before the storage can die. Cheaper than a Python owner with a weakref hook.
  py::tuple storage(uintptr_t address, int64_t nbytes) {
    py::tuple made = storages({address}, {nbytes});
    return py::make_tuple(made[0].cast<py::list>()[0], made[1]);
  }

  // A release of the Python path's (token: Python's name for the block), queued
  // in order with this object's own (any thread, with the GIL).
  void queue_python(uint64_t token) {
    std::lock_guard<std::mutex> guard(st_->books->mu);
    st_->queue.push_back(Entry{1, token, 0, 0, 0});
  }

  // What happened since the last call: (made, released, allocs, frees, peak).
  // made: (address, size, nbytes, region, serial, owner_ref, weak_storage_cdata,
  // dtype, shape) per block made here that Python has not seen; from now on its
  // release is reported as its serial. released: the queued releases in order,
  // (0, serial), (1, token) or (2, size, region, address) (see Entry).
  // weak_storage_cdata is a weak reference the caller owns
  // (StorageWeakRef.from_weakref). peak: the highest allocated bytes reached
  // above the count at the previous call.
  py::tuple collect() {
    struct Made {
      uintptr_t address;
      int64_t size, nbytes;
      int32_t region;
      uint64_t serial;
      PyObject* owner;
      c10::StorageImpl* weak;
      int8_t dtype, ndim;
      std::array<int64_t, kMaxDims> shape;
    };
    std::vector<Made> made;
    std::vector<Entry> released;
    int64_t allocs, frees, peak;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      for (Slot* s = st_->fresh.next; s != &st_->fresh;) {
        Slot* next = s->next;
        // Python now owns one weak reference and the owner reference.
        made.push_back(Made{s->address, s->size, s->nbytes, s->region, s->serial, s->owner,
                            c10::weak_intrusive_ptr<c10::StorageImpl>(s->storage).release(), s->dtype, s->ndim,
                            s->shape});
        s->owner = nullptr;
        s->collected = true;
        unlink(s);
        s = next;
      }
      released.swap(st_->queue);
      allocs = st_->allocs;
      frees = st_->frees;
      peak = st_->peak;
      st_->allocs = st_->frees = st_->allocated = st_->peak = 0;
    }
    drop_garbage();
    py::list made_list(made.size());
    for (size_t i = 0; i < made.size(); ++i) {
      const Made& m = made[i];
      py::tuple shape(m.ndim);
      for (int d = 0; d < m.ndim; ++d) shape[d] = py::int_(m.shape[d]);
      made_list[i] = py::make_tuple(m.address, m.size, m.nbytes, m.region, m.serial,
                                    m.owner != nullptr ? py::reinterpret_steal<py::object>(m.owner) : py::none(),
                                    reinterpret_cast<uintptr_t>(m.weak),
                                    py::reinterpret_borrow<py::object>(dtype_objects_[m.dtype]), shape);
    }
    return py::make_tuple(made_list, entries(released), allocs, frees, peak);
  }

  // Only the queued releases (see collect()) and the peak so far: (released, peak). Blocks made here
  // stay uncollected. The peak restarts at the bytes allocated here now: Python applies the releases
  // next, which lowers the count the next peak is measured from (a peak reached before them would
  // otherwise be measured from the lower count).
  py::tuple collect_released() {
    std::vector<Entry> released;
    int64_t peak;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      released.swap(st_->queue);
      peak = st_->peak;
      st_->peak = st_->allocated;
    }
    return py::make_tuple(entries(released), peak);
  }

  // The pool closed: no more fast allocations; every later release of a
  // collected block calls pool._release_after_close() (with the GIL).
  void close() {
    enabled = false;
    serves_allocator = false;
    std::lock_guard<std::mutex> guard(st_->books->mu);
    st_->closed = true;
  }

  // Start (true) or stop logging the allocator entries' blocks for the pool's history; either way the
  // events not taken yet are dropped (with the GIL).
  void set_recording(bool on) {
    std::lock_guard<std::mutex> guard(st_->books->mu);
    st_->recording = on;
    st_->events.clear();
    st_->events.shrink_to_fit();
  }

  // The events logged since the last call, oldest first: [(kind, address, nbytes, time_us)], kind 1
  // an allocation, 2 a release; and how many could not be logged, ever (with the GIL).
  py::tuple take_events() {
    std::vector<std::array<int64_t, 4>> taken;
    int64_t lost;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      taken.swap(st_->events);
      lost = st_->events_lost;
    }
    py::list out(taken.size());
    for (size_t i = 0; i < taken.size(); ++i) {
      const auto& e = taken[i];
      out[i] = py::make_tuple(e[0], e[1], e[2], e[3]);
    }
    return py::make_tuple(out, lost);
  }

  int64_t live() {
    std::lock_guard<std::mutex> guard(st_->books->mu);
    return st_->live;
  }

 private:
  // Place a block of `size` (rounded; `nbytes` asked) in mapped free space and make a tensor of
  // `shape` over it whose deleter gives the range back; undefined when the books cannot place it now
  // (Python holds them, releases wait in the queue, pages must be mapped, or, for a foreign thread,
  // no lease). `owner`: a strong reference the slot takes over (nullptr: a thread Python never saw;
  // it is handed back with the GIL held on failure too, through `garbage`).
  at::Tensor make_block_tensor(int64_t size, int64_t nbytes, c10::ScalarType stype,
                               const std::array<int64_t, kMaxDims>& shape, int ndim, PyObject* owner, bool foreign) {
    auto* slot = new Slot();
    slot->state = st_;
    slot->size = size;
    slot->nbytes = nbytes;
    slot->dtype = static_cast<int8_t>(static_cast<int>(stype));
    slot->ndim = static_cast<int8_t>(ndim);
    slot->shape = shape;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      // Queued releases first (Python applies them: Pool._refill); then the books place it, or
      // pages must be mapped (Python's ladder).
      std::optional<std::pair<int, int64_t>> where;
      if (st_->queue.empty() && !st_->books->held_locked() && !(foreign && st_->live == 0)) {
        try {
          where = st_->books->place_mapped_locked(size);
        } catch (...) {  // books that disagree with themselves: the Python path reports it
          where.reset();
        }
      }
      if (!where) {
        if (owner != nullptr) st_->garbage.push_back(owner);
        delete slot;
        return at::Tensor();
      }
      slot->region = where->first;
      slot->address = static_cast<uintptr_t>(where->second);
      slot->serial = st_->next_serial++;
      st_->books->begin_placing_locked();  // `hold` waits until the block is linked below
      // Holding the pool before the tensor exists: if making it throws, the deleter that torch
      // then runs puts the range back like any release of an uncounted block. A foreign thread
      // never takes the first reference (it needs the GIL): it holds a lease, so live > 0 here.
      if (st_->live++ == 0) Py_INCREF(st_->pool);
    }
    at::Tensor tensor;
    try {
      std::array<int64_t, kMaxDims> strides{};
      int64_t stride = 1;
      for (int d = ndim - 1; d >= 0; --d) {
        strides[d] = stride;
        stride *= shape[d] > 1 ? shape[d] : 1;
      }
      tensor = at::for_blob(reinterpret_cast<void*>(slot->address), c10::IntArrayRef(shape.data(), ndim))
                   .strides(c10::IntArrayRef(strides.data(), ndim))
                   .context(slot, &release_slot)
                   .options(at::TensorOptions().dtype(stype).device(device_))
                   .target_device(device_)
                   .make_tensor();
    } catch (...) {
      // The slot is gone with the context torch dropped (release_slot ran, before it was linked).
      std::lock_guard<std::mutex> guard(st_->books->mu);
      if (owner != nullptr) st_->garbage.push_back(owner);
      st_->books->end_placing_locked();
      return at::Tensor();
    }
    slot->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(tensor.storage().getWeakStorageImpl());
    {
      // Linked only now, counted: `collect()` (another thread, with the GIL) sees it whole or not at all.
      std::lock_guard<std::mutex> guard(st_->books->mu);
      slot->owner = owner;
      link_made_locked(*st_, slot);
      st_->books->end_placing_locked();
    }
    return tensor;
  }

  static py::list entries(const std::vector<Entry>& queue) {
    py::list out(queue.size());
    for (size_t i = 0; i < queue.size(); ++i) {
      const Entry& e = queue[i];
      if (e.kind == 2) {
        out[i] = py::make_tuple(e.kind, e.size, e.region, e.address);
      } else {
        out[i] = py::make_tuple(e.kind, e.id);
      }
    }
    return out;
  }

  PyObject* miss() {
    misses += 1;
    return nullptr;
  }

  // args: the shape as pool.empty received it (ints, or one tuple/list/torch.Size of ints).
  static bool parse_shape(PyObject* const* items, Py_ssize_t n, std::array<int64_t, kMaxDims>& shape, int& ndim,
                          int64_t& numel) {
    if (n == 1 && !PyLong_CheckExact(items[0])) {
      PyObject* seq = items[0];
      if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;  // torch.Size is a tuple subclass
      n = PySequence_Fast_GET_SIZE(seq);
      items = PySequence_Fast_ITEMS(seq);
    }
    if (n > kMaxDims) return false;
    numel = 1;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyLong_CheckExact(items[i])) return false;
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
      if (overflow || v <= 0) return false;  // zero-size and negative sizes: the Python path
      shape[i] = v;
      if (__builtin_mul_overflow(numel, static_cast<int64_t>(v), &numel)) return false;
    }
    ndim = static_cast<int>(n);
    return true;
  }

  bool on_default_stream() {
    try {
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      return impl->getStream(device_).id() == cuda_default_stream_;
    } catch (...) {
      return false;
    }
  }

  // The calling thread's owner reference (borrowed), cached in the thread state's dict.
  PyObject* current_owner() {
    PyObject* dict = PyThreadState_GetDict();
    if (dict == nullptr) return nullptr;
    PyObject* ref = PyDict_GetItemWithError(dict, owner_key_.ptr());
    if (ref != nullptr) return ref;
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return nullptr;
    }
    PyObject* made = PyObject_CallNoArgs(owner_ref_.ptr());
    if (made == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    int failed = PyDict_SetItem(dict, owner_key_.ptr(), made);
    Py_DECREF(made);
    if (failed) {
      PyErr_Clear();
      return nullptr;
    }
    return PyDict_GetItemWithError(dict, owner_key_.ptr());
  }

  void drop_garbage() {
    std::vector<PyObject*> garbage;
    {
      std::lock_guard<std::mutex> guard(st_->books->mu);
      if (st_->garbage.empty()) return;
      garbage.swap(st_->garbage);
    }
    for (PyObject* o : garbage) Py_DECREF(o);
  }

  std::shared_ptr<State> st_;
  py::dict gate_inside_;
  py::object owner_ref_;
  py::str owner_key_;
  int stale_fd_;
  int64_t cuda_default_stream_;
  bool cuda_ = false;
  c10::Device device_{c10::DeviceType::CPU};
  std::array<PyObject*, kDtypes> dtype_objects_{};
};

// `pool.empty` bound to one pool as a C function (`FastPath.bind_empty`): the fast path's `empty`
// straight from the call, without the Python method's frame or pybind11's dispatch. Any call it
// does not serve (a keyword other than dtype or a false requires_grad, a miss) goes to
// `fallback(pool, *args, **kwargs)` unchanged, which does everything else, errors included.
struct EmptyBinding {
  FastPath* fast;
  PyObject* fast_object;  // strong: keeps `fast` alive
  PyObject* fallback;     // strong: a plain function (Pool's), never a bound method (no cycle)
  PyObject* pool_ref;     // strong: a weak reference to the pool
};

constexpr const char* kEmptyCapsule = "defrag.native.EmptyBinding";

PyObject* bound_empty(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* b = static_cast<EmptyBinding*>(PyCapsule_GetPointer(self, kEmptyCapsule));
  if (b == nullptr) return nullptr;
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  PyObject* dtype = Py_None;
  bool plain = true;
  for (Py_ssize_t i = 0; i < nkw && plain; ++i) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, i);
    PyObject* value = args[nargs + i];
    if (PyUnicode_CompareWithASCIIString(name, "dtype") == 0) {
      dtype = value;
    } else if (PyUnicode_CompareWithASCIIString(name, "requires_grad") == 0) {
      plain = value == Py_False;
    } else {
      plain = false;
    }
  }
  if (plain) {
    PyObject* tensor = b->fast->try_empty(args, nargs, dtype);
    if (tensor != nullptr || PyErr_Occurred()) return tensor;
  }
  PyObject* pool = PyObject_CallNoArgs(b->pool_ref);  // the pool holds this function: alive while called
  if (pool == nullptr) return nullptr;
  if (pool == Py_None) {
    Py_DECREF(pool);
    PyErr_SetString(PyExc_ReferenceError, "the pool of this empty() is gone");
    return nullptr;
  }
  std::vector<PyObject*> full(static_cast<size_t>(nargs + nkw + 1));
  full[0] = pool;
  for (Py_ssize_t i = 0; i < nargs + nkw; ++i) full[i + 1] = args[i];
  PyObject* out = PyObject_Vectorcall(b->fallback, full.data(), static_cast<size_t>(nargs + 1), kwnames);
  Py_DECREF(pool);
  return out;
}

PyMethodDef kBoundEmptyDef = {
    "empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&bound_empty)),
    METH_FASTCALL | METH_KEYWORDS,
    "empty(*shape, dtype=None, requires_grad=False): an uninitialized tensor over pool memory "
    "(defrag.Pool.empty, served in C++ when mapped free space holds it)."};

py::object bind_empty(py::object fast_object, py::object fallback, py::object pool_ref) {
  auto* b = new EmptyBinding{fast_object.cast<FastPath*>(), fast_object.release().ptr(), fallback.release().ptr(),
                             pool_ref.release().ptr()};
  PyObject* capsule = PyCapsule_New(b, kEmptyCapsule, [](PyObject* c) {
    auto* binding = static_cast<EmptyBinding*>(PyCapsule_GetPointer(c, kEmptyCapsule));
    Py_XDECREF(binding->fast_object);
    Py_XDECREF(binding->fallback);
    Py_XDECREF(binding->pool_ref);
    delete binding;
  });
  if (capsule == nullptr) {
    Py_DECREF(b->fast_object);
    Py_DECREF(b->fallback);
    Py_DECREF(b->pool_ref);
    delete b;
    throw py::error_already_set();
  }
  PyObject* function = PyCFunction_NewEx(&kBoundEmptyDef, capsule, nullptr);
  Py_DECREF(capsule);
  if (function == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(function);
}

// PyTorch's CPU allocator and CUDA entry points over pools' books: `cpu_allocator.cpp` and
// `cuda_allocator.cpp` (later sources, same unit).
void bind_cpu_allocator(py::module_& m);
void bind_cuda_allocator(py::module_& m);

}  // namespace

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define DEFRAG_SWAP_STORAGES 1
// A compaction wave's commit: for every i, `users[i]._swap_data_ptr_(dests[i])`
// (the same `c10::Storage::swap_data_ptr` torch's method calls), but only once
// every pair passed its check: same device, same nbytes, and `users[i]` still
// starting at `addresses[i]`. Returns -1 when all were swapped, else the index
// of the first pair that failed (nothing swapped). Raises (nothing swapped) on
// arguments that are not lists of storages of one length. Storages made by
// defrag are never copy-on-write, so a swap cannot throw once the checks pass.
py::int_ swap_storages(const py::list& users, const py::list& dests, const py::list& addresses) {
  const size_t n = users.size();
  if (dests.size() != n || addresses.size() != n) {
    throw std::invalid_argument("swap_storages: users, dests and addresses differ in length");
  }
  std::vector<const c10::Storage*> mine(n), theirs(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* user = users[i].ptr();
    PyObject* dest = dests[i].ptr();
    if (!THPStorage_Check(user) || !THPStorage_Check(dest)) {
      throw std::invalid_argument("swap_storages: expects UntypedStorages");
    }
    const c10::Storage& a = THPStorage_Unpack(user);
    const c10::Storage& b = THPStorage_Unpack(dest);
    auto address = addresses[i].cast<uintptr_t>();
    if (a.device() != b.device() || a.nbytes() != b.nbytes() ||
        reinterpret_cast<uintptr_t>(a.data_ptr().get()) != address) {
      return py::int_(static_cast<int64_t>(i));
    }
    mine[i] = &a;
    theirs[i] = &b;
  }
  for (size_t i = 0; i < n; ++i) {
    mine[i]->swap_data_ptr(const_cast<c10::Storage&>(*theirs[i]));
  }
  return py::int_(-1);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  defrag_native::bind_heap(m);
  defrag_native::bind_planner(m);
  defrag_native::bind_plan_attempt(m);
  auto books_class = py::class_<Books, std::shared_ptr<Books>>(m, "Books", "A pool's books (see books.h): heaps, page counts, kept ranges.")
      .def(py::init<int64_t>(), py::arg("page_size"))
      .def("add_region", &Books::add_region, py::arg("heap"), py::arg("base"), py::arg("npages"))
      .def("counts",
           [](std::shared_ptr<Books> self, int region) {
             // A numpy view of the region's page counts, keeping the books alive.
             int64_t* data = self->counts(region);
             auto* keep = new std::shared_ptr<Books>(self);
             py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<Books>*>(p); });
             return py::array_t<int64_t>({self->npages(region)}, {static_cast<py::ssize_t>(sizeof(int64_t))}, data,
                                         base);
           })
      .def_property_readonly("empty", &Books::empty)
      .def("add_empty", &Books::add_empty)
      .def("account", &Books::account)
      .def("account_many", &Books::account_many)
      .def("take", &Books::take)
      .def("kept_count", &Books::kept_count)
      .def("flush_kept", &Books::flush_kept)
      .def("release_range", &Books::release_range)
      .def("hold", &Books::hold, py::call_guard<py::gil_scoped_release>())
      .def("unhold", &Books::unhold);
  defrag_native::bind_books_mesh(books_class);
#ifdef DEFRAG_SWAP_STORAGES
  m.def("swap_storages", &swap_storages, "A compaction wave's storage swaps, after every check (see the source).");
#endif
  py::class_<FastPath>(m, "FastPath")
      .def(py::init<std::shared_ptr<Books>, py::object, py::dict, py::object, py::list, std::string, int, int, int64_t>())
      .def("empty", &FastPath::empty)
      .def("churn", &FastPath::churn, py::arg("sizes"), py::arg("iterations"), py::arg("threads") = 1,
           py::arg("live") = 32, py::arg("native") = true, py::arg("verify") = false)
      .def("bind_empty", [](py::object self, py::object fallback, py::object pool_ref) {
        return bind_empty(self, fallback, pool_ref);
      })
      .def("storage", &FastPath::storage)
      .def("storages", &FastPath::storages)
      .def("rebase", &FastPath::rebase)
      .def("collect", &FastPath::collect)
      .def("collect_released", &FastPath::collect_released)
      .def("queue_python", &FastPath::queue_python)
      .def("close", &FastPath::close)
      .def("live", &FastPath::live)
      .def_property(
          "enabled", [](const FastPath& f) { return f.enabled.load(); },
          [](FastPath& f, bool on) { f.enabled.store(on); })
      .def_property(
          "serves_allocator", [](const FastPath& f) { return f.serves_allocator.load(); },
          [](FastPath& f, bool on) { f.serves_allocator.store(on); })
      .def("set_recording", &FastPath::set_recording, py::arg("on"))
      .def("take_events", &FastPath::take_events)
      .def_property_readonly("native_hits", [](const FastPath& f) { return f.native_hits.load(); })
      .def_property_readonly("native_misses", [](const FastPath& f) { return f.native_misses.load(); })
      .def_readwrite("backlog", &FastPath::backlog)
      .def_readonly("hits", &FastPath::hits)
      .def_readonly("misses", &FastPath::misses);
  bind_cpu_allocator(m);
  bind_cuda_allocator(m);
}
