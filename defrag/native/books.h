// A pool's books in native code: every region's heap, the live count of each
// page, the count of mapped pages no block touches, and the freed ranges kept
// carved per size for the next request of that size. One `Books` per pool
// (`defrag.core.Core.books`), under one mutex.
//
// Two kinds of callers:
// - Python (the core, with the pool's gate held): every method below takes the
//   mutex for its own duration, so each call is atomic.
// - Native allocation and release (the fast path's `empty()` and its storages'
//   deleters, any thread, GIL or not): `place_mapped` and `release_range`
//   under the mutex, refused while Python holds the books (`hold`), so that a
//   multi-step Python operation (a compaction's plan, a placement that maps
//   pages) never sees them change under it.
//
// Placement here is exactly the core's when no page must be mapped: a kept
// range of the exact size (last in, first out), else every kept range back to
// its heap and best fit in each region in order (`defrag.core.Core.place`).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pybind11/numpy.h>

#include "heap.h"

namespace defrag_native {

// How many books the calling thread holds now (`Books::hold`: it is inside some pool's gate, running
// the pool's own Python code). Read without a lock by the CPU allocator (module.cpp): an allocation
// made by the pool's own code goes to PyTorch's previous allocator, never back into a pool.
inline thread_local int books_held_here = 0;

// A page's part in a mesh (RegionBooks::role).
enum MeshRole : int8_t { kNoMesh = 0, kPrimary = 1, kTwin = 2 };

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

class Books {
 public:
  explicit Books(int64_t page_size) : page_size_(page_size) {
    if (page_size <= 0) throw std::invalid_argument("page size must be positive");
  }

  std::mutex mu;

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
    regions_.push_back(std::move(r));
    return static_cast<int>(regions_.size()) - 1;
  }

  int64_t* counts(int region) { return at(region).counts.get(); }
  int32_t* mesh_ids(int region) { return at(region).mesh.get(); }
  int8_t* roles(int region) { return at(region).role.get(); }
  int64_t npages(int region) { return at(region).npages; }

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

  // A block's range is free and nothing uses it any more: off its pages, kept for its size.
  void release_range(int64_t size, int region, int64_t address) {
    std::lock_guard<std::mutex> guard(mu);
    release_range_locked(size, region, address);
  }

  // -- Python holds the books (the pool's gate): native placement and release wait their turn.
  // `hold` also waits for every native placement already under way to finish (`begin_placing`):
  // until then the books hold a range that no block the core can see owns yet.
  void hold() {
    std::unique_lock<std::mutex> lock(mu);
    held_ += 1;
    placed_.wait(lock, [this] { return placing_ == 0; });
    books_held_here += 1;
  }
  void unhold() {
    std::lock_guard<std::mutex> guard(mu);
    if (held_ > 0) held_ -= 1;
    if (books_held_here > 0) books_held_here -= 1;
  }
  bool held_locked() const { return held_ > 0; }

  // A native placement took a range and will make it a block Python can collect (mutex held):
  // `end_placing` once it has, or once the range went back.
  void begin_placing_locked() { placing_ += 1; }
  void end_placing_locked() {
    if (--placing_ == 0) placed_.notify_all();
  }

  // The native placement (mutex held by the caller): (region, address) of a block of `size` (rounded)
  // in mapped free space, counted on its pages; nullopt when pages must be mapped (Python's ladder).
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

  void release_range_locked(int64_t size, int region, int64_t address) {
    account_locked(region, address, size, -1);
    put_locked(size, region, address);
  }

  // -- meshes (docs/meshing.md, "How the books hold a mesh"). Python calls these with the books held
  // (`hold`), after `Core.settle`; each takes the mutex and flushes kept ranges first.

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
  int held_ = 0;
  int placing_ = 0;  // native placements between taking a range and linking their block
  std::condition_variable placed_;
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
