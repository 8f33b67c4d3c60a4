// defrag's native module: the pool's books (`books.h`, over `heap.h`) and the fast path, the
// tensors and storages made over the books' records in C++.
//
// The books hold the one record of every block (`Record`); this file makes torch tensors and
// storages over records and gives each storage a deleter (`release_record`) that hands the record
// back to the books without the GIL, in whatever thread torch frees it. `FastPath` is that adaptor
// for one pool: `pool.empty()` of any size mapped free space holds, in one call (the books place
// the record: a kept range of the exact size, else best fit: `Books::place_mapped_locked`, the core's
// own placement when no page must be mapped; the tensor is made with `at::for_blob` over it), and
// tensors or storages over records the face's Python code placed (`tensor_over`, `storages`).
// PyTorch's CPU allocator (`cpu_allocator.cpp`) and pluggable CUDA allocator's entry points
// (`cuda_allocator.cpp`) place through the same books (`pool_allocator.h`), compiled in this same
// unit after this file.
//
// Guarantees (what the Python side relies on):
// - `empty()` never blocks and never raises: it returns None whenever the request is not the common
//   case (a thread is inside the books or waits to enter them, the fast path is disabled, pages
//   would have to be mapped, unusual arguments, a stale access to report, a non-default CUDA
//   stream), and the Python path then does everything, errors included.
// - A range handed out is never handed out again before its record is released; every release goes
//   straight to the books (or, while a thread is inside them, to their queue, applied in order when
//   it leaves). Python never applies a release and never has to be told of one.
// - The deleter takes only the books' mutex and never waits for the GIL. It runs Python only when
//   the last record a native context names goes (to drop the pool reference the books keep) and after
//   the pool closed (to call its close hook): at once, taking the GIL, in a Python thread; else as a
//   pending call the main thread runs at its next check (a C++ worker thread Python never saw: waiting
//   for the GIL there could abort the process if the interpreter began finalizing meanwhile). No
//   exception crosses it.
// - Native code calls no Python method by name: the pool registers what it must be asked or told
//   (`FastPath.set_room`: place a block through the ladder for a native caller; `Books.set_close_hook`).
//
// Also here: `swap_storages`, a compaction wave's storage swaps in one call (torch >= 2.13).
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>  // at::empty: included by other headers on newer torch, not on 2.11
#include <ATen/ops/from_blob.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

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
#include <unordered_set>
#include <tuple>
#include <utility>
#include <vector>

#include "books.h"

namespace py = pybind11;
using defrag_native::Aftermath;
using defrag_native::Books;
using defrag_native::Counters;
using defrag_native::Heap;
using defrag_native::kMaxDims;
using defrag_native::Origin;
using defrag_native::Record;

namespace {

constexpr int64_t kAlignment = 512;  // defrag.units.ALIGNMENT
constexpr int kDtypes = 64;
// Events the books log for the pool's history before an allocator entry's placement waits for Python
// to take them (see place_for_allocator): 1 MiB of log at most between two of Python's reads.
constexpr size_t kEventsBeforeSync = 32768;

bool python_exiting() {
  if (!Py_IsInitialized()) return true;
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A record's storage weak pointer (Record::storage) handed back: one weak count of ours.
void drop_storage_weak(void* impl) noexcept {
  c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim(static_cast<c10::StorageImpl*>(impl));
}

// The deleter of the DataPtrs PyTorch's CPU allocator entry makes over pool blocks (context == data:
// `cpu_allocator.cpp`'s free_pooled), registered when that entry is bound: how an owner match and a
// compaction's rebase recognize a storage that owns a PyTorch-made block (see `FastPath::match_owners`).
std::atomic<c10::DeleterFnPtr> g_allocator_deleter{nullptr};

// The Python threads that ever placed a block through PyTorch's allocator entries (their Linux thread
// ids, noted once per thread, on its first allocation): at a safe point another of them still running
// may be in the middle of an operation holding raw addresses (defrag.owners). Threads Python never
// saw (a parallel region's workers, autograd's device threads) work for a Python thread's operation and
// are not noted.
std::mutex g_allocating_threads_mu;
std::vector<int64_t> g_allocating_threads;
thread_local bool t_allocating_thread_noted = false;

inline void note_allocating_thread() noexcept {
  if (t_allocating_thread_noted) return;
  t_allocating_thread_noted = true;
  if (PyGILState_GetThisThreadState() == nullptr) return;
  try {
    std::lock_guard<std::mutex> guard(g_allocating_threads_mu);
    g_allocating_threads.push_back(static_cast<int64_t>(syscall(SYS_gettid)));
  } catch (...) {
    t_allocating_thread_noted = false;  // no memory: noted on a later allocation
  }
}

std::vector<int64_t> allocating_threads() {
  std::lock_guard<std::mutex> guard(g_allocating_threads_mu);
  return g_allocating_threads;
}

// With the GIL: the Python objects releases let go of.
void drop_garbage(Books& books) {
  std::vector<PyObject*> garbage = books.take_garbage();
  for (PyObject* o : garbage) Py_DECREF(o);
}

// With the GIL: the Python side of releases (see the header comment).
void python_aftermath(Books& books, const Aftermath& after) {
  drop_garbage(books);
  if (after.notify && books.close_hook() != nullptr) {
    PyObject* result = PyObject_CallNoArgs(books.close_hook());
    if (result == nullptr) {
      PyErr_WriteUnraisable(books.close_hook());  // never across the C boundary: logged by Python's hook
    } else {
      Py_DECREF(result);
    }
  }
  if (after.last && books.keeper() != nullptr) Py_DECREF(books.keeper());
}

struct PendingWork {
  std::shared_ptr<Books> books;
  Aftermath after;
};

// A pending call (Py_AddPendingCall): runs in the main thread with the GIL held.
int run_pending_work(void* arg) {
  auto* work = static_cast<PendingWork*>(arg);
  python_aftermath(*work->books, work->after);
  delete work;
  return 0;  // an error is already reported: a pending call must not leave one set
}

// The Python side of a release, once the books' mutex is let go: nothing unless the last record a
// native context names went or the pool closed (garbage waits for the next caller with the GIL).
// Never raises, never waits for the GIL in a thread Python never saw.
void after_release(const std::shared_ptr<Books>& books, const Aftermath& after) noexcept {
  if (!after.last && !after.notify) return;
  if (python_exiting() || books->keeper() == nullptr) return;
  if (PyGILState_GetThisThreadState() != nullptr) {
    // The usual case: a Python thread dropped the tensor (torch may have let go of the GIL while it
    // frees the storage; this thread takes it back).
    PyGILState_STATE gil = PyGILState_Ensure();
    python_aftermath(*books, after);
    PyGILState_Release(gil);
    return;
  }
  // A thread Python never saw (a C++ worker freeing a tensor): never wait for the GIL here. Only for
  // the last record, whose keeper reference keeps the pool alive until then: an earlier release after
  // close needs nothing (the last one lets the pool give everything back).
  if (!after.last) return;
  auto* work = new (std::nothrow) PendingWork{books, after};
  if (work == nullptr || Py_AddPendingCall(run_pending_work, work) != 0) {
    delete work;  // the queue is full: the pool reference stays (a leak, not a crash)
  }
}

// Runs when a storage (or a raw pointer PyTorch held) over a record is freed: any thread, GIL or not.
void release_record(void* ctx) noexcept {
  auto* r = static_cast<Record*>(ctx);
  std::shared_ptr<Books> books = r->keep;  // a copy: the books outlive this call, whatever the record does
  if (!books) return;
  const Aftermath after = books->release(r);
  after_release(books, after);
}

// With the GIL, after the mutex: the keeper's reference for the first record attached.
void take_keeper(Books& books, bool first) {
  if (first && books.keeper() != nullptr) Py_INCREF(books.keeper());
}

int64_t rounded(int64_t nbytes) { return (nbytes + kAlignment - 1) / kAlignment * kAlignment; }

class FastPath {
 public:
  // books: the pool's books (the core's). owner_ref: a callable giving the calling thread's owner
  // reference. dtypes: the torch dtypes the pool hands out. stale_fd: a file whose allocated blocks
  // mean a stale access to report (-1: none). cuda_default_stream: the c10 stream id of the CUDA
  // device's default stream (ignored on CPU).
  FastPath(std::shared_ptr<Books> books, py::object owner_ref, py::list dtypes, std::string device_type,
           int device_index, int stale_fd, int64_t cuda_default_stream)
      : books_(std::move(books)), owner_ref_(owner_ref), stale_fd_(stale_fd), cuda_default_stream_(cuda_default_stream) {
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
  // `enabled`, but on while the pool records history (the books log their blocks; `empty` leaves it
  // to the Python path, which records each allocation's frames).
  std::atomic<bool> serves_allocator{false};
  int64_t hits = 0, misses = 0;  // the Python-facing empty (GIL held)
  // native_empty (any thread): tensors it made, and how many of those needed the pool's room.
  std::atomic<int64_t> native_hits{0}, native_misses{0};
  std::atomic<int64_t> allocator_blocks{0};               // placed for PyTorch's allocator entries, ever

  Books& books() { return *books_; }
  const std::shared_ptr<Books>& shared_books() const { return books_; }

  // The pool's room: a callable `room(nbytes, origin, stream) -> (address, face) | str | None` that
  // places a block of `nbytes` for `stream` through the pool's ladder for a native caller (origin 1: a
  // thread Python never saw, compaction allowed; 2: PyTorch's allocator, no compaction), records it
  // with a pinned face, and returns where it is (the caller attaches that record), an explained
  // refusal (str), or None (declined: closed, asleep). Called with the GIL; never raises (the pool's
  // code guarantees it).
  void set_room(py::object room) { room_ = std::move(room); }
  py::object room() const { return room_; }

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
    if (!enabled) return miss();
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
    drop_garbage(*books_);
    Py_INCREF(owner);  // the record's from here (or dropped with the GIL on a miss: `garbage`)
    at::Tensor tensor = place_tensor(rounded(nbytes), nbytes, stype, shape, ndim, owner, /*foreign=*/false);
    if (!tensor.defined()) return miss();
    hits += 1;
    return THPVariable_Wrap(std::move(tensor));
  }

  // A tensor of `nbytes` bytes (uint8) over the books for a thread Python never saw: no GIL, no
  // Python, unless pages must be mapped or the ladder must climb: then it takes the GIL and asks the
  // pool's room, which places the block through the ladder, and makes the tensor over that block.
  // Undefined when the pool cannot serve it (closed, asleep, out of memory). Only while a lease is
  // held (`churn`): the pool then outlives every block made here without a Python reference taken
  // here. Blocks made here belong to no Python thread: their faces are pinned (a compaction never
  // moves what such a thread may be using).
  at::Tensor native_empty(int64_t nbytes) {
    if (nbytes <= 0) return at::Tensor();
    std::array<int64_t, kMaxDims> shape{};
    shape[0] = nbytes;
    if (enabled.load()) {
      at::Tensor tensor = place_tensor(rounded(nbytes), nbytes, c10::ScalarType::Byte, shape, 1, nullptr, true);
      if (tensor.defined()) {
        native_hits += 1;
        return tensor;
      }
    }
    native_misses += 1;
    if (python_exiting() || !room_) return at::Tensor();
    PyGILState_STATE gil = PyGILState_Ensure();
    int64_t address = 0;
    py::object face;
    try {
      py::object said = room_(nbytes, static_cast<int>(defrag_native::kFastPath), 0);
      if (py::isinstance<py::tuple>(said)) {
        address = said[py::int_(0)].cast<int64_t>();
        face = said[py::int_(1)];
      }
    } catch (py::error_already_set&) {
      PyErr_Clear();  // the room never raises; if it did, this allocation fails plainly
    }
    at::Tensor tensor;
    if (address != 0) tensor = adopt_tensor(address, face.ptr(), nbytes, c10::ScalarType::Byte, shape, 1);
    face = py::object();
    PyGILState_Release(gil);
    if (tensor.defined()) native_hits += 1;
    return tensor;
  }

  // Why `place_for_allocator` placed nothing.
  enum class Refusal { kNone, kHeld, kQueued, kNoRoom, kNoLease };

  // A block of `nbytes` for PyTorch's CPU or CUDA allocator: any thread, no GIL, one critical section
  // under the books' mutex. Its record is attached (PyTorch holds the raw pointer; its face, made
  // when Python asks, is pinned: it never moves) and found again by address at its free. Its address,
  // or 0 with the reason: a thread is inside the books, the history log waits for Python, no lease
  // (no install holds the pool), or pages must be mapped.
  uintptr_t place_for_allocator(int64_t nbytes, uintptr_t stream, Refusal& why) {
    const int64_t size = rounded(nbytes);
    Aftermath after;
    uintptr_t address = place_allocator_locked(size, nbytes, stream, why, after);
    after_release(books_, after);
    return address;
  }

  uintptr_t place_allocator_locked(int64_t size, int64_t nbytes, uintptr_t stream, Refusal& why, Aftermath& after) {
    std::lock_guard<std::mutex> guard(books_->mu);
    // While recording, a log that Python has not taken for kEventsBeforeSync events also waits for
    // Python (`kQueued`: the room's answer takes them), so it stays bounded between reads.
    why = books_->held_locked() ? Refusal::kHeld
          : books_->recording_locked() && books_->events_logged_locked() >= kEventsBeforeSync ? Refusal::kQueued
          : books_->live_locked() == 0 ? Refusal::kNoLease  // the keeper reference is taken only with the GIL
                                       : Refusal::kNone;
    if (why != Refusal::kNone) return 0;
    Record* r = nullptr;
    bool first = false;
    try {
      r = books_->place_locked(size, nbytes, defrag_native::kAllocator, first, after, stream);
    } catch (const std::bad_alloc&) {
      throw;
    } catch (...) {  // books that disagree with themselves: the Python path reports it
      r = nullptr;
    }
    if (r == nullptr) {
      why = Refusal::kNoRoom;
      return 0;
    }
    allocator_blocks += 1;
    return static_cast<uintptr_t>(r->address);
  }

  // The record the room placed at `address` (face `face`) for an allocator entry on `stream`, attached:
  // its address, or 0 when it is not there (with the GIL).
  uintptr_t adopt_for_allocator(int64_t address, PyObject* face, uintptr_t stream) {
    bool first = false;
    Record* r;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      r = books_->adopt_locked(address, face, defrag_native::kAllocator, first);
      if (r != nullptr) r->stream = stream;
    }
    if (r == nullptr) return 0;
    take_keeper(*books_, first);
    allocator_blocks += 1;
    return static_cast<uintptr_t>(address);
  }

  // A tensor of `shape`/`stride` and `dtype` over the record the face's Python code placed at
  // `address` (its face `face`), whose storage's deleter releases the record (with the GIL). On a
  // failure after the storage existed, the record was released as the tensor's death would have:
  // the caller must not free it again. TypeError/ValueError (nothing changed) for bad arguments or
  // a record that is not there or is named by a storage already.
  py::object tensor_over(int64_t address, py::handle face, std::vector<int64_t> shape, std::vector<int64_t> stride,
                         py::handle dtype) {
    if (!THPDtype_Check(dtype.ptr())) throw py::type_error("tensor_over: dtype must be a torch.dtype");
    if (shape.size() != stride.size() || shape.size() > static_cast<size_t>(kMaxDims))
      throw py::value_error("tensor_over: shape and stride differ in length, or too many dimensions");
    const c10::ScalarType stype = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
    Record* r = attach(address, face.ptr(), defrag_native::kPython);
    at::Tensor tensor = at::for_blob(reinterpret_cast<void*>(address), c10::IntArrayRef(shape))
                            .strides(c10::IntArrayRef(stride))
                            .context(r, &release_record)
                            .options(at::TensorOptions().dtype(stype).device(device_))
                            .target_device(device_)
                            .make_tensor();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensor)));
  }

  // UntypedStorages of nbytes[i] bytes over the records at addresses[i] (faces[i]) the face's Python
  // code placed (adopt, a compaction wave's destinations), in one call; each storage's deleter
  // releases its record. Every record is checked first (ValueError, nothing changed).
  py::list storages(const std::vector<int64_t>& addresses, const py::list& faces, const std::vector<int64_t>& nbytes) {
    const size_t n = addresses.size();
    if (faces.size() != n || nbytes.size() != n) throw py::value_error("storages: addresses, faces and nbytes differ in length");
    for (int64_t b : nbytes)
      if (b <= 0) throw py::value_error("a pool storage needs at least one byte");
    std::vector<Record*> records(n);
    bool first = false;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      for (size_t i = 0; i < n; ++i) {
        records[i] = books_->find_locked(addresses[i], faces[i].ptr());
        if (records[i] == nullptr || records[i]->attached || records[i]->released)
          throw py::value_error("storages: no free-standing record at " + std::to_string(addresses[i]));
      }
      for (Record* r : records) first = books_->attach_locked(r) || first;
    }
    take_keeper(*books_, first);
    py::list out(n);
    for (size_t i = 0; i < n; ++i) {
      // From here the storage owns the record's context: if anything below fails, its deleter
      // releases the record (and those not made yet are released here, as if made and dropped).
      try {
        c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes[i],
                             c10::DataPtr(reinterpret_cast<void*>(addresses[i]), records[i], &release_record, device_),
                             nullptr, false);
        PyObject* wrapped = THPStorage_Wrap(std::move(storage));
        if (wrapped == nullptr) throw py::error_already_set();
        out[i] = py::reinterpret_steal<py::object>(wrapped);
      } catch (...) {
        for (size_t j = i + 1; j < n; ++j) release_record(records[j]);
        throw;
      }
    }
    return out;
  }

  // A compaction wave's commit, for storages whose memory this fast path made: `users[i]` moves from
  // `old_addresses[i]` to `new_addresses[i]` (the copy is done; the wave's books took the new range
  // and gave the old one back; `Books.move` re-addresses the records next). Every user is checked
  // first: an UntypedStorage on this device whose memory is a record of these books at its old
  // address, of `nbytes[i]` bytes. Then each gets a DataPtr over its new address with the same record.
  // Returns -1; i when user i is not at its old address or not of `nbytes[i]` bytes; -2 when some
  // user's memory was not made here (the caller swaps through temporary storages instead). Nothing
  // changes unless all pass.
  int64_t rebase(const py::list& users, const std::vector<uintptr_t>& new_addresses,
                 const std::vector<uintptr_t>& old_addresses, const std::vector<int64_t>& nbytes) {
    const size_t n = users.size();
    if (new_addresses.size() != n || old_addresses.size() != n || nbytes.size() != n)
      throw py::value_error("rebase: users, addresses and nbytes differ in length");
    // In passes, each over independent loads (the storages, then their DataPtrs, then the records):
    // after the wave's copy these are cold in the caches, and loads that do not wait on each other
    // overlap.
    std::vector<c10::StorageImpl*> impls(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* user = users[i].ptr();
      if (!THPStorage_Check(user)) throw py::value_error("rebase: expects UntypedStorages");
      impls[i] = THPStorage_Unpack(user).unsafeGetStorageImpl();
    }
    // A storage of PyTorch's allocator entry (a PyTorch-made block whose owner a match found) names its
    // record by address: its DataPtr's context is its data pointer, and so is the new one's.
    const c10::DeleterFnPtr allocators = g_allocator_deleter.load(std::memory_order_acquire);
    std::vector<Record*> records(n);
    std::vector<bool> by_address(n, false);
    for (size_t i = 0; i < n; ++i) {
      const c10::DataPtr& data = impls[i]->data_ptr();
      if (data.device() != device_) return -2;
      if (data.get_deleter() == &release_record) {
        records[i] = static_cast<Record*>(data.get_context());
      } else if (allocators != nullptr && data.get_deleter() == allocators && data.get_context() == data.get()) {
        by_address[i] = true;
      } else {
        return -2;
      }
      if (reinterpret_cast<uintptr_t>(data.get()) != old_addresses[i] ||
          static_cast<int64_t>(impls[i]->nbytes()) != nbytes[i])
        return static_cast<int64_t>(i);
    }
    {
      std::lock_guard<std::mutex> guard(books_->mu);  // records' fields are read under it
      for (size_t i = 0; i < n; ++i) {
        if (by_address[i]) {
          records[i] = books_->find_locked(static_cast<int64_t>(old_addresses[i]), nullptr);
          if (records[i] == nullptr || records[i]->origin != defrag_native::kAllocator) return -2;
        }
        const Record* r = records[i];
        if (r->keep != books_) return -2;
        if (static_cast<uintptr_t>(r->address) != old_addresses[i]) return static_cast<int64_t>(i);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      void* to = reinterpret_cast<void*>(new_addresses[i]);
      c10::DataPtr old = impls[i]->set_data_ptr(by_address[i] ? c10::DataPtr(to, to, allocators, device_)
                                                              : c10::DataPtr(to, records[i], &release_record, device_));
      old.release_context();  // the same record: the storage's new DataPtr owns it (freed by address after)
    }
    return -1;
  }

  // Threads Python never saw, allocating and dropping (the benchmark's and the tests' C++ threads):
  // `threads` std::threads, each `iterations` times replacing one of `live` slots (round robin) with
  // a new uint8 tensor of the next of `sizes` bytes (each thread from its own offset), over this
  // pool's books (`native`: native_empty) or torch's own allocator (at::empty on this device).
  // `verify`: every tensor is filled with a byte of its own and checked whole, through the pointer the
  // thread kept, before it is dropped (a tensor moved meanwhile counts as corrupted). Holds a lease
  // (the pool outlives every block made meanwhile) and releases the GIL. Returns (seconds of wall
  // time, failed allocations, corrupted tensors).
  py::tuple churn(std::vector<int64_t> sizes, int64_t iterations, int threads, int live, bool native, bool verify) {
    if (sizes.empty() || iterations < 0 || threads < 1 || live < 1)
      throw py::value_error("churn needs sizes, iterations >= 0, threads >= 1 and live >= 1");
    for (int64_t n : sizes)
      if (n <= 0) throw py::value_error("churn: every size must be positive");
    take_lease();
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
    drop_lease();
    return py::make_tuple(seconds, failed.load(), corrupted.load());
  }

  // A lease on the pool (with the GIL): the keeper stays alive while it is held.
  void take_lease() {
    bool first;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      first = books_->take_lease_locked();
    }
    take_keeper(*books_, first);
  }

  void drop_lease() {
    bool last;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      last = books_->drop_lease_locked();
    }
    if (last && books_->keeper() != nullptr) Py_DECREF(books_->keeper());
  }

  // The owners of the PyTorch-made blocks, found at a safe point (defrag.owners: no operation is in
  // flight on any thread that allocates from the pool). `objects`: what Python's collector tracks
  // (gc.get_objects()). Every tensor among them, and its grad, names a storage; each storage on this
  // device whose bytes meet a PyTorch-made block claims it. A block is owned (`kOwned`, its
  // `Record::storage` then names that storage with one weak count of ours) when exactly one storage
  // claims it, starting at its address, holding the allocator entry's own DataPtr (its deleter,
  // context == data) of the block's nbytes; shared (`kShared`) when any other storage covers some of
  // its bytes (a second storage, memory exported and imported back, a copy-on-write clone); else no
  // owner is found (a workspace, a raw allocation, a storage only C++ holds: autograd's saved tensors
  // whose Python tensor is gone). Every PyTorch-made block's state is rewritten; nothing else changes.
  // Returns (tensors seen, storages seen, blocks owned, bytes owned, blocks shared).
  py::tuple match_owners(const py::list& objects) {
    // The storages named by Python's tensors (and their grads), this device's only. One pass over the
    // objects, by type (the last type's answer kept: runs of one type are common).
    std::unordered_map<PyTypeObject*, bool> is_tensor_type;
    PyTypeObject* last_type = nullptr;
    bool last_is_tensor = false;
    std::vector<c10::StorageImpl*> claims;
    int64_t tensors = 0;
    auto claim = [&](const at::TensorBase& t) {
      if (!t.defined() || !t.has_storage() || t.device() != device_) return;
      c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
      if (impl != nullptr) claims.push_back(impl);
    };
    // The objects lie scattered in memory: each one's header is fetched a few objects ahead (the
    // walk is bound by those loads, not by the work on them).
    constexpr Py_ssize_t kAhead = 12;
    PyObject** items = PySequence_Fast_ITEMS(objects.ptr());
    const Py_ssize_t count = PyList_GET_SIZE(objects.ptr());
    for (Py_ssize_t i = 0; i < count; ++i) {
      if (i + kAhead < count) __builtin_prefetch(items[i + kAhead]);
      PyObject* obj = items[i];
      PyTypeObject* type = Py_TYPE(obj);
      if (type != last_type) {
        auto known = is_tensor_type.find(type);
        // By type, never by isinstance: an isinstance check may run Python (a metaclass's
        // __instancecheck__, a deprecated module attribute's warning).
        last_is_tensor = known != is_tensor_type.end()
                             ? known->second
                             : (is_tensor_type[type] = THPVariableClass != nullptr &&
                                                       PyType_IsSubtype(type, reinterpret_cast<PyTypeObject*>(THPVariableClass)));
        last_type = type;
      }
      if (!last_is_tensor) continue;
      tensors += 1;
      const at::Tensor& t = THPVariable_Unpack(obj);
      claim(t);
      if (t.defined()) claim(t.unsafeGetTensorImpl()->grad());  // held in C++ (AutogradMeta) between steps
    }
    std::sort(claims.begin(), claims.end());
    claims.erase(std::unique(claims.begin(), claims.end()), claims.end());
    // Each claim's bytes, read once (outside the books' mutex: the storages are the program's).
    struct Claim {
      int64_t start, end;
      c10::StorageImpl* impl;
      bool alone_shape;  // the allocator entry's own DataPtr (deleter, context == data)
    };
    const c10::DeleterFnPtr ours = g_allocator_deleter.load(std::memory_order_acquire);
    std::vector<Claim> spans;
    spans.reserve(claims.size());
    for (c10::StorageImpl* impl : claims) {
      const c10::DataPtr& data = impl->data_ptr();
      const auto start = static_cast<int64_t>(reinterpret_cast<uintptr_t>(data.get()));
      const auto n = static_cast<int64_t>(impl->nbytes());
      if (start == 0 || n <= 0) continue;
      spans.push_back({start, start + n, impl,
                       ours != nullptr && data.get_deleter() == ours && data.get_context() == data.get()});
    }
    std::sort(spans.begin(), spans.end(), [](const Claim& a, const Claim& b) { return a.start < b.start; });
    std::vector<void*> dropped;
    int64_t owned = 0, owned_bytes = 0, shared = 0;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      std::vector<Record*> records = books_->allocator_records_locked();  // sorted by address
      std::vector<c10::StorageImpl*> owner(records.size(), nullptr);
      for (Record* r : records) {
        r->held = defrag_native::kNoOwnerFound;
        if (r->storage != nullptr) dropped.push_back(r->storage);
        r->storage = nullptr;
      }
      // Both sorted: walk the records alongside the claims (a claim may cover several records).
      size_t first = 0;
      for (const Claim& c : spans) {
        while (first < records.size() && records[first]->address + records[first]->nbytes <= c.start) ++first;
        for (size_t k = first; k < records.size() && records[k]->address < c.end; ++k) {
          Record* r = records[k];
          const bool alone = c.alone_shape && c.start == r->address && c.end - c.start == r->nbytes;
          if (!alone) {
            r->held = defrag_native::kShared;
          } else if (r->held == defrag_native::kNoOwnerFound) {
            r->held = defrag_native::kOwned;
            owner[k] = c.impl;
          } else if (r->held == defrag_native::kOwned && owner[k] != c.impl) {
            r->held = defrag_native::kShared;
          }
        }
      }
      for (size_t k = 0; k < records.size(); ++k) {
        Record* r = records[k];
        if (r->held == defrag_native::kShared) {
          shared += 1;
        } else if (r->held == defrag_native::kOwned) {
          c10::raw::weak_intrusive_ptr::incref(owner[k]);
          r->storage = owner[k];
          owned += 1;
          owned_bytes += r->nbytes;
        }
      }
    }
    for (void* weak : dropped) drop_storage_weak(weak);
    return py::make_tuple(tensors, static_cast<int64_t>(claims.size()), owned, owned_bytes, shared);
  }

  // What the last owner match says of the PyTorch-made block at each of `addresses`: held + 4 * fixed
  // (books.h OwnerState and Fixed), or -1 where no live PyTorch-made block starts.
  std::vector<int> owner_codes(const std::vector<int64_t>& addresses) {
    std::vector<int> out(addresses.size(), -1);
    std::lock_guard<std::mutex> guard(books_->mu);
    for (size_t i = 0; i < addresses.size(); ++i) {
      const Record* r = books_->find_locked(addresses[i], nullptr);
      if (r != nullptr && r->origin == defrag_native::kAllocator && r->attached && !r->released && !r->retired)
        out[i] = static_cast<int>(r->held) + 4 * static_cast<int>(r->fixed);
    }
    return out;
  }

  // The storages that own the PyTorch-made blocks at `addresses` (found by the last owner match, still
  // alive, still there and not fixed), else None each: what a compaction grips before it moves them.
  py::list owner_storages(const std::vector<int64_t>& addresses) {
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> strong(addresses.size());
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      for (size_t i = 0; i < addresses.size(); ++i) {
        Record* r = books_->find_locked(addresses[i], nullptr);
        if (r == nullptr || r->origin != defrag_native::kAllocator || r->released || r->retired ||
            r->held != defrag_native::kOwned || r->fixed != defrag_native::kNotFixed || r->storage == nullptr)
          continue;
        auto* impl = static_cast<c10::StorageImpl*>(r->storage);
        c10::raw::weak_intrusive_ptr::incref(impl);
        strong[i] = c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim(impl).lock();
      }
    }
    // Checked and dropped outside the mutex: a strong reference dropped here may be a storage's last,
    // whose deleter takes the books' mutex.
    for (size_t i = 0; i < addresses.size(); ++i) {
      if (strong[i] && reinterpret_cast<uintptr_t>(strong[i]->data_ptr().get()) != static_cast<uintptr_t>(addresses[i]))
        strong[i].reset();
    }
    py::list out(addresses.size());
    for (size_t i = 0; i < addresses.size(); ++i) {
      if (!strong[i]) {
        out[i] = py::none();
        continue;
      }
      PyObject* wrapped = THPStorage_Wrap(c10::Storage(std::move(strong[i])));
      if (wrapped == nullptr) throw py::error_already_set();
      out[i] = py::reinterpret_steal<py::object>(wrapped);
    }
    return out;
  }

  // The PyTorch-made block at `address` never moves again (its address went to another library:
  // `code` says how, books.h Fixed). False when no such block is here.
  bool mark_fixed(int64_t address, int code) {
    if (code <= 0 || code > defrag_native::kGraph) throw py::value_error("mark_fixed: unknown code");
    std::lock_guard<std::mutex> guard(books_->mu);
    Record* r = books_->find_locked(address, nullptr);
    if (r == nullptr || r->origin != defrag_native::kAllocator || r->released) return false;
    if (r->fixed == defrag_native::kNotFixed) r->fixed = static_cast<defrag_native::Fixed>(code);
    return true;
  }

  // The pool closed: no more fast allocations; every later release of a record a native context
  // names calls the books' close hook (with the GIL).
  void close() {
    enabled = false;
    serves_allocator = false;
    books_->close();
  }

 private:
  PyObject* miss() {
    misses += 1;
    return nullptr;
  }

  // The record at `address` (face `face`) attached for a tensor or storage about to be made (with the
  // GIL): ValueError when it is not there or is attached already.
  Record* attach(int64_t address, PyObject* face, Origin origin) {
    bool first = false;
    Record* r;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      r = books_->adopt_locked(address, face, origin, first);
    }
    if (r == nullptr) throw py::value_error("no free-standing record at " + std::to_string(address));
    take_keeper(*books_, first);
    return r;
  }

  // Place a record of `size` (rounded; `nbytes` asked) in mapped free space and make a tensor of
  // `shape` over it whose deleter releases it; undefined when the books cannot place it now (a thread
  // is inside the books or waits for them, pages must be mapped, or, for a foreign thread, no lease).
  // `owner`: a strong reference the record takes over (nullptr: a thread Python never saw; handed
  // back through the books' garbage on a miss).
  at::Tensor place_tensor(int64_t size, int64_t nbytes, c10::ScalarType stype, const std::array<int64_t, kMaxDims>& shape,
                          int ndim, PyObject* owner, bool foreign) {
    Record* r = nullptr;
    bool first = false;
    Aftermath after;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      // A thread inside the books or waiting for them: the Python path (it waits its turn). A
      // foreign thread needs a lease (it cannot take the keeper's first reference without the GIL).
      const bool refuse = foreign ? (books_->held_locked() || books_->live_locked() == 0) : books_->busy_locked();
      if (!refuse) {
        try {
          r = books_->place_locked(size, nbytes, defrag_native::kFastPath, first, after);
        } catch (...) {  // books that disagree with themselves: the Python path reports it
          r = nullptr;
        }
      }
      if (r == nullptr && owner != nullptr) books_->discard_locked(owner);
      if (r != nullptr) {
        books_->set_owner_locked(r, owner);
        r->dtype = static_cast<int8_t>(static_cast<int>(stype));
        r->ndim = static_cast<int8_t>(ndim);
        r->shape = shape;
        books_->begin_placing_locked();  // `enter` waits until the tensor is made below
      }
    }
    after_release(books_, after);
    if (r == nullptr) return at::Tensor();
    take_keeper(*books_, first);
    at::Tensor tensor = make_tensor(r, nbytes, stype, shape.data(), ndim);
    std::lock_guard<std::mutex> guard(books_->mu);
    if (tensor.defined()) r->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(tensor.storage().getWeakStorageImpl()).release();
    books_->end_placing_locked();
    return tensor;
  }

  // A contiguous tensor over record `r` (attached), or undefined when torch could not make it (its
  // deleter then released the record already).
  at::Tensor make_tensor(Record* r, int64_t /*nbytes*/, c10::ScalarType stype, const int64_t* shape, int ndim) {
    try {
      std::array<int64_t, kMaxDims> strides{};
      int64_t stride = 1;
      for (int d = ndim - 1; d >= 0; --d) {
        strides[d] = stride;
        stride *= shape[d] > 1 ? shape[d] : 1;
      }
      return at::for_blob(reinterpret_cast<void*>(r->address), c10::IntArrayRef(shape, ndim))
          .strides(c10::IntArrayRef(strides.data(), ndim))
          .context(r, &release_record)
          .options(at::TensorOptions().dtype(stype).device(device_))
          .target_device(device_)
          .make_tensor();
    } catch (...) {
      return at::Tensor();
    }
  }

  // A tensor over the record the room placed for a foreign thread (with the GIL); undefined when it is
  // not there any more.
  at::Tensor adopt_tensor(int64_t address, PyObject* face, int64_t nbytes, c10::ScalarType stype,
                          const std::array<int64_t, kMaxDims>& shape, int ndim) {
    bool first = false;
    Record* r;
    {
      std::lock_guard<std::mutex> guard(books_->mu);
      r = books_->adopt_locked(address, face, defrag_native::kFastPath, first);
      if (r == nullptr) return at::Tensor();
      r->dtype = static_cast<int8_t>(static_cast<int>(stype));
      r->ndim = static_cast<int8_t>(ndim);
      r->shape = shape;
    }
    take_keeper(*books_, first);
    at::Tensor tensor = make_tensor(r, nbytes, stype, shape.data(), ndim);
    if (tensor.defined()) {
      std::lock_guard<std::mutex> guard(books_->mu);
      r->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(tensor.storage().getWeakStorageImpl()).release();
    }
    return tensor;
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

  std::shared_ptr<Books> books_;
  py::object owner_ref_;
  py::object room_;
  py::str owner_key_;
  int stale_fd_;
  int64_t cuda_default_stream_;
  bool cuda_ = false;
  c10::Device device_{c10::DeviceType::CPU};
  std::array<PyObject*, kDtypes> dtype_objects_{};

 public:
  // The dtype object of a record's dtype index (borrowed; None if the pool hands none out).
  PyObject* dtype_object(int index) const {
    return index >= 0 && index < kDtypes && dtype_objects_[index] != nullptr ? dtype_objects_[index] : Py_None;
  }
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

// ---------------------------------------------------------------------- the books' Python face

// The Python side of an Aftermath the caller got with the GIL held.
void settle_aftermath(Books& books, const Aftermath& after) { python_aftermath(books, after); }

// The record at `address` whose face is `face`: ValueError when there is none.
Record* record_of(Books& books, int64_t address, py::handle face) {
  std::lock_guard<std::mutex> guard(books.mu);
  Record* r = books.find_locked(address, face.ptr());
  if (r == nullptr) throw py::value_error("no block of this face is recorded at " + std::to_string(address));
  return r;
}

// The faces of every record (of `region`; -1: all), making the missing ones with
// `factory(address, size, nbytes, region, origin, owner, weak_storage, dtype, shape)` (a record native
// code placed: `owner` None for a thread Python never saw or PyTorch's allocator; `weak_storage` an
// int the factory turns into a StorageWeakRef, 0 when no storage was made; `dtype` a torch.dtype or
// None). Inside the books only (records cannot go meanwhile). Pending records' faces get
// `pending = True`.
py::list faces(Books& books, int region, py::object factory, py::object fast_object) {
  FastPath* fast = fast_object.is_none() ? nullptr : fast_object.cast<FastPath*>();
  std::vector<Record*> records;
  books.each_record(region, [&](Record* r) { records.push_back(r); });
  py::list out(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    Record* r = records[i];
    if (r->face == nullptr) {
      if (factory.is_none()) throw py::value_error("a record has no face and no factory was given");
      uintptr_t weak = 0;
      {
        std::lock_guard<std::mutex> guard(books.mu);
        if (r->storage != nullptr) {
          c10::raw::weak_intrusive_ptr::incref(static_cast<c10::StorageImpl*>(r->storage));
          weak = reinterpret_cast<uintptr_t>(r->storage);
        }
      }
      py::tuple shape(r->ndim);
      for (int d = 0; d < r->ndim; ++d) shape[d] = py::int_(r->shape[d]);
      py::object owner = r->owner != nullptr ? py::reinterpret_borrow<py::object>(r->owner) : py::none();
      py::object dtype = fast != nullptr && r->ndim > 0 ? py::reinterpret_borrow<py::object>(fast->dtype_object(r->dtype))
                                                         : py::none();
      py::object face = factory(r->address, r->size, r->nbytes, r->region, static_cast<int>(r->origin), owner, weak,
                                dtype, shape);
      std::lock_guard<std::mutex> guard(books.mu);
      if (r->face == nullptr) r->face = face.release().ptr();
    }
    out[i] = py::reinterpret_borrow<py::object>(r->face);
    if (r->pending) {
      out[i].attr("pending") = true;
      out[i].attr("counted") = false;
    }
  }
  drop_garbage(books);
  return out;
}

py::dict counters_dict(Books& books) {
  const Counters c = books.counters();
  py::dict out;
  out["allocated_bytes"] = c.allocated;
  out["allocated_bytes.peak"] = c.allocated_peak;
  out["pending_bytes"] = c.pending;
  out["active_bytes.peak"] = c.active_peak;
  out["num_allocs"] = c.allocs;
  out["num_frees"] = c.frees;
  return out;
}

// PyTorch's CPU allocator and CUDA entry points over pools' books: `cpu_allocator.cpp` and
// `cuda_allocator.cpp` (later sources, same unit).
void bind_cpu_allocator(py::module_& m);
void bind_cuda_allocator(py::module_& m);
void bind_op_rescue(py::module_& m);  // op_rescue.cpp

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
  Books::drop_native = &drop_storage_weak;
  defrag_native::bind_heap(m);
  defrag_native::bind_planner(m);
  defrag_native::bind_plan_attempt(m);
  using BooksPtr = std::shared_ptr<Books>;
  auto books_class = py::class_<Books, BooksPtr>(m, "Books", "A pool's books (see books.h): records, heaps, page counts, kept ranges.")
      .def(py::init<int64_t>(), py::arg("page_size"))
      .def("add_region", &Books::add_region, py::arg("heap"), py::arg("base"), py::arg("npages"))
      .def("counts",
           [](BooksPtr self, int region) {
             // A numpy view of the region's page counts, keeping the books alive.
             int64_t* data = self->counts(region);
             auto* keep = new BooksPtr(self);
             py::capsule base(keep, [](void* p) { delete static_cast<BooksPtr*>(p); });
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
      // -- the pool's lock
      .def("enter", &Books::enter, py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("leave", [](Books& self) { settle_aftermath(self, self.leave()); })
      .def("inside_here", &Books::inside_here)
      .def("apply_queued", [](Books& self) { settle_aftermath(self, self.apply_queued()); })
      // -- records
      .def("add",
           [](Books& self, py::handle face, int region, int64_t address, int64_t size, int64_t nbytes, bool counted,
              bool retired, uintptr_t stream, bool accounted) {
             self.add(face.ptr(), region, address, size, nbytes, counted, retired, stream, accounted);
           },
           py::arg("face"), py::arg("region"), py::arg("address"), py::arg("size"), py::arg("nbytes"),
           py::arg("counted") = true, py::arg("retired") = false, py::arg("stream") = 0,
           py::arg("accounted") = false)
      .def("set_stream",
           [](Books& self, int64_t address, py::handle face, uintptr_t stream) {
             Record* r = record_of(self, address, face);
             std::lock_guard<std::mutex> guard(self.mu);
             r->stream = stream;
           })
      .def("drop",
           [](Books& self, int64_t address, py::handle face, bool keep) {
             self.drop(record_of(self, address, face), keep);
             drop_garbage(self);
           },
           py::arg("address"), py::arg("face"), py::arg("keep") = false)
      .def("release",
           [](BooksPtr self, int64_t address, py::handle face) {
             // The release of a block whose user the face's Python code saw die; nothing when the
             // record is gone already (a compaction forgot it).
             Record* r;
             {
               std::lock_guard<std::mutex> guard(self->mu);
               r = self->find_locked(address, face.ptr());
             }
             if (r == nullptr) return;
             settle_aftermath(*self, self->release(r));
           },
           py::arg("address"), py::arg("face"))
      .def("forget",
           [](Books& self, const std::vector<int64_t>& addresses, const py::list& faces) {
             std::vector<Record*> records;
             for (size_t i = 0; i < addresses.size(); ++i) {
               std::lock_guard<std::mutex> guard(self.mu);
               if (Record* r = self.find_locked(addresses[i], faces[i].ptr())) records.push_back(r);
             }
             self.forget(records);
             drop_garbage(self);
           })
      .def("move",
           [](Books& self, const std::vector<int64_t>& olds, const py::list& faces, const std::vector<int64_t>& news) {
             if (faces.size() != olds.size()) throw py::value_error("move: addresses and faces differ in length");
             std::vector<Record*> records;
             records.reserve(olds.size());
             for (size_t i = 0; i < olds.size(); ++i) records.push_back(record_of(self, olds[i], faces[i]));
             self.move(records, news);
           })
      .def("exchange_state",
           [](Books& self, int64_t old_address, py::handle old_face, int64_t new_address, py::handle new_face) {
             self.exchange_state(record_of(self, old_address, old_face), record_of(self, new_address, new_face));
           })
      .def("set_retired",
           [](Books& self, int64_t address, py::handle face, bool retired) {
             self.set_retired(record_of(self, address, face), retired);
           })
      .def("faces",
           [](Books& self, int region, py::object factory, py::object fast) { return faces(self, region, factory, fast); },
           py::arg("region") = -1, py::arg("factory") = py::none(), py::arg("fast") = py::none())
      .def("face_at",
           [](Books& self, int64_t address) -> py::object {
             std::lock_guard<std::mutex> guard(self.mu);
             Record* r = self.find_locked(address, nullptr);
             if (r == nullptr || r->face == nullptr) return py::none();
             return py::reinterpret_borrow<py::object>(r->face);
           })
      .def("has_faceless",
           [](Books& self, int64_t address) {
             std::lock_guard<std::mutex> guard(self.mu);
             Record* r = self.find_locked(address, nullptr);
             return r != nullptr && r->face == nullptr;
           })
      .def_property_readonly("records", &Books::record_count)
      .def_property_readonly("queued", &Books::queued_count)
      // -- streams (streams.h)
      .def("set_streams", &Books::set_streams, py::arg("kind"), py::arg("context") = 0)
      .def("record_stream",
           [](Books& self, int64_t address, py::handle face, uintptr_t stream) {
             self.record_stream(record_of(self, address, face), stream);
           })
      .def("fence", &Books::fence, py::arg("stream"))
      .def("poll_pending", [](Books& self) { settle_aftermath(self, self.poll_pending()); })
      .def("synchronized", [](Books& self) { settle_aftermath(self, self.synchronized()); })
      .def_property_readonly("pending", &Books::pending_count)
      .def("fake_finish",
           [](Books& self, uintptr_t stream) {
             auto* fake = self.fake_streams();
             if (fake == nullptr) throw py::value_error("fake_finish: these books do not use fake streams");
             fake->finish(stream);
           })
      .def("fake_events",
           [](Books& self) {
             auto* fake = self.fake_streams();
             if (fake == nullptr) throw py::value_error("fake_events: these books do not use fake streams");
             py::dict out;
             out["recorded"] = fake->recorded();
             out["destroyed"] = fake->destroyed();
             out["waits"] = fake->waits();
             return out;
           })
      .def("clear_unattached", [](Books& self) {
        self.clear_unattached();
        drop_garbage(self);
      })
      // -- counters, history, lifetime
      .def("counters", &counters_dict)
      .def("reset_peaks", &Books::reset_peaks)
      .def("set_recording", &Books::set_recording, py::arg("on"))
      .def("take_events",
           [](Books& self) {
             auto [events, lost] = self.take_events();
             py::list out(events.size());
             for (size_t i = 0; i < events.size(); ++i) {
               const auto& e = events[i];
               out[i] = py::make_tuple(e[0], e[1], e[2], e[3]);
             }
             return py::make_tuple(out, lost);
           })
      .def("take_owners",
           [](Books& self) {
             auto owners = self.take_owners();
             py::list out(owners.size());
             for (size_t i = 0; i < owners.size(); ++i) out[i] = py::reinterpret_steal<py::object>(owners[i]);
             return out;
           })
      .def("drop_garbage", [](Books& self) { drop_garbage(self); })
      .def("set_keeper",
           [](Books& self, py::handle keeper, py::object hook) {
             // Borrowed: the keeper (the pool) holds the books and the hook; while a record is
             // attached the books hold the keeper (see FastPath).
             self.set_keeper(keeper.is_none() ? nullptr : keeper.ptr());
             self.set_close_hook(hook.is_none() ? nullptr : hook.ptr());
           },
           py::arg("keeper"), py::arg("close_hook"))
      .def("close", &Books::close);
  defrag_native::bind_books_mesh(books_class);
  m.def("allocating_threads", &allocating_threads,
        "Linux thread ids of the Python threads that ever placed a block through PyTorch's allocator entries.");
#ifdef DEFRAG_SWAP_STORAGES
  m.def("swap_storages", &swap_storages, "A compaction wave's storage swaps, after every check (see the source).");
#endif
  py::class_<FastPath>(m, "FastPath")
      .def(py::init<std::shared_ptr<Books>, py::object, py::list, std::string, int, int, int64_t>())
      .def("empty", &FastPath::empty)
      .def("churn", &FastPath::churn, py::arg("sizes"), py::arg("iterations"), py::arg("threads") = 1,
           py::arg("live") = 32, py::arg("native") = true, py::arg("verify") = false)
      .def("bind_empty", [](py::object self, py::object fallback, py::object pool_ref) {
        return bind_empty(self, fallback, pool_ref);
      })
      .def("set_room", &FastPath::set_room, py::arg("room"))
      .def("tensor_over", &FastPath::tensor_over, py::arg("address"), py::arg("face"), py::arg("shape"),
           py::arg("stride"), py::arg("dtype"))
      .def("storages", &FastPath::storages, py::arg("addresses"), py::arg("faces"), py::arg("nbytes"))
      .def("rebase", &FastPath::rebase)
      .def("match_owners", &FastPath::match_owners, py::arg("objects"))
      .def("owner_codes", &FastPath::owner_codes, py::arg("addresses"))
      .def("owner_storages", &FastPath::owner_storages, py::arg("addresses"))
      .def("mark_fixed", &FastPath::mark_fixed, py::arg("address"), py::arg("code"))
      .def("close", &FastPath::close)
      .def("take_lease", &FastPath::take_lease)
      .def("drop_lease", &FastPath::drop_lease)
      .def_property(
          "enabled", [](const FastPath& f) { return f.enabled.load(); },
          [](FastPath& f, bool on) { f.enabled.store(on); })
      .def_property(
          "serves_allocator", [](const FastPath& f) { return f.serves_allocator.load(); },
          [](FastPath& f, bool on) { f.serves_allocator.store(on); })
      .def_property_readonly("native_hits", [](const FastPath& f) { return f.native_hits.load(); })
      .def_property_readonly("native_misses", [](const FastPath& f) { return f.native_misses.load(); })
      .def_readonly("hits", &FastPath::hits)
      .def_readonly("misses", &FastPath::misses);
  bind_cpu_allocator(m);
  bind_cuda_allocator(m);
  bind_op_rescue(m);
}
