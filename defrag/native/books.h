// A pool's books in native code: the one record of every block of the pool, every region's heap,
// the live count of each page, the count of mapped pages no block touches, the freed ranges kept
// carved per size for the next request of that size, the releases that wait, and the block
// counters. One `Books` per pool (`defrag.core.Core.books`), under one mutex.
//
// The record (`Record`): every block the pool holds has exactly one, from its placement to its
// release, whoever placed it (the Python core's ladder, the fast path's `pool.empty`, PyTorch's CPU
// or CUDA allocator entries) and whoever releases it (a storage's deleter in any thread, PyTorch's
// free, the face's Python code). It says where the block is (address, size, region), its state
// (counted, retired, pending) and what its face keeps about it (a Python object, made lazily for
// blocks native code placed). Python keeps no list of blocks of its own: it asks the books
// (`records`, `face_at`).
//
// Callers:
// - Python (the core) enters the books (`enter`/`leave`, the pool's lock, reentrant per thread)
//   around every multi-step operation: while a thread is inside, native placement declines and
//   releases wait in the queue, applied in order when the last level is left (or at `apply_queued`),
//   so a compaction's plan or a placement that maps pages never sees the books change under it.
// - Native allocation and release (the fast path's `empty()`, its storages' deleters, the
//   allocator entries; any thread, GIL or not) take the mutex only for their critical section.
//   Nothing here waits for the GIL: Python objects a release lets go of are dropped the next time a
//   thread holding the GIL calls in (`drop_garbage`).
//
// Placement here is exactly the core's when no page must be mapped: a kept range of the exact size
// (last in, first out), else every kept range back to its heap and best fit in each region in order
// (`defrag.core.Core.place`).
#pragma once

#include <Python.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/numpy.h>

#include "heap.h"
#include "streams.h"

namespace defrag_native {

// How many books the calling thread is inside now (`Books::enter`: it runs the pool's own code).
// Read without a lock by the CPU allocator (cpu_allocator.cpp): an allocation made by the pool's own
// code goes to PyTorch's previous allocator, never back into a pool.
inline thread_local int books_held_here = 0;

// A page's part in a mesh (RegionBooks::role).
enum MeshRole : int8_t { kNoMesh = 0, kPrimary = 1, kTwin = 2 };

// Who placed a block: the face's Python code (its ladder), the fast path (`pool.empty`, a thread
// Python never saw), or PyTorch's CPU/CUDA allocator entries.
enum Origin : uint8_t { kPython = 0, kFastPath = 1, kAllocator = 2 };
// What the last owner match found for a PyTorch-made block: no storage reachable from Python starts
// at it with its allocator's DataPtr; exactly one (`Record::storage`), which may take a new address;
// or another storage over its bytes as well (two storages, or one made over exported memory).
// kNotMatched: placed since the last match (or never matched).
enum OwnerState : uint8_t { kNoOwnerFound = 0, kOwned = 1, kShared = 2, kNotMatched = 3 };
// Why a PyTorch-made block never moves for the rest of its life: its address was handed to another
// library (defrag.owners records the exports it sees).
enum Fixed : uint8_t { kNotFixed = 0, kNumpy = 1, kDlpack = 2, kCudaArrayInterface = 3, kIpc = 4, kGraph = 5 };

constexpr int kMaxDims = 8;

class Books;

// One block of the pool: the books' only record of it. Fields change under the books' mutex.
struct Record {
  int64_t address = 0;
  int64_t size = 0;    // rounded to the alignment: the heap's size
  int64_t nbytes = 0;  // what was asked for
  int32_t region = 0;
  Origin origin = kPython;
  bool counted = true;    // in the allocated bytes (a compaction's destination counts once swapped in)
  bool retired = false;   // an old location whose data moved, or a destination not swapped in yet
  bool pending = false;   // released, waiting for the device (stream events) before its range is free
  bool released = false;  // its user is gone: a release was asked for (applied, queued or pending)
  // A native context names this record (a storage's DataPtr, a raw pointer PyTorch holds): only its
  // release ends the record, and `keep` holds the books until then.
  bool attached = false;
  std::shared_ptr<Books> keep;
  // Streams (CUDA; see streams.h): the one it was placed for, the others that used it, and while
  // pending the events its range waits for (nullptr: one that could not be recorded, done only at
  // the next device synchronize).
  uintptr_t stream = 0;
  std::vector<uintptr_t> uses;
  std::vector<void*> events;
  PyObject* face = nullptr;   // strong: the face's object for this block; nullptr until made
  PyObject* owner = nullptr;  // strong: the placing thread's owner reference (native placements)
  // What the fast path made it as (for the face it makes later): dtype, shape, and the storage's
  // weak pointer (a c10 StorageImpl with one weak count of ours; dropped by `Books::drop_native`).
  int8_t dtype = 0;
  int8_t ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  void* storage = nullptr;
  // PyTorch-made blocks (origin kAllocator) only, written by the owner match at a safe point
  // (module.cpp `FastPath::match_owners`): whether one storage alone owns the block (`storage` then
  // names it), and why it never moves whatever the match finds (memory exported to another library).
  OwnerState held = kNotMatched;
  Fixed fixed = kNotFixed;
};

// The block counters, in bytes and events, with their peaks (PyTorch's meaning: allocated blocks are
// counted ones; active ones are allocated plus pending).
struct Counters {
  int64_t allocated = 0, allocated_peak = 0;
  int64_t pending = 0, active_peak = 0;
  int64_t allocs = 0, frees = 0;
  void add(int64_t bytes) {
    allocated += bytes;
    if (allocated > allocated_peak) allocated_peak = allocated;
    if (allocated + pending > active_peak) active_peak = allocated + pending;
  }
};

struct RegionBooks {
  std::shared_ptr<Heap> heap;
  int64_t base = 0;
  int64_t npages = 0;
  // Live (or retired) blocks touching each page; fixed size, so Python's numpy view stays valid.
  std::unique_ptr<int64_t[]> counts;
  // Meshes (docs/meshing.md): each page's mesh id (-1: none) and role, fixed size like `counts`.
  std::unique_ptr<int32_t[]> mesh;
  std::unique_ptr<int8_t[]> role;
  int64_t twins = 0;  // twin pages in this region: 0 skips the free redirect
  // Pages the device is done with (the backing's `idle`: empty at the last synchronize it made, or
  // mapped since, with no block counted on them after). Every placement clears its pages here, native
  // ones included, so a stitch from idle pages needs no synchronize (invariant 5). Python sets it.
  std::unique_ptr<bool[]> idle;
};

// Virtual pages of one region that map one physical page. Invariant: every byte offset of the page is
// managed by exactly one member's heap range (a twin manages only its live pieces, the primary the
// rest), so the primary's free space is what is free in every member.
struct Mesh {
  int region = 0;
  int64_t primary = 0;
  std::vector<int64_t> twins;
  int64_t live = 0;  // blocks counted on the members' pages, summed
};

// What a release left for Python to do once the mutex is let go (`Books::after_release`).
struct Aftermath {
  bool last = false;    // the last attached record or lease went: drop the keeper's reference
  bool notify = false;  // the pool closed: call its close hook
};

class Books : public std::enable_shared_from_this<Books> {
 public:
  explicit Books(int64_t page_size) : page_size_(page_size) {
    if (page_size <= 0) throw std::invalid_argument("page size must be positive");
  }

  ~Books() {
    // Only records no native context names are left (an attached one keeps the books alive); their
    // Python objects were dropped by `clear_unattached` or go with the interpreter.
    for (auto& [address, r] : table_) delete r;
  }

  std::mutex mu;

  // What the fast path hands a record's `storage` back with (module.cpp sets it; books.h knows no torch).
  static inline void (*drop_native)(void*) = nullptr;

  // A new region's books (its heap made by the caller); returns its index.
  int add_region(std::shared_ptr<Heap> heap, int64_t base, int64_t npages) {
    if (!heap || npages <= 0) throw std::invalid_argument("a region needs a heap and at least one page");
    std::lock_guard<std::mutex> guard(mu);
    RegionBooks r;
    r.heap = std::move(heap);
    r.base = base;
    r.npages = npages;
    r.counts.reset(new int64_t[npages]());
    r.mesh.reset(new int32_t[npages]);
    std::fill(r.mesh.get(), r.mesh.get() + npages, -1);
    r.role.reset(new int8_t[npages]());
    r.idle.reset(new bool[npages]());
    regions_.push_back(std::move(r));
    return static_cast<int>(regions_.size()) - 1;
  }

  int64_t* counts(int region) { return at(region).counts.get(); }
  int32_t* mesh_ids(int region) { return at(region).mesh.get(); }
  int8_t* roles(int region) { return at(region).role.get(); }
  bool* idle(int region) { return at(region).idle.get(); }
  int64_t npages(int region) { return at(region).npages; }
  int64_t page_size() const { return page_size_; }

  int64_t empty() {
    std::lock_guard<std::mutex> guard(mu);
    return empty_;
  }
  void add_empty(int64_t delta) {
    std::lock_guard<std::mutex> guard(mu);
    empty_ += delta;
  }

  // Count a block on (+delta) or off (-delta) its pages, keeping the empty-page count.
  void account(int region, int64_t address, int64_t size, int64_t delta) {
    std::lock_guard<std::mutex> guard(mu);
    account_locked(region, address, size, delta);
  }

  // `account` for many blocks of one region, each with its own delta.
  void account_many(int region, const std::vector<int64_t>& addresses, const std::vector<int64_t>& sizes,
                    const std::vector<int64_t>& deltas) {
    if (sizes.size() != addresses.size() || deltas.size() != addresses.size())
      throw std::invalid_argument("account_many: addresses, sizes and deltas differ in length");
    std::lock_guard<std::mutex> guard(mu);
    RegionBooks& r = at(region);
    for (size_t i = 0; i < addresses.size(); ++i) check_span(r, addresses[i], sizes[i]);
    for (size_t i = 0; i < addresses.size(); ++i) account_locked(region, addresses[i], sizes[i], deltas[i]);
  }

  // -- kept ranges
  std::optional<std::pair<int, int64_t>> take(int64_t size) {
    std::lock_guard<std::mutex> guard(mu);
    return take_locked(size);
  }

  int64_t kept_count() {
    std::lock_guard<std::mutex> guard(mu);
    return kept_count_;
  }

  // Every kept range back to its heap, coalescing (the core's `flush_reuse`).
  void flush_kept() {
    std::lock_guard<std::mutex> guard(mu);
    flush_locked();
  }

  // ------------------------------------------------------------------ the pool's lock

  // Enter the books (the pool's lock; the caller has released the GIL): reentrant per thread. Waits
  // until no other thread is inside and no native placement is half-way (it took a range and is
  // making its tensor). False when `timeout_s` (>= 0) passed first (the caller tries again, letting
  // Python check for signals in between).
  bool enter(double timeout_s) {
    const auto me = std::this_thread::get_id();
    std::unique_lock<std::mutex> lock(mu);
    if (depth_ > 0 && holder_ == me) {
      depth_ += 1;
      return true;
    }
    waiting_ += 1;
    auto free = [this] { return depth_ == 0 && placing_ == 0; };
    bool got = true;
    if (timeout_s < 0) {
      entered_.wait(lock, free);
    } else {
      got = entered_.wait_for(lock, std::chrono::duration<double>(timeout_s), free);
    }
    waiting_ -= 1;
    if (!got) return false;
    holder_ = me;
    depth_ = 1;
    books_held_here += 1;
    return true;
  }

  // Leave one level (with the GIL); the last level applies the releases queued meanwhile, in order.
  Aftermath leave() {
    Aftermath after;
    {
      std::lock_guard<std::mutex> guard(mu);
      if (depth_ == 0 || holder_ != std::this_thread::get_id())
        throw std::logic_error("the calling thread is not inside these books");
      if (--depth_ > 0) return after;
      holder_ = std::thread::id();
      if (books_held_here > 0) books_held_here -= 1;
      apply_queue_locked(after);
      entered_.notify_all();
    }
    return after;
  }

  bool inside_here() {
    std::lock_guard<std::mutex> guard(mu);
    return depth_ > 0 && holder_ == std::this_thread::get_id();
  }

  // Whether native placement must decline now: a thread is inside the books or waits to enter.
  bool busy_locked() const { return depth_ > 0 || waiting_ > 0; }
  bool held_locked() const { return depth_ > 0; }
  bool recording_locked() const { return recording_; }

  // A Python object to drop the next time a caller holds the GIL (mutex held; never throws).
  void discard_locked(PyObject* o) noexcept {
    try {
      garbage_.push_back(o);
    } catch (...) {
      // no host memory to keep it: leaked (never dropped without the GIL)
    }
  }

  // A native placement took a range and will finish its tensor (mutex held): `end_placing` once it
  // has, or once the range went back. `enter` waits until none is half-way.
  void begin_placing_locked() { placing_ += 1; }
  void end_placing_locked() {
    if (--placing_ == 0) entered_.notify_all();
  }

  // ------------------------------------------------------------------ records

  // Record a block the face's Python code placed (its range taken from the heap or a kept range by
  // the caller, inside the books) for `stream`: counted on its pages and, if `counted`, in the
  // counters. `face` (a new reference is taken) is the face's object for it. `accounted`: its pages
  // count it already (a compaction's destination, taken by the wave's books). std::invalid_argument
  // if a record holds that address already (nothing changed). The caller fences `stream` first
  // (`fence`).
  Record* add(PyObject* face, int region, int64_t address, int64_t size, int64_t nbytes, bool counted,
              bool retired, uintptr_t stream, bool accounted) {
    std::lock_guard<std::mutex> guard(mu);
    if (table_.count(address)) throw std::invalid_argument("a block is recorded at " + std::to_string(address) + " already");
    check_span(at(region), address, size);
    auto* r = new Record();
    r->address = address;
    r->size = size;
    r->nbytes = nbytes;
    r->region = region;
    r->counted = counted;
    r->retired = retired;
    r->stream = stream;
    r->origin = kPython;
    table_.emplace(address, r);
    if (!accounted) account_locked(region, address, size, +1);
    if (counted) {
      counters_.allocs += 1;
      counters_.add(size);
    }
    Py_XINCREF(face);
    r->face = face;
    return r;
  }

  // The live blocks PyTorch's allocator entries placed (attached, not released or retired), sorted by
  // address (mutex held): what an owner match reads and writes (`held`, `storage`, `fixed`).
  std::vector<Record*> allocator_records_locked() const {
    std::vector<Record*> out;
    for (const auto& entry : table_) {
      Record* r = entry.second;
      if (r->origin == kAllocator && r->attached && !r->released && !r->retired) out.push_back(r);
    }
    std::sort(out.begin(), out.end(), [](const Record* a, const Record* b) { return a->address < b->address; });
    return out;
  }

  // The record at `address` whose face is `face` (either may be checked alone: face nullptr skips it);
  // nullptr when there is none.
  Record* find_locked(int64_t address, PyObject* face) {
    auto it = table_.find(address);
    if (it == table_.end()) return nullptr;
    if (face != nullptr && it->second->face != face) return nullptr;
    return it->second;
  }

  // Native placement (mutex held): a record of `size` (rounded; `nbytes` asked) in mapped free space,
  // counted, attached, logged while recording; nullptr when pages must be mapped (Python's ladder).
  // `first`: whether the caller must take the keeper's reference (see `attach_locked`).
  // Pending releases whose streams finished are applied first (`after`: what Python must do then).
  Record* place_locked(int64_t size, int64_t nbytes, Origin origin, bool& first, Aftermath& after,
                       uintptr_t stream = 0) {
    if (!pending_.empty()) poll_pending_locked(after);
    if (ops_ && !fences_.fence(*ops_, stream)) return nullptr;  // the Python path synchronizes instead
    auto where = place_mapped_locked(size);
    if (!where) return nullptr;
    auto* r = new Record();
    r->address = where->second;
    r->size = size;
    r->nbytes = nbytes;
    r->region = where->first;
    r->origin = origin;
    r->stream = stream;
    try {
      table_.emplace(r->address, r);
    } catch (...) {
      release_range_locked(size, where->first, where->second);
      delete r;
      throw;
    }
    first = attach_locked(r);
    counters_.allocs += 1;
    counters_.add(size);
    if (recording_) log_locked(1, r->address, nbytes);
    return r;
  }

  // A record the face's Python code placed for a native caller (`FastPath`'s room): attached to the
  // caller's context from now on, as if placed natively (its origin set, logged while recording).
  // nullptr when no record with that face is at `address`, or one is attached already.
  Record* adopt_locked(int64_t address, PyObject* face, Origin origin, bool& first) {
    Record* r = find_locked(address, face);
    if (r == nullptr || r->attached || r->released) return nullptr;
    r->origin = origin;
    first = attach_locked(r);
    if (recording_ && origin != kPython) log_locked(1, r->address, r->nbytes);
    return r;
  }

  // A native context names `r` from now on (mutex held): it ends only through `release`. Returns
  // whether the caller must take the keeper's reference (no record was attached and no lease held),
  // which it does with the GIL once the mutex is let go.
  bool attach_locked(Record* r) {
    if (r->attached) return false;
    const bool first = attached_ + leases_ == 0;
    r->attached = true;
    r->keep = shared_from_this();
    attached_ += 1;
    return first;
  }

  // A native owner reference for `r` (mutex held; `owner` is a new reference the record takes over),
  // and the thread behind it noted for the face (`take_owners`).
  void set_owner_locked(Record* r, PyObject* owner) {
    r->owner = owner;
    if (owner != nullptr && owner != last_owner_) {
      last_owner_ = owner;
      Py_INCREF(owner);
      new_owners_.push_back(owner);
    }
  }

  // The release of `r` (its user is gone): any thread, GIL or not, never throws. Applied now, or
  // queued while a thread is inside the books. Returns what Python must do after the mutex.
  Aftermath release(Record* r) noexcept {
    Aftermath after;
    std::lock_guard<std::mutex> guard(mu);
    release_locked(r, after);
    return after;
  }

  void release_locked(Record* r, Aftermath& after) noexcept {
    if (r->released) return;  // one user, one release
    r->released = true;
    if (!table_has(r)) {  // forgotten by a compaction, which settled its range and pages already
      finish_locked(r, after);
      return;
    }
    if (depth_ > 0) {
      try {
        queue_.push_back(r);
        return;
      } catch (...) {
        // no host memory for the queue: applied now, as if no thread were inside
      }
    }
    apply_locked(r, after);
  }

  // Apply every release queued while a thread was inside (the holder calls it at a safe point).
  Aftermath apply_queued() {
    Aftermath after;
    std::lock_guard<std::mutex> guard(mu);
    apply_queue_locked(after);
    return after;
  }

  // Drop the record of a block the face's Python code frees itself (inside the books): its range back
  // to the heap (or, `keep`, kept for its size), off its pages and the counters. The record must have
  // no native context (std::invalid_argument otherwise, nothing changed).
  void drop(Record* r, bool keep) {
    std::lock_guard<std::mutex> guard(mu);
    if (r->attached) throw std::invalid_argument("the block at " + std::to_string(r->address) + " is still named by a storage");
    Aftermath after;
    free_record_locked(r, keep, after);
  }

  // Re-address `records` (a compaction wave moved each owner in place; the heap and the pages were
  // updated by the wave): record i is at addresses[i] from now on. Checked first: each record in the
  // books, and no new address held by a record outside the batch (std::invalid_argument, nothing
  // changed).
  void move(const std::vector<Record*>& records, const std::vector<int64_t>& addresses) {
    if (records.size() != addresses.size()) throw std::invalid_argument("move: records and addresses differ in length");
    std::lock_guard<std::mutex> guard(mu);
    for (Record* r : records)
      if (!table_has(r) || r->pending) throw std::invalid_argument("move: a record is not a live block of the books");
    for (size_t i = 0; i < records.size(); ++i) {
      auto it = table_.find(addresses[i]);
      if (it != table_.end() &&
          std::find(records.begin(), records.end(), it->second) == records.end())
        throw std::invalid_argument("move: address " + std::to_string(addresses[i]) + " holds another block");
    }
    for (Record* r : records) table_.erase(r->address);
    for (size_t i = 0; i < records.size(); ++i) {
      records[i]->address = addresses[i];
      table_[addresses[i]] = records[i];
    }
  }

  // A compaction's swap through a destination: `from` (the old location) becomes retired and not
  // counted, `to` (its destination, retired and not counted so far) becomes live and counted.
  void exchange_state(Record* from, Record* to) {
    std::lock_guard<std::mutex> guard(mu);
    if (from->counted && !to->counted) {
      from->counted = false;
      to->counted = true;  // same size: the counters stay
    }
    to->retired = false;
    from->retired = true;
  }

  void set_retired(Record* r, bool retired) {
    std::lock_guard<std::mutex> guard(mu);
    r->retired = retired;
  }

  // Every record (of `region`, or all when -1), as the caller's visitor sees them (mutex held while it
  // runs: the visitor must not call back into the books).
  template <class Visit>
  void each_record(int region, Visit&& visit) {
    std::lock_guard<std::mutex> guard(mu);
    for (auto& [address, r] : table_)
      if (region < 0 || r->region == region) visit(r);
  }

  Record* at_address(int64_t address) {
    std::lock_guard<std::mutex> guard(mu);
    auto it = table_.find(address);
    return it == table_.end() ? nullptr : it->second;
  }

  int64_t record_count() {
    std::lock_guard<std::mutex> guard(mu);
    return static_cast<int64_t>(table_.size());
  }

  // Releases waiting for the thread inside to leave.
  int64_t queued_count() {
    std::lock_guard<std::mutex> guard(mu);
    return static_cast<int64_t>(queue_.size());
  }

  // ------------------------------------------------------------------ streams (streams.h)

  // How releases wait for the device: "none" (the emulated and memory-less devices: the device is
  // always done), "cuda" (libcuda's events; `context`: the device's primary context, made current
  // where a thread has none) or "fake" (a test's). Set once, before any block.
  void set_streams(const std::string& kind, uintptr_t context) {
    std::lock_guard<std::mutex> guard(mu);
    if (!table_.empty()) throw std::logic_error("set_streams: the books hold blocks already");
    if (kind == "none") {
      ops_.reset();
    } else if (kind == "cuda") {
      ops_ = std::make_unique<CudaEventOps>(context);
    } else if (kind == "fake") {
      ops_ = std::make_unique<FakeEventOps>();
    } else {
      throw std::invalid_argument("set_streams: kind must be none, cuda or fake, not " + kind);
    }
  }

  FakeEventOps* fake_streams() { return dynamic_cast<FakeEventOps*>(ops_.get()); }

  // Another stream used `r`'s block (PyTorch's record_stream): its release waits for that stream.
  void record_stream(Record* r, uintptr_t stream) {
    std::lock_guard<std::mutex> guard(mu);
    record_stream_locked(r, stream);
  }

  // `record_stream` for the live block of `origin` at `address`; false when there is none.
  bool record_stream_at(int64_t address, uintptr_t stream, Origin origin) {
    std::lock_guard<std::mutex> guard(mu);
    Record* r = find_locked(address, nullptr);
    if (r == nullptr || r->origin != origin || r->released) return false;
    record_stream_locked(r, stream);
    return true;
  }

  void record_stream_locked(Record* r, uintptr_t stream) {
    if (stream == r->stream || std::find(r->uses.begin(), r->uses.end(), stream) != r->uses.end()) return;
    r->uses.push_back(stream);
  }

  // Before the face's Python code places for `stream`: the fence of streams.h. False when an event
  // could not be recorded or waited for (the caller synchronizes the device, then `synchronized`).
  bool fence(uintptr_t stream) {
    std::lock_guard<std::mutex> guard(mu);
    return !ops_ || fences_.fence(*ops_, stream);
  }

  // Pending releases whose events completed: their ranges free now (any caller).
  Aftermath poll_pending() {
    Aftermath after;
    std::lock_guard<std::mutex> guard(mu);
    poll_pending_locked(after);
    return after;
  }

  // The device was synchronized (by the caller, just now): every pending release is done, and every
  // stream's frees are done for every other stream.
  Aftermath synchronized() {
    Aftermath after;
    std::lock_guard<std::mutex> guard(mu);
    std::vector<Record*> pending;
    pending.swap(pending_);
    for (Record* r : pending) {
      drop_events_locked(r);
      apply_done_locked(r, after);
    }
    fences_.synchronized();
    return after;
  }

  int64_t pending_count() {
    std::lock_guard<std::mutex> guard(mu);
    return static_cast<int64_t>(pending_.size());
  }

  // ------------------------------------------------------------------ counters

  Counters counters() {
    std::lock_guard<std::mutex> guard(mu);
    return counters_;
  }

  void reset_peaks() {
    std::lock_guard<std::mutex> guard(mu);
    counters_.allocated_peak = counters_.allocated;
    counters_.active_peak = counters_.allocated + counters_.pending;
  }

  // ------------------------------------------------------------------ history log

  // Start (true) or stop logging native placements and every release for the pool's history; either
  // way the events not taken yet are dropped.
  void set_recording(bool on) {
    std::lock_guard<std::mutex> guard(mu);
    recording_ = on;
    events_.clear();
    events_.shrink_to_fit();
  }

  bool recording() {
    std::lock_guard<std::mutex> guard(mu);
    return recording_;
  }

  // The events logged since the last call, oldest first: (1 alloc / 2 free, address, nbytes, time_us),
  // and how many could not be logged, ever.
  std::pair<std::vector<std::array<int64_t, 4>>, int64_t> take_events() {
    std::lock_guard<std::mutex> guard(mu);
    std::vector<std::array<int64_t, 4>> out;
    out.swap(events_);
    return {std::move(out), events_lost_};
  }

  size_t events_logged_locked() const { return events_.size(); }

  // ------------------------------------------------------------------ Python objects and lifetime

  // Owner references of threads that placed blocks natively since the last call (new references).
  std::vector<PyObject*> take_owners() {
    std::lock_guard<std::mutex> guard(mu);
    std::vector<PyObject*> out;
    out.swap(new_owners_);
    last_owner_ = nullptr;
    return out;
  }

  // Python objects releases let go of, for a caller holding the GIL to drop (outside the mutex).
  std::vector<PyObject*> take_garbage() {
    std::lock_guard<std::mutex> guard(mu);
    std::vector<PyObject*> out;
    out.swap(garbage_);
    return out;
  }

  // The object the books keep alive while a native context names one of their records or a lease is
  // held (the pool: its address space must outlive every block made here), and the callable a
  // release after `close` calls (with the GIL). Borrowed; set once, with the GIL.
  void set_keeper(PyObject* keeper) { keeper_ = keeper; }
  PyObject* keeper() const { return keeper_; }
  void set_close_hook(PyObject* hook) { close_hook_ = hook; }
  PyObject* close_hook() const { return close_hook_; }

  // A lease: the keeper stays alive while it is held (an install, C++ threads making blocks). Returns
  // whether the caller must take the keeper's reference (the first lease or record), with the GIL.
  bool take_lease_locked() { return leases_++ + attached_ == 0; }
  bool drop_lease_locked() { return --leases_ + attached_ == 0; }
  int64_t live_locked() const { return leases_ + attached_; }

  // The pool closed: every later release lets its close hook know.
  void close() {
    std::lock_guard<std::mutex> guard(mu);
    closed_ = true;
  }
  bool closed_locked() const { return closed_; }

  // Placement for a native caller (mutex held by it): a kept range of the size, else best fit.
  std::optional<std::pair<int, int64_t>> place_mapped_locked(int64_t size) {
    auto kept = take_locked(size);
    if (!kept) {
      if (kept_count_ > 0) flush_locked();
      for (size_t i = 0; i < regions_.size() && !kept; ++i) {
        if (auto address = regions_[i].heap->allocate(size)) kept.emplace(static_cast<int>(i), *address);
      }
      if (!kept) return std::nullopt;
    }
    account_locked(kept->first, kept->second, size, +1);
    return kept;
  }

  // A block's range is free and nothing uses it any more: off its pages, kept for its size.
  void release_range_locked(int64_t size, int region, int64_t address) {
    account_locked(region, address, size, -1);
    put_locked(size, region, address);
  }

  // Drop the record of each block a compaction vacated (its range and pages were settled by the wave,
  // `begin_moves`; its counters by `exchange_state`): out of the books at once. One that a native
  // context still names (its user's old storage, about to die) ends at its release; one whose
  // release is queued ends when the queue is applied; any other ends now.
  void forget(const std::vector<Record*>& records) {
    std::lock_guard<std::mutex> guard(mu);
    Aftermath after;
    for (Record* r : records) {
      if (!table_has(r)) continue;
      table_.erase(r->address);
      if (!r->attached && !r->released) finish_locked(r, after);
    }
  }

  // Every record no native context names, dropped (a pool discarded without giving its pages back):
  // their Python objects to the garbage. Records still named stay until their release.
  void clear_unattached() {
    std::lock_guard<std::mutex> guard(mu);
    Aftermath after;
    for (auto it = table_.begin(); it != table_.end();) {
      Record* r = it->second;
      if (r->attached || r->released) {
        ++it;
        continue;
      }
      it = table_.erase(it);
      finish_locked(r, after);
    }
  }

  // -- meshes (docs/meshing.md, "How the books hold a mesh"). Python calls these inside the books
  // (`enter`), after `Core.settle`; each takes the mutex and flushes kept ranges first.

  // Free the live block at `address` in its heap (the core's `free(keep=False)`), every piece of it on
  // a twin page going to its primary's heap; returns its rounded size.
  int64_t free(int region, int64_t address) {
    std::lock_guard<std::mutex> guard(mu);
    return free_locked(region, address);
  }

  // Make `twins` (page indices of `region`) twins of `primary` (an unmeshed page, or the primary of a
  // mesh, which grows): the twins' free bytes leave the heap, and so do the twins' live pieces at the
  // primary's offsets. Every member must hold live data, the twins' pieces must be pairwise disjoint
  // and free on the primary page: std::invalid_argument otherwise, before any change. Books only: the
  // caller maps the primary's physical page at the twins. Returns the mesh id.
  int32_t mesh(int region, int64_t primary, const std::vector<int64_t>& twins) {
    std::lock_guard<std::mutex> guard(mu);
    flush_locked();
    RegionBooks& r = at(region);
    auto pieces = check_mesh(r, primary, twins);
    for (size_t i = 0; i < twins.size(); ++i) {
      const int64_t tb = page_base(r, twins[i]);
      for (auto [lo, len] : r.heap->free_in(tb, tb + page_size_)) r.heap->remove_free(lo, len);
      for (auto [off, len] : pieces[i]) r.heap->remove_free(page_base(r, primary) + off, len);
    }
    int32_t id = r.mesh[primary];
    if (id < 0) {
      id = next_mesh_++;
      Mesh& m = meshes_[id];
      m.region = region;
      m.primary = primary;
      m.live = r.counts[primary];
      r.mesh[primary] = id;
      r.role[primary] = kPrimary;
    }
    Mesh& m = meshes_[id];
    for (int64_t t : twins) {
      m.twins.push_back(t);
      m.live += r.counts[t];
      r.mesh[t] = id;
      r.role[t] = kTwin;
      r.twins += 1;
    }
    return id;
  }

  // Take twin page `twin` out of its mesh (books only; the caller has mapped a physical page of its
  // own there, holding a copy of the shared page): its page minus its live pieces becomes its free
  // space again, and its live pieces become free on the primary. A mesh left alone dissolves. Also
  // the undo of `mesh`, twin by twin in reverse.
  void split(int region, int64_t twin) {
    std::lock_guard<std::mutex> guard(mu);
    flush_locked();
    RegionBooks& r = at(region);
    Mesh& m = twin_mesh(r, twin);
    const int64_t tb = page_base(r, twin), pb = page_base(r, m.primary);
    const auto pieces = r.heap->managed_in(tb, tb + page_size_);  // a twin manages only its pieces
    int64_t at = tb;
    for (auto [lo, len] : pieces) {
      if (lo > at) r.heap->insert_free(at, lo - at);
      r.heap->insert_free(pb + (lo - tb), len);
      at = lo + len;
    }
    if (at < tb + page_size_) r.heap->insert_free(at, tb + page_size_ - at);
    const int64_t before = m.live;
    m.live -= r.counts[twin];
    empty_ += (m.live == 0) - (before == 0) + (r.counts[twin] == 0);
    leave_locked(r, m, twin);
  }

  // Drop twin page `twin`, which holds no block and manages no byte (dormant), from its mesh: books
  // only, after the caller unmapped it. A mesh left alone dissolves.
  void drop_dormant(int region, int64_t twin) {
    std::lock_guard<std::mutex> guard(mu);
    flush_locked();
    RegionBooks& r = at(region);
    Mesh& m = twin_mesh(r, twin);
    const int64_t tb = page_base(r, twin);
    if (r.counts[twin] != 0 || !r.heap->managed_in(tb, tb + page_size_).empty())
      throw std::invalid_argument("twin page " + std::to_string(twin) + " still holds data");
    leave_locked(r, m, twin);
  }

  // The primary of `twin`'s mesh holds no block: `twin` becomes the primary (its heap takes the old
  // primary's free bytes at the same offsets) and the old primary a dormant twin. Books only (no copy:
  // they share one physical page). Returns the old primary.
  int64_t promote(int region, int64_t twin) {
    std::lock_guard<std::mutex> guard(mu);
    flush_locked();
    RegionBooks& r = at(region);
    Mesh& m = twin_mesh(r, twin);
    const int64_t old = m.primary, ob = page_base(r, old), tb = page_base(r, twin);
    if (r.counts[old] != 0) throw std::invalid_argument("the primary still holds blocks");
    for (auto [lo, len] : r.heap->free_in(ob, ob + page_size_)) {
      r.heap->remove_free(lo, len);
      r.heap->insert_free(tb + (lo - ob), len);
    }
    std::replace(m.twins.begin(), m.twins.end(), twin, old);
    m.primary = twin;
    r.role[twin] = kPrimary;
    r.role[old] = kTwin;
    return old;
  }

  // The bytes of meshed pages in [first, end) that their own page's heap does not manage (a twin's
  // page minus its pieces; on a primary, its twins' pieces), as (address, size): for a planner that
  // takes unoccupied bytes as free.
  std::vector<Heap::Range> unmanaged_in(int region, int64_t first, int64_t end) {
    std::lock_guard<std::mutex> guard(mu);
    RegionBooks& r = at(region);
    std::vector<Heap::Range> out;
    for (int64_t p = std::max<int64_t>(first, 0); p < std::min(end, r.npages); ++p) {
      if (r.role[p] == kNoMesh) continue;
      const int64_t pb = page_base(r, p);
      int64_t at = pb;
      for (auto [lo, len] : r.heap->managed_in(pb, pb + page_size_)) {
        if (lo > at) out.emplace_back(at, lo - at);
        at = lo + len;
      }
      if (at < pb + page_size_) out.emplace_back(at, pb + page_size_ - at);
    }
    return out;
  }

  // Every mesh as (id, region, primary, twins, live).
  std::vector<std::tuple<int32_t, int, int64_t, std::vector<int64_t>, int64_t>> meshes() {
    std::lock_guard<std::mutex> guard(mu);
    std::vector<std::tuple<int32_t, int, int64_t, std::vector<int64_t>, int64_t>> out;
    for (const auto& [id, m] : meshes_) out.emplace_back(id, m.region, m.primary, m.twins, m.live);
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  bool table_has(const Record* r) const {
    auto it = table_.find(r->address);
    return it != table_.end() && it->second == r;
  }

  // A release to apply now (mutex held, no thread inside): the range kept for its size, at once when
  // only its own stream used the block (that stream's order covers its reuse there; other streams
  // fence first), else once an event on each other stream that used it completed (`pending`).
  void apply_locked(Record* r, Aftermath& after) noexcept {
    try {
      if (ops_ && !r->uses.empty() && !r->retired && !closed_) {
        defer_locked(r);
        return;
      }
      free_record_locked(r, /*keep=*/true, after);
      if (ops_) fences_.freed(r->stream);
    } catch (...) {
      // Books that disagree with themselves (a bug), or no host memory: the record leaves the table
      // so nothing reuses its range twice; the range stays allocated in its heap (a leak, never a
      // double use).
      table_.erase(r->address);
      finish_locked(r, after);
    }
  }

  // `r` waits for an event on every stream that used it: active, not allocated, until they complete.
  void defer_locked(Record* r) {
    pending_.reserve(pending_.size() + 1);  // the one step that may throw, before any change
    for (uintptr_t stream : r->uses) r->events.push_back(ops_->record(stream));
    if (r->counted) {
      counters_.add(-r->size);
      counters_.pending += r->size;
      if (counters_.allocated + counters_.pending > counters_.active_peak)
        counters_.active_peak = counters_.allocated + counters_.pending;
      r->counted = false;
    }
    r->pending = true;
    pending_.push_back(r);
  }

  void poll_pending_locked(Aftermath& after) noexcept {
    size_t kept = 0;
    for (size_t i = 0; i < pending_.size(); ++i) {
      Record* r = pending_[i];
      bool done = true;
      for (void* e : r->events) done = done && e != nullptr && ops_->done(e);
      if (!done) {
        pending_[kept++] = r;
        continue;
      }
      drop_events_locked(r);
      apply_done_locked(r, after);
    }
    pending_.resize(kept);
  }

  void drop_events_locked(Record* r) noexcept {
    for (void* e : r->events)
      if (e != nullptr) ops_->destroy(e);
    r->events.clear();
  }

  // A pending record whose streams are done: its range is free for every stream.
  void apply_done_locked(Record* r, Aftermath& after) noexcept {
    try {
      free_record_locked(r, /*keep=*/true, after);
    } catch (...) {
      table_.erase(r->address);
      finish_locked(r, after);
    }
  }

  void apply_queue_locked(Aftermath& after) noexcept {
    if (queue_.empty()) return;
    std::vector<Record*> queue;
    queue.swap(queue_);
    for (Record* r : queue) {
      if (table_has(r)) {
        apply_locked(r, after);
      } else {
        finish_locked(r, after);  // forgotten meanwhile
      }
    }
  }

  // The block of `r` is gone: its range to the heap (`keep`: kept for its size), off its pages and
  // the counters, logged while recording; then the record ends.
  void free_record_locked(Record* r, bool keep, Aftermath& after) {
    if (keep) {
      release_range_locked(r->size, r->region, r->address);
    } else {
      free_locked(r->region, r->address);  // a piece on a mesh's twin page goes to its primary
      account_locked(r->region, r->address, r->size, -1);
    }
    auto it = table_.find(r->address);
    if (it != table_.end() && it->second == r) table_.erase(it);
    if (r->counted) {
      counters_.add(-r->size);
      counters_.frees += 1;
    } else if (r->pending) {
      counters_.pending -= r->size;
      counters_.frees += 1;
    }
    if (recording_ && !r->retired) log_locked(2, r->address, r->nbytes);
    finish_locked(r, after);
  }

  // The record ends (it is in no table any more): its Python objects to the garbage, its native
  // context's count and the keeper's lease; deleted. Every caller holds a reference to these books
  // besides the record's own (`keep`), so resetting it here never destroys them under the mutex.
  void finish_locked(Record* r, Aftermath& after) noexcept {
    try {
      if (r->face != nullptr) garbage_.push_back(r->face);
      if (r->owner != nullptr) garbage_.push_back(r->owner);
    } catch (...) {
      // no host memory to keep them: leaked (never dropped without the GIL)
    }
    r->face = r->owner = nullptr;
    if (r->storage != nullptr && drop_native != nullptr) drop_native(r->storage);
    if (r->attached) {
      r->attached = false;
      r->keep.reset();
      if (--attached_ + leases_ == 0) after.last = true;
      if (closed_) after.notify = true;
    }
    delete r;
  }

  // Log one event for the pool's history (mutex held). Never throws.
  void log_locked(int64_t kind, int64_t address, int64_t nbytes) noexcept {
    const auto now = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::system_clock::now().time_since_epoch());
    try {
      events_.push_back({kind, address, nbytes, static_cast<int64_t>(now.count())});
    } catch (...) {
      events_lost_ += 1;
    }
  }

  RegionBooks& at(int region) {
    if (region < 0 || static_cast<size_t>(region) >= regions_.size())
      throw std::out_of_range("no region " + std::to_string(region) + " in the books");
    return regions_[region];
  }

  void check_span(const RegionBooks& r, int64_t address, int64_t size) const {
    if (size <= 0 || address < r.base || address + size > r.base + r.npages * page_size_)
      throw std::invalid_argument("range (" + std::to_string(address) + ", " + std::to_string(size) +
                                  ") is outside its region");
  }

  void account_locked(int region, int64_t address, int64_t size, int64_t delta) {
    RegionBooks& r = at(region);
    check_span(r, address, size);
    const int64_t first = (address - r.base) / page_size_;
    const int64_t end = (address + size - 1 - r.base) / page_size_ + 1;
    int64_t* c = r.counts.get();
    const int32_t* mesh = r.mesh.get();
    if (delta > 0) std::fill(r.idle.get() + first, r.idle.get() + end, false);  // the device may use them now
    // Blocks lie on mapped pages only: a page is empty exactly when its count is 0; a mesh (one physical
    // page) is empty when the sum of its members' counts is.
    for (int64_t p = first; p < end; ++p) {
      int64_t before = c[p];
      int64_t after = before + delta;
      c[p] = after;
      if (mesh[p] >= 0) {
        Mesh& m = meshes_.find(mesh[p])->second;
        before = m.live;
        after = m.live = before + delta;
      }
      if (before == 0 && after != 0) empty_ -= 1;
      if (before != 0 && after == 0) empty_ += 1;
    }
  }

  int64_t page_base(const RegionBooks& r, int64_t page) const { return r.base + page * page_size_; }

  int64_t free_locked(int region, int64_t address) {
    RegionBooks& r = at(region);
    const int64_t size = r.heap->free(address);
    if (r.twins) redirect_locked(r, address, size);
    return size;
  }

  // A range just freed in its heap: each piece on a twin page leaves it (a twin holds no free space) and
  // becomes free at the same offsets of its primary. Those offsets were live only in that twin
  // (disjointness), so they are now free in every member.
  void redirect_locked(RegionBooks& r, int64_t address, int64_t size) {
    const int64_t end = address + size;
    for (int64_t p = (address - r.base) / page_size_; p < r.npages && page_base(r, p) < end; ++p) {
      if (r.role[p] != kTwin) continue;
      const int64_t pb = page_base(r, p);
      const int64_t lo = std::max(address, pb), hi = std::min(end, pb + page_size_);
      const Mesh& m = meshes_.find(r.mesh[p])->second;
      r.heap->remove_free(lo, hi - lo);
      r.heap->insert_free(page_base(r, m.primary) + (lo - pb), hi - lo);
    }
  }

  Mesh& twin_mesh(RegionBooks& r, int64_t twin) {
    if (twin < 0 || twin >= r.npages || r.role[twin] != kTwin)
      throw std::invalid_argument("page " + std::to_string(twin) + " is not a twin of a mesh");
    return meshes_.find(r.mesh[twin])->second;
  }

  // `twin` leaves mesh `m` (its heap surgery done); a mesh with no twin left dissolves.
  void leave_locked(RegionBooks& r, Mesh& m, int64_t twin) {
    m.twins.erase(std::find(m.twins.begin(), m.twins.end(), twin));
    r.mesh[twin] = -1;
    r.role[twin] = kNoMesh;
    r.twins -= 1;
    if (m.twins.empty()) {
      const int32_t id = r.mesh[m.primary];
      r.mesh[m.primary] = -1;
      r.role[m.primary] = kNoMesh;
      meshes_.erase(id);
    }
  }

  // `mesh`'s checks; the twins' live pieces (offsets in the page), one list per twin.
  std::vector<std::vector<Heap::Range>> check_mesh(RegionBooks& r, int64_t primary, const std::vector<int64_t>& twins) {
    auto bad = [](const std::string& why) { throw std::invalid_argument("cannot mesh: " + why); };
    auto page_ok = [&](int64_t p) { return p >= 0 && p < r.npages; };
    if (!page_ok(primary) || r.role[primary] == kTwin) bad("the primary is not a page of the region or is a twin");
    if (twins.empty()) bad("no twins");
    const int64_t pb = page_base(r, primary);
    if ((r.role[primary] == kPrimary ? meshes_.find(r.mesh[primary])->second.live : r.counts[primary]) <= 0)
      bad("the primary holds no block");
    std::vector<std::vector<Heap::Range>> pieces;
    std::vector<Heap::Range> all;
    for (int64_t t : twins) {
      if (!page_ok(t) || t == primary || r.role[t] != kNoMesh) bad("twin " + std::to_string(t) + " is meshed or not a page");
      if (r.counts[t] <= 0) bad("twin " + std::to_string(t) + " holds no block");
      if (std::count(twins.begin(), twins.end(), t) != 1) bad("twin " + std::to_string(t) + " given twice");
      const int64_t tb = page_base(r, t);
      pieces.emplace_back();
      for (auto [lo, len] : r.heap->live_pieces_in(tb, tb + page_size_)) {
        if (!r.heap->is_free(pb + (lo - tb), len)) bad("a piece of twin " + std::to_string(t) + " is not free on the primary");
        pieces.back().emplace_back(lo - tb, len);
        all.emplace_back(lo - tb, len);
      }
    }
    std::sort(all.begin(), all.end());
    for (size_t i = 1; i < all.size(); ++i)
      if (all[i - 1].first + all[i - 1].second > all[i].first) bad("the twins' pieces overlap");
    return pieces;
  }

  void put_locked(int64_t size, int region, int64_t address) {
    Kept& kept = kept_[size];
    kept.ranges.emplace_back(region, address);
    if (!kept.listed) {
      kept.listed = true;
      listed_.push_back(size);
    }
    kept_count_ += 1;
  }

  std::optional<std::pair<int, int64_t>> take_locked(int64_t size) {
    auto it = kept_.find(size);
    if (it == kept_.end() || it->second.ranges.empty()) return std::nullopt;
    auto where = it->second.ranges.back();
    it->second.ranges.pop_back();
    kept_count_ -= 1;
    return where;
  }

  void flush_locked() {
    if (kept_count_ == 0) return;
    if (kept_count_ == 1) {  // the common case (one range freed since the last other size): no batch
      for (int64_t size : listed_) {
        Kept& kept = kept_[size];
        if (!kept.ranges.empty()) {
          auto [region, address] = kept.ranges.back();
          free_locked(region, address);
          kept.ranges.clear();
        }
        kept.listed = false;
      }
      listed_.clear();
      kept_count_ = 0;
      return;
    }
    std::vector<std::vector<int64_t>> by_region(regions_.size());
    for (int64_t size : listed_) {
      Kept& kept = kept_[size];
      for (const auto& where : kept.ranges) by_region.at(where.first).push_back(where.second);
      kept.ranges.clear();
      kept.listed = false;
    }
    listed_.clear();
    kept_count_ = 0;
    for (size_t i = 0; i < by_region.size(); ++i) {
      if (by_region[i].empty()) continue;
      if (!regions_[i].twins) {
        regions_[i].heap->free_many(by_region[i]);
        continue;
      }
      for (int64_t address : by_region[i]) free_locked(static_cast<int>(i), address);
    }
  }

  int64_t page_size_;
  std::vector<RegionBooks> regions_;
  int64_t empty_ = 0;  // mapped pages that no block touches
  // Freed ranges kept carved: rounded size -> (region, address), last in first out. Off the page
  // counts (free in every statistic), still allocated in their heap until `flush_kept`.
  struct Kept {
    std::vector<std::pair<int, int64_t>> ranges;
    bool listed = false;  // in listed_
  };
  std::unordered_map<int64_t, Kept> kept_;
  std::vector<int64_t> listed_;  // every size whose ranges may be non-empty, once: what a flush visits
  int64_t kept_count_ = 0;
  std::unordered_map<int32_t, Mesh> meshes_;
  int32_t next_mesh_ = 0;
  // The records: every block by address (pending ones included, until their range is free).
  std::unordered_map<int64_t, Record*> table_;
  Counters counters_;
  std::vector<Record*> queue_;  // released while a thread was inside, in order
  std::vector<Record*> pending_;  // released, waiting for stream events (still in the table)
  std::unique_ptr<EventOps> ops_;  // none: the device is always done
  StreamFences fences_;
  // The pool's lock (`enter`/`leave`): the thread inside and how deep, the threads waiting for it,
  // native placements half-way.
  std::thread::id holder_;
  int depth_ = 0;
  int waiting_ = 0;
  int placing_ = 0;
  std::condition_variable entered_;
  // The history log (`set_recording`, `take_events`).
  bool recording_ = false;
  std::vector<std::array<int64_t, 4>> events_;
  int64_t events_lost_ = 0;
  // Python objects: let go of without the GIL (dropped by the next caller holding it), the owners of
  // native placements not yet told to the face, and the keeper and close hook (borrowed).
  std::vector<PyObject*> garbage_;
  std::vector<PyObject*> new_owners_;
  PyObject* last_owner_ = nullptr;
  PyObject* keeper_ = nullptr;
  PyObject* close_hook_ = nullptr;
  int64_t attached_ = 0;  // records a native context names
  int64_t leases_ = 0;
  bool closed_ = false;
};

// The meshes' part of the Books binding (module.cpp binds the rest on the same class).
template <class BooksClass>
void bind_books_mesh(BooksClass& cls) {
  namespace py = pybind11;
  auto view = [](std::shared_ptr<Books> self, auto* data, int region) {
    // A numpy view of one per-page array of a region, keeping the books alive.
    using T = std::remove_pointer_t<decltype(data)>;
    auto* keep = new std::shared_ptr<Books>(self);
    py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<Books>*>(p); });
    return py::array_t<T>({self->npages(region)}, {static_cast<py::ssize_t>(sizeof(T))}, data, base);
  };
  cls.def("mesh_ids", [view](std::shared_ptr<Books> self, int region) { return view(self, self->mesh_ids(region), region); })
      .def("idle", [view](std::shared_ptr<Books> self, int region) { return view(self, self->idle(region), region); })
      .def("roles", [view](std::shared_ptr<Books> self, int region) { return view(self, self->roles(region), region); })
      .def("free", &Books::free, py::arg("region"), py::arg("address"))
      .def("mesh", &Books::mesh, py::arg("region"), py::arg("primary"), py::arg("twins"))
      .def("split", &Books::split, py::arg("region"), py::arg("twin"))
      .def("drop_dormant", &Books::drop_dormant, py::arg("region"), py::arg("twin"))
      .def("promote", &Books::promote, py::arg("region"), py::arg("twin"))
      .def("unmanaged_in", &Books::unmanaged_in, py::arg("region"), py::arg("first"), py::arg("end"))
      .def("meshes", &Books::meshes);
}

}  // namespace defrag_native
