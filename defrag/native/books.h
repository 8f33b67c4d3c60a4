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
#include <unordered_map>
#include <utility>
#include <vector>

#include "heap.h"

namespace defrag_native {

// How many books the calling thread holds now (`Books::hold`: it is inside some pool's gate, running
// the pool's own Python code). Read without a lock by the CPU allocator (module.cpp): an allocation
// made by the pool's own code goes to PyTorch's previous allocator, never back into a pool.
inline thread_local int books_held_here = 0;

struct RegionBooks {
  std::shared_ptr<Heap> heap;
  int64_t base = 0;
  int64_t npages = 0;
  // Live (or retired) blocks touching each page; fixed size, so Python's numpy view stays valid.
  std::unique_ptr<int64_t[]> counts;
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
    regions_.push_back(std::move(r));
    return static_cast<int>(regions_.size()) - 1;
  }

  int64_t* counts(int region) { return at(region).counts.get(); }
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
    // Blocks lie on mapped pages only: a page is empty exactly when its count is 0.
    for (int64_t p = first; p < end; ++p) {
      const int64_t before = c[p];
      const int64_t after = before + delta;
      c[p] = after;
      if (before == 0 && after != 0) empty_ -= 1;
      if (before != 0 && after == 0) empty_ += 1;
    }
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
          regions_.at(region).heap->free(address);
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
      if (!by_region[i].empty()) regions_[i].heap->free_many(by_region[i]);
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
  int held_ = 0;
  int placing_ = 0;  // native placements between taking a range and linking their block
  std::condition_variable placed_;
};

}  // namespace defrag_native
