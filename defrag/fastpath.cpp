// defrag's allocation fast path: pool.empty() and the tensor's release in C++.
//
// The Python core keeps freed ranges carved per size for the next request of
// that size (`Core.free(keep=True)`). This object holds those kept ranges, and
// serves `pool.empty()` from them in one call: it pops a range, makes the
// tensor with `at::for_blob` over it, and gives the storage a deleter that
// queues the release without the GIL. The Python core learns what happened at
// its next safe point (`collect()`, called from `Core.drain` and
// `Core.flush_reuse` with the pool's gate held), and only then reads pages,
// blocks or counters.
//
// Guarantees (what the Python side relies on):
// - `empty()` never blocks and never raises: it returns None whenever the
//   request is not the common case (the pool's gate is held or waited for by
//   any thread, the fast path is disabled, the size is not kept, unusual
//   arguments, a stale access to report, a non-default CUDA stream), and the
//   Python path then does everything, errors included.
// - A range handed out here is never handed out again before its tensor's
//   storage is freed; a released range that Python never saw goes straight
//   back to its free list; one that Python saw (collected) is reported by
//   serial number and freed by Python.
// - `collect()` hands Python every block made since the last call that still
//   lives, with a weak reference to its storage, its owner thread and dtype,
//   and the counters (allocations, frees, the peak of allocated bytes).
// - The deleter takes only this object's mutex, and never waits for the GIL.
//   It runs Python only to drop the pool reference when the last live block
//   made here dies, and after the pool closed (to let the pool release its
//   memory): at once, taking the GIL, in a Python thread (one dropping a
//   tensor); else as a pending call the main thread runs at its next check (a
//   C++ worker thread Python never saw, freeing a tensor: waiting for the GIL
//   there could abort the process if the interpreter began finalizing
//   meanwhile). No exception crosses it.
//
// Not thread-safe against Python calls without the GIL: every Python-facing
// method runs with the GIL held, and the deleter synchronizes on `mu`.
//
// Also here, as defrag's one compiled module: `swap_storages`, a compaction
// wave's storage swaps in one call (torch >= 2.13).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/core/Tensor.h>
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
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kAlignment = 512;  // defrag.heap.ALIGNMENT
constexpr int kMaxDims = 8;
constexpr int kDtypes = 64;

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
  std::mutex mu;
  // Kept ranges: rounded size -> (region index, address), last in first out.
  std::unordered_map<int64_t, std::vector<std::pair<int32_t, uintptr_t>>> kept;
  int64_t kept_count = 0;
  Slot fresh;  // sentinel of the list of blocks Python has not collected
  // Releases Python must apply, in the order they happened (see Entry). While it is
  // not empty, a block Python never saw is queued too, and empty() declines: the
  // kept ranges then reach the free lists in release order, as on the Python path.
  std::vector<Entry> queue;
  std::vector<PyObject*> garbage;  // owner refs to drop when the GIL is next held
  int64_t allocs = 0, frees = 0, allocated = 0, peak = 0;  // since the last collect()
  int64_t live = 0;  // blocks made here whose storage lives (collected or not)
  uint64_t next_serial = 1;
  bool closed = false;
  PyObject* pool = nullptr;  // borrowed; strong (one reference) while live > 0
  State() { fresh.prev = fresh.next = &fresh; }
};

void unlink(Slot* s) {
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

// Runs when the storage of a block made here is freed: any thread, GIL or not.
void release_slot(void* ctx) noexcept {
  auto* slot = static_cast<Slot*>(ctx);
  std::shared_ptr<State> st = std::move(slot->state);
  bool last = false, notify = false;
  {
    std::lock_guard<std::mutex> guard(st->mu);
    if (slot->collected) {
      st->queue.push_back(Entry{0, slot->serial, 0, 0, 0});
      notify = st->closed;
    } else {
      unlink(slot);
      if (st->queue.empty()) {
        st->kept[slot->size].emplace_back(slot->region, slot->address);
        st->kept_count += 1;
      } else {
        st->queue.push_back(Entry{2, 0, slot->size, slot->region, slot->address});
      }
      if (slot->counted) {
        st->frees += 1;
        st->allocated -= slot->size;
      }
      if (slot->owner != nullptr) st->garbage.push_back(slot->owner);
      slot->owner = nullptr;
    }
    last = --st->live == 0;
  }
  delete slot;
  if (!last && !notify) return;
  if (!Py_IsInitialized()) return;
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return;
#else
  if (_Py_IsFinalizing()) return;
#endif
  PyObject* pool = st->pool;
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

class FastPath {
 public:
  // gate_inside: the dict of the pool's Gate that names threads waiting at or
  // inside the gate (any entry makes the fast path decline). owner_ref: a
  // callable giving the calling thread's owner reference. dtypes: the torch
  // dtypes the pool hands out. stale_fd: a file whose allocated blocks mean a
  // stale access to report (-1: none). cuda_default_stream: the c10 stream
  // id of the CUDA device's default stream (ignored on CPU).
  FastPath(py::object pool, py::dict gate_inside, py::object owner_ref, py::list dtypes, std::string device_type,
           int device_index, int stale_fd, int64_t cuda_default_stream)
      : st_(std::make_shared<State>()),
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

  bool enabled = false;
  int64_t hits = 0, misses = 0;

  // pool.empty(*shape, dtype=dtype) when it is the common case, else None.
  py::object empty(py::tuple args, py::handle dtype) {
    if (!enabled || PyDict_GET_SIZE(gate_inside_.ptr()) != 0) return miss();
    if (stale_fd_ >= 0) {
      struct stat info;
      if (fstat(stale_fd_, &info) != 0 || info.st_blocks != 0) return miss();
    }
    std::array<int64_t, kMaxDims> shape{};
    int ndim = 0;
    int64_t numel = 1;
    if (!parse_shape(args.ptr(), shape, ndim, numel)) return miss();
    c10::ScalarType stype;
    if (dtype.is_none()) {
      stype = c10::typeMetaToScalarType(c10::get_default_dtype());
    } else if (THPDtype_Check(dtype.ptr())) {
      stype = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
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

    auto* slot = new Slot();
    slot->state = st_;
    slot->size = size;
    slot->nbytes = nbytes;
    slot->dtype = static_cast<int8_t>(st_index);
    slot->ndim = static_cast<int8_t>(ndim);
    slot->shape = shape;
    {
      std::lock_guard<std::mutex> guard(st_->mu);
      auto it = st_->kept.find(size);
      // Queued releases first (Python applies them: Pool._refill); then a kept range of the size.
      if (!st_->queue.empty() || it == st_->kept.end() || it->second.empty()) {
        delete slot;
        return miss();
      }
      std::tie(slot->region, slot->address) = it->second.back();
      it->second.pop_back();
      st_->kept_count -= 1;
      // Linked (and holding the pool) before the tensor exists: if making it throws, the
      // deleter that torch then runs puts the range back like any release of an uncounted block.
      slot->serial = st_->next_serial++;
      slot->prev = st_->fresh.prev;
      slot->next = &st_->fresh;
      st_->fresh.prev->next = slot;
      st_->fresh.prev = slot;
      if (st_->live++ == 0) Py_INCREF(st_->pool);  // the pool lives while a block made here does
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
      return miss();  // the slot is gone with the context torch dropped (release_slot ran)
    }
    slot->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(tensor.storage().getWeakStorageImpl());
    Py_INCREF(owner);
    {
      std::lock_guard<std::mutex> guard(st_->mu);
      slot->owner = owner;
      slot->counted = true;
      st_->allocs += 1;
      st_->allocated += size;
      if (st_->allocated > st_->peak) st_->peak = st_->allocated;
    }
    hits += 1;
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensor)));
  }

  // An UntypedStorage of `nbytes` at `address` for a block Python placed itself
  // (compaction destinations, adopt): (storage, serial). Its release is queued
  // by serial like a collected block's; the caller maps the serial to its block
  // before the storage can die. Cheaper than a Python owner with a weakref hook.
  py::tuple storage(uintptr_t address, int64_t nbytes) {
    if (nbytes <= 0) throw py::value_error("a pool storage needs at least one byte");
    auto* slot = new Slot();
    slot->state = st_;
    slot->address = address;
    slot->collected = true;
    uint64_t serial;
    {
      std::lock_guard<std::mutex> guard(st_->mu);
      serial = slot->serial = st_->next_serial++;
      if (st_->live++ == 0) Py_INCREF(st_->pool);
    }
    // From here the storage owns the slot: if anything below fails, its deleter
    // queues the serial, which Python, not knowing it, ignores.
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                         c10::DataPtr(reinterpret_cast<void*>(address), slot, &release_slot, device_), nullptr, false);
    PyObject* wrapped = THPStorage_Wrap(std::move(storage));
    if (wrapped == nullptr) throw py::error_already_set();
    return py::make_tuple(py::reinterpret_steal<py::object>(wrapped), serial);
  }

  // Keep a freed range for the next request of its size (Core.free(keep=True)).
  void put(int64_t size, int32_t region, uintptr_t address) {
    std::lock_guard<std::mutex> guard(st_->mu);
    st_->kept[size].emplace_back(region, address);
    st_->kept_count += 1;
  }

  // A kept range of `size`, or None (Core.place).
  py::object take(int64_t size) {
    std::pair<int32_t, uintptr_t> where;
    {
      std::lock_guard<std::mutex> guard(st_->mu);
      auto it = st_->kept.find(size);
      if (it == st_->kept.end() || it->second.empty()) return py::none();
      where = it->second.back();
      it->second.pop_back();
      st_->kept_count -= 1;
    }
    return py::make_tuple(where.first, where.second);
  }

  // Every kept range, removed (Core.flush_reuse).
  std::vector<std::pair<int32_t, uintptr_t>> take_all() {
    std::vector<std::pair<int32_t, uintptr_t>> out;
    std::lock_guard<std::mutex> guard(st_->mu);
    out.reserve(st_->kept_count);
    for (auto& entry : st_->kept) {
      out.insert(out.end(), entry.second.begin(), entry.second.end());
      entry.second.clear();
    }
    st_->kept_count = 0;
    return out;
  }

  int64_t kept_count() {
    std::lock_guard<std::mutex> guard(st_->mu);
    return st_->kept_count;
  }

  // A release of the Python path's (token: Python's name for the block), queued
  // in order with this object's own (any thread, with the GIL).
  void queue_python(uint64_t token) {
    std::lock_guard<std::mutex> guard(st_->mu);
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
      std::lock_guard<std::mutex> guard(st_->mu);
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
                                    py::reinterpret_steal<py::object>(m.owner),
                                    reinterpret_cast<uintptr_t>(m.weak),
                                    py::reinterpret_borrow<py::object>(dtype_objects_[m.dtype]), shape);
    }
    return py::make_tuple(made_list, entries(released), allocs, frees, peak);
  }

  // Only the queued releases (see collect()); blocks made here stay uncollected.
  py::list collect_released() {
    std::vector<Entry> released;
    {
      std::lock_guard<std::mutex> guard(st_->mu);
      released.swap(st_->queue);
    }
    return entries(released);
  }

  // The pool closed: no more fast allocations; every later release of a
  // collected block calls pool._release_after_close() (with the GIL).
  void close() {
    enabled = false;
    std::lock_guard<std::mutex> guard(st_->mu);
    st_->closed = true;
  }

  int64_t live() {
    std::lock_guard<std::mutex> guard(st_->mu);
    return st_->live;
  }

 private:
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

  py::object miss() {
    misses += 1;
    return py::none();
  }

  // args: the shape as pool.empty received it (ints, or one tuple/list/torch.Size of ints).
  static bool parse_shape(PyObject* args, std::array<int64_t, kMaxDims>& shape, int& ndim, int64_t& numel) {
    PyObject* seq = args;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n == 1 && !PyLong_CheckExact(PyTuple_GET_ITEM(args, 0))) {
      seq = PyTuple_GET_ITEM(args, 0);
      if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;  // torch.Size is a tuple subclass
      n = PySequence_Fast_GET_SIZE(seq);
    }
    if (n > kMaxDims) return false;
    PyObject** items = PySequence_Fast_ITEMS(seq);
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
      std::lock_guard<std::mutex> guard(st_->mu);
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
#ifdef DEFRAG_SWAP_STORAGES
  m.def("swap_storages", &swap_storages, "A compaction wave's storage swaps, after every check (see the source).");
#endif
  py::class_<FastPath>(m, "FastPath")
      .def(py::init<py::object, py::dict, py::object, py::list, std::string, int, int, int64_t>())
      .def("empty", &FastPath::empty)
      .def("put", &FastPath::put)
      .def("storage", &FastPath::storage)
      .def("take", &FastPath::take)
      .def("take_all", &FastPath::take_all)
      .def("kept_count", &FastPath::kept_count)
      .def("collect", &FastPath::collect)
      .def("collect_released", &FastPath::collect_released)
      .def("queue_python", &FastPath::queue_python)
      .def("close", &FastPath::close)
      .def("live", &FastPath::live)
      .def_readwrite("enabled", &FastPath::enabled)
      .def_readonly("hits", &FastPath::hits)
      .def_readonly("misses", &FastPath::misses);
}
