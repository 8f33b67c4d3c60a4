// defrag's heap in C++: best-fit free-range allocator over integer offsets
// [base, base+span), the same books as the Python model (tests/cpu/heap_model.py),
// call for call: same results, same errors, same messages.
//
// Guarantees:
// - Free ranges are sorted, disjoint, aligned and coalesced (no two touch);
//   live blocks never overlap each other or free space.
// - Every failing call throws HeapFailure (std::invalid_argument; HeapError in
//   Python) or std::overflow_error (a value past int64) and leaves the heap
//   unchanged: each method validates everything before its first change
//   (std::bad_alloc aside).
// - Best fit: `allocate` takes the smallest free range that fits, the lowest
//   offset among equal sizes; the block takes the low end of that range.
// - Managed extents (everything inserted and not removed, coalesced) change only
//   in `insert_free` and `remove_free`.
// - Single operations are O(log n); batches O(k log n); `live_blocks` sorts.
//
// The C++ entry points use no Python API, so the pool's native books may call
// them without the GIL. Not thread-safe: callers serialize (Python calls hold
// the GIL; native callers hold the pool's lock).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace defrag_native {

constexpr int64_t kAlignment = 512;  // defrag.units.ALIGNMENT

// A misuse of a Heap; reaches Python as defrag.errors.HeapError with this message.
struct HeapFailure : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

class Heap {
 public:
  using Range = std::pair<int64_t, int64_t>;  // (offset, size)

  const int64_t base, span, alignment;

  Heap(int64_t base_, int64_t span_, int64_t alignment_ = kAlignment)
      : base(base_), span(span_), alignment(checked_alignment(alignment_)) {
    if (base % alignment || span <= 0 || span % alignment)
      throw HeapFailure("base " + str(base) + " and span " + str(span) + " must be positive multiples of " +
                        str(alignment));
    if (base > std::numeric_limits<int64_t>::max() - span)
      throw std::overflow_error("base " + str(base) + " + span " + str(span) + " does not fit in int64");
  }

  // -- sizes -----------------------------------------------------------------------

  // Size rounded up to the alignment; HeapFailure if size is not positive.
  int64_t round_size(int64_t size) const {
    if (size <= 0) throw HeapFailure("size must be positive, got " + str(size));
    int64_t units = size / alignment + (size % alignment != 0);
    if (units > std::numeric_limits<int64_t>::max() / alignment)
      throw std::overflow_error("size " + str(size) + " rounded up does not fit in int64");
    return units * alignment;
  }

  // -- free space: the pool maps and unmaps pages -------------------------------------

  // Add [offset, offset+size) as free space, coalescing with free neighbours. HeapFailure if
  // misaligned, outside the span, or overlapping free space or a live block.
  void insert_free(int64_t offset, int64_t size) {
    check_range(offset, size);
    const int64_t end = offset + size;
    if (auto hit = overlapping(free_, offset, end))
      throw HeapFailure("range " + range_str(offset, size) + " overlaps free range " + range_str(*hit));
    if (overlapping(managed_, offset, end)) {  // managed but not free: a live block (error path: a scan)
      std::optional<Range> low;
      for (const auto& [o, s] : live_)
        if (o < end && o + s > offset && (!low || Range(o, s) < *low)) low = Range(o, s);
      throw HeapFailure("range " + range_str(offset, size) + " overlaps live block " + range_str(*low));
    }
    add_coalesced(offset, size);
    // Managed extents: coalesce with the extents that touch it on either side.
    if (auto right = managed_.find(end); right != managed_.end()) {
      size += right->second;
      managed_.erase(right);
    }
    if (auto it = managed_.lower_bound(offset); it != managed_.begin()) {
      --it;
      if (it->first + it->second == offset) {
        it->second += size;
        return;
      }
    }
    managed_.emplace(offset, size);
  }

  // Take [offset, offset+size), which must be entirely free, out of the free set, splitting the
  // free range holding it. HeapFailure if misaligned or if any byte is live or was never inserted.
  void remove_free(int64_t offset, int64_t size) {
    check_range(offset, size);
    auto hit = containing_free(offset, size);
    if (!hit) throw HeapFailure("range " + range_str(offset, size) + " is not entirely free");
    carve(hit->first, hit->second, offset, size);
    // The managed extent holding it (free space is managed) loses it too.
    auto it = std::prev(managed_.upper_bound(offset));
    const auto [start, length] = *it;
    managed_.erase(it);
    if (offset > start) managed_.emplace(start, offset - start);
    if (offset + size < start + length) managed_.emplace(offset + size, start + length - offset - size);
  }

  // -- blocks ---------------------------------------------------------------------------

  // Carve a block of `size` rounded up to the alignment; its offset, or nullopt when no single
  // free range fits (free space may still add up to more). HeapFailure if size <= 0.
  std::optional<int64_t> allocate(int64_t size) {
    size = round_size(size);
    fresh_by_size();
    auto it = by_size_.lower_bound(Range(size, std::numeric_limits<int64_t>::min()));
    if (it == by_size_.end()) return std::nullopt;
    const auto [length, start] = *it;
    carve(start, length, start, size);
    add_live(start, size);
    return start;
  }

  // Carve a block at exactly `offset`; returns `offset`. HeapFailure if `offset` is misaligned or
  // [offset, offset + rounded size) is not inside one free range.
  int64_t allocate_at(int64_t offset, int64_t size) {
    size = round_size(size);
    check_range(offset, size);
    auto hit = containing_free(offset, size);
    if (!hit) throw HeapFailure("range " + range_str(offset, size) + " is not entirely free");
    carve(hit->first, hit->second, offset, size);
    add_live(offset, size);
    return offset;
  }

  // Free the live block at `offset`, coalescing; returns its rounded size. HeapFailure if no live
  // block starts at `offset` (unknown or double free).
  int64_t free(int64_t offset) {
    auto it = live_.find(offset);
    if (it == live_.end()) throw HeapFailure(no_live_block(offset));
    const int64_t size = it->second;
    live_.erase(it);
    live_bytes_ -= size;
    add_coalesced(offset, size);
    return size;
  }

  // -- batches, all or nothing ------------------------------------------------------------

  // `allocate_at` for every (offset, size) of `ranges`, all or nothing.
  void allocate_many_at(const std::vector<Range>& ranges) { exchange({}, ranges); }

  // `free` every live block at `offsets`, coalescing, all or nothing.
  void free_many(const std::vector<int64_t>& offsets) { exchange(offsets, {}); }

  // Take every range of `takes`, then free every block of `frees`, all or nothing (a compaction
  // wave: its destinations taken, its old ranges given back). Every take must be free before the
  // frees. Checks, in the model's order (so the same misuse gets the same message): frees
  // distinct, then live; take sizes positive; then each take in (offset, size) order as
  // `allocate_at` would see it after the takes before it.
  void exchange(std::vector<int64_t> frees, std::vector<Range> takes) {
    std::sort(frees.begin(), frees.end());
    if (auto twice = std::adjacent_find(frees.begin(), frees.end()); twice != frees.end())
      throw HeapFailure("block at offset " + str(*twice) + " freed twice");
    for (int64_t offset : frees)
      if (!live_.count(offset)) throw HeapFailure(no_live_block(offset));
    std::sort(takes.begin(), takes.end());
    for (auto& take : takes) take.second = round_size(take.second);
    std::sort(takes.begin(), takes.end());  // rounding can reorder equal offsets
    // A take is free once the earlier ones are carved iff it lies in one free range now and starts
    // at or after the end of the previous take (they are sorted and, so far, disjoint).
    int64_t prev_end = std::numeric_limits<int64_t>::min();
    for (const auto& [offset, size] : takes) {
      check_range(offset, size);
      if (offset < prev_end || !containing_free(offset, size))
        throw HeapFailure("range " + range_str(offset, size) + " is not entirely free");
      prev_end = offset + size;
    }
    // Nothing below can fail: each take lies in one free range of the heap as carved so far, and
    // each freed block is live and disjoint from the takes (they were free).
    // A large batch (a compaction wave) leaves the size index to be rebuilt once, when next read:
    // one sorted build instead of a few tree updates per range, on nodes the batch left cold.
    const size_t batch = takes.size() + frees.size();
    if (batch >= kLazySizeIndexBatch) by_size_stale_ = true;
    if (batch >= kLazySizeIndexBatch && batch * kRebuildShare >= free_.size()) {
      rebuild_free(frees, takes);
      return;
    }
    for (const auto& [offset, size] : takes) {
      auto hit = containing_free(offset, size);
      carve(hit->first, hit->second, offset, size);
      add_live(offset, size);
    }
    for (int64_t offset : frees) free(offset);
  }

  // Rounded size of the live block at `offset`; HeapFailure if there is none.
  int64_t block_size(int64_t offset) const {
    auto it = live_.find(offset);
    if (it == live_.end()) throw HeapFailure("no live block at offset " + str(offset));
    return it->second;
  }

  // -- queries ---------------------------------------------------------------------------

  // True if every byte of [offset, offset+size) is free; HeapFailure if size <= 0.
  bool is_free(int64_t offset, int64_t size) const {
    if (size <= 0) throw HeapFailure("size must be positive, got " + str(size));
    return containing_free(offset, size).has_value();
  }

  // The free range that ends exactly at `end`, or nullopt. O(log n).
  std::optional<Range> free_range_ending_at(int64_t end) const {
    if (end == std::numeric_limits<int64_t>::min()) return std::nullopt;
    auto hit = containing_free(end - 1, 1);
    if (hit && hit->first + hit->second == end) return hit;
    return std::nullopt;
  }

  // The free range that starts exactly at `start`, or nullopt. O(log n).
  std::optional<Range> free_range_starting_at(int64_t start) const {
    auto it = free_.find(start);
    if (it == free_.end()) return std::nullopt;
    return *it;
  }

  // Free ranges, sorted by offset.
  std::vector<Range> free_ranges() const { return {free_.begin(), free_.end()}; }

  // Live blocks as (offset, rounded size), sorted by offset. O(n log n).
  std::vector<Range> live_blocks() const {
    std::vector<Range> out(live_.begin(), live_.end());
    std::sort(out.begin(), out.end());
    return out;
  }

  int64_t free_bytes() const { return free_bytes_; }
  int64_t live_bytes() const { return live_bytes_; }
  // Free plus live bytes: everything inserted minus everything removed.
  int64_t managed_bytes() const { return free_bytes_ + live_bytes_; }

  // Size of the largest free range (the largest `allocate` that succeeds), or 0.
  int64_t largest_free() const {
    fresh_by_size();
    return by_size_.empty() ? 0 : by_size_.rbegin()->first;
  }

  // Free bytes intersecting [start, end). O(log n + ranges touched). A page is empty exactly
  // when this equals its size.
  int64_t free_bytes_in(int64_t start, int64_t end) const {
    int64_t total = 0;
    auto it = free_.upper_bound(start);
    if (it != free_.begin()) --it;
    for (; it != free_.end() && it->first < end; ++it) {
      const int64_t lo = std::max(start, it->first), hi = std::min(end, it->first + it->second);
      if (hi > lo) total += hi - lo;  // compared before subtracting: no overflow for any start, end
    }
    return total;
  }

  // Free ranges clipped to [start, end), sorted. O(log n + ranges touched).
  std::vector<Range> free_in(int64_t start, int64_t end) const { return clipped(free_, start, end); }

  // Managed extents (free space and live blocks) clipped to [start, end), sorted. A mesh's twin page
  // manages only its live pieces, so these are its pieces (`Books`' meshes).
  std::vector<Range> managed_in(int64_t start, int64_t end) const { return clipped(managed_, start, end); }

  // Managed bytes of [start, end) that are not free (live blocks and ranges kept carved), clipped and
  // coalesced, sorted: a page's live pieces.
  std::vector<Range> live_pieces_in(int64_t start, int64_t end) const {
    std::vector<Range> out;
    const auto frees = free_in(start, end);
    size_t f = 0;
    for (auto [lo, len] : managed_in(start, end)) {
      int64_t at = lo;
      const int64_t hi = lo + len;
      while (f < frees.size() && frees[f].first + frees[f].second <= at) ++f;
      for (size_t g = f; g < frees.size() && frees[g].first < hi; ++g) {
        if (frees[g].first > at) out.emplace_back(at, frees[g].first - at);
        at = std::max(at, frees[g].first + frees[g].second);
      }
      if (at < hi) out.emplace_back(at, hi - at);
    }
    return out;
  }

  // HeapFailure if any structural invariant is broken. O(n log n); for tests.
  void check_invariants() const {
    auto fail = [](const std::string& why) { throw HeapFailure("heap invariant broken: " + why); };
    std::vector<Range> swapped;
    for (const auto& [o, s] : free_) swapped.emplace_back(s, o);
    std::sort(swapped.begin(), swapped.end());
    fresh_by_size();
    if (swapped != std::vector<Range>(by_size_.begin(), by_size_.end()))
      fail("size index out of sync with free ranges");
    auto bad = [&](int64_t o, int64_t s) { return s <= 0 || o % alignment || s % alignment; };
    auto outside = [&](int64_t o, int64_t s) { return o < base || o > base + span || s > base + span - o; };
    std::optional<int64_t> prev_end;
    int64_t free_sum = 0, live_sum = 0;
    for (const auto& [o, s] : free_) {
      if (bad(o, s)) fail("free range " + range_str(o, s) + " empty or misaligned");
      if (outside(o, s)) fail("free range " + range_str(o, s) + " outside the span");
      if (prev_end && o <= *prev_end) fail("free range " + range_str(o, s) + " overlaps or touches its left neighbour");
      prev_end = o + s;
      free_sum += s;
    }
    prev_end.reset();
    const auto live = live_blocks();
    for (const auto& [o, s] : live) {
      if (bad(o, s)) fail("live block " + range_str(o, s) + " empty or misaligned");
      if (outside(o, s)) fail("live block " + range_str(o, s) + " outside the span");
      if (prev_end && o < *prev_end) fail("live block " + range_str(o, s) + " overlaps its left neighbour");
      if (free_bytes_in(o, o + s)) fail("live block " + range_str(o, s) + " overlaps free space");
      prev_end = o + s;
      live_sum += s;
    }
    if (free_bytes_ != free_sum || live_bytes_ != live_sum) fail("byte counters do not add up");
    std::vector<Range> everything(free_.begin(), free_.end());
    everything.insert(everything.end(), live.begin(), live.end());
    std::sort(everything.begin(), everything.end());
    std::vector<Range> coalesced;
    for (const auto& [o, s] : everything) {
      if (!coalesced.empty() && coalesced.back().first + coalesced.back().second == o)
        coalesced.back().second += s;
      else
        coalesced.emplace_back(o, s);
    }
    if (std::vector<Range>(managed_.begin(), managed_.end()) != coalesced)
      fail("managed extents are not the free ranges and live blocks, coalesced");
  }

 private:
  std::map<int64_t, int64_t> free_;            // offset -> size of each free range
  // (size, offset) of each free range, for best fit. Stale (empty, not maintained) after a large batch
  // until the next read rebuilds it (`fresh_by_size`): readers are under the books' mutex or the GIL,
  // as every other use of the heap.
  mutable std::set<Range> by_size_;
  mutable bool by_size_stale_ = false;
  static constexpr size_t kLazySizeIndexBatch = 64;
  // A batch of at least 1/kRebuildShare as many ranges as there are free ranges rebuilds the free map
  // in one merge pass (`rebuild_free`) instead of a tree update per range: linear in the free ranges,
  // but sequential and allocation-friendly, where the per-range updates walk cold tree nodes.
  static constexpr size_t kRebuildShare = 4;
  std::unordered_map<int64_t, int64_t> live_;  // offset -> rounded size of each live block (no order needed)
  // Coalesced extents of everything inserted and not removed (free space and live blocks):
  // offset -> size. Only insert_free and remove_free change it (mapping and unmapping).
  std::map<int64_t, int64_t> managed_;
  int64_t free_bytes_ = 0, live_bytes_ = 0;

  static std::string str(int64_t v) { return std::to_string(v); }
  // As Python prints the tuple (offset, size).
  static std::string range_str(int64_t offset, int64_t size) { return "(" + str(offset) + ", " + str(size) + ")"; }
  static std::string range_str(const Range& r) { return range_str(r.first, r.second); }
  static std::string no_live_block(int64_t offset) {
    return "no live block at offset " + str(offset) + " (unknown or already freed)";
  }

  static int64_t checked_alignment(int64_t alignment) {
    if (alignment <= 0) throw HeapFailure("alignment must be positive, got " + str(alignment));
    return alignment;
  }

  // A positive aligned size at an aligned offset, inside the span. Written so that no sum
  // overflows, whatever the arguments: base + span fits (checked at construction).
  void check_range(int64_t offset, int64_t size) const {
    if (size <= 0 || offset % alignment || size % alignment)
      throw HeapFailure("range " + range_str(offset, size) + " must be a positive size aligned to " + str(alignment));
    const int64_t limit = base + span;
    if (offset < base || offset > limit || size > limit - offset)
      throw HeapFailure("range " + range_str(offset, size) + " outside [" + str(base) + ", " + str(limit) + ")");
  }

  // The ranges of `ranges` (sorted, disjoint) intersecting [start, end), clipped to it.
  static std::vector<Range> clipped(const std::map<int64_t, int64_t>& ranges, int64_t start, int64_t end) {
    std::vector<Range> out;
    auto it = ranges.upper_bound(start);
    if (it != ranges.begin()) --it;
    for (; it != ranges.end() && it->first < end; ++it) {
      const int64_t lo = std::max(start, it->first), hi = std::min(end, it->first + it->second);
      if (hi > lo) out.emplace_back(lo, hi - lo);
    }
    return out;
  }

  // The last range of `ranges` starting before `end`, if it overlaps [offset, end). The ranges
  // are disjoint and sorted, so that one reaches furthest.
  static std::optional<Range> overlapping(const std::map<int64_t, int64_t>& ranges, int64_t offset, int64_t end) {
    auto it = ranges.lower_bound(end);
    if (it == ranges.begin()) return std::nullopt;
    --it;
    if (it->first + it->second > offset) return Range(*it);
    return std::nullopt;
  }

  // The free range holding all of [offset, offset+size) (size > 0), or nullopt. Exact for any
  // int64 arguments: the gap from the range's start is computed unsigned.
  std::optional<Range> containing_free(int64_t offset, int64_t size) const {
    auto it = free_.upper_bound(offset);
    if (it == free_.begin()) return std::nullopt;
    --it;
    const auto [start, length] = *it;
    const uint64_t gap = uint64_t(offset) - uint64_t(start), room = uint64_t(length);
    if (gap <= room && uint64_t(size) <= room - gap) return Range(start, length);
    return std::nullopt;
  }

  // -- free-range primitives (no validation) --
  // A range that changes is re-keyed in place: its map and size-index nodes are reused, so the
  // common cases (a block taking the low end, a free merging with a neighbour) allocate nothing.

  using FreeIt = std::map<int64_t, int64_t>::iterator;

  // The size index rebuilt from the free ranges if a batch left it stale: sorted once, built in order.
  void fresh_by_size() const {
    if (!by_size_stale_) return;
    std::vector<Range> swapped;
    swapped.reserve(free_.size());
    for (const auto& [o, s] : free_) swapped.emplace_back(s, o);
    std::sort(swapped.begin(), swapped.end());
    by_size_.clear();
    for (const Range& r : swapped) by_size_.emplace_hint(by_size_.end(), r);
    by_size_stale_ = false;
  }

  void add_range(int64_t offset, int64_t size) {
    free_.emplace(offset, size);
    if (!by_size_stale_) by_size_.emplace(size, offset);
    free_bytes_ += size;
  }

  int64_t drop_range(FreeIt it) {
    const auto [offset, size] = *it;
    if (!by_size_stale_) by_size_.erase(Range(size, offset));
    free_.erase(it);
    free_bytes_ -= size;
    return size;
  }

  // Make free range `it` (offset, size). The new range must not reach past the old one's
  // neighbours, so its place among the offsets is the old one's.
  void reshape(FreeIt it, int64_t offset, int64_t size) {
    if (!by_size_stale_) {
      auto by_size = by_size_.extract(Range(it->second, it->first));
      by_size.value() = Range(size, offset);
      by_size_.insert(std::move(by_size));
    }
    free_bytes_ += size - it->second;
    if (offset == it->first) {
      it->second = size;
      return;
    }
    const auto next = std::next(it);
    auto node = free_.extract(it);
    node.key() = offset;
    node.mapped() = size;
    free_.insert(next, std::move(node));
  }

  // Add a free range, merging with a free neighbour on either side.
  void add_coalesced(int64_t offset, int64_t size) {
    auto right = free_.find(offset + size);
    auto left = free_.lower_bound(offset);
    if (left != free_.begin() && std::prev(left)->first + std::prev(left)->second == offset) {
      --left;
      const int64_t grown = left->second + size + (right != free_.end() ? drop_range(right) : 0);
      reshape(left, left->first, grown);
    } else if (right != free_.end()) {
      reshape(right, offset, size + right->second);
    } else {
      add_range(offset, size);
    }
  }

  // Take [offset, offset+size) out of free range (start, length), keeping the remnants.
  void carve(int64_t start, int64_t length, int64_t offset, int64_t size) {
    const auto it = free_.find(start);
    const int64_t before = offset - start, after = start + length - offset - size;
    if (before > 0) {
      reshape(it, start, before);
      if (after > 0) add_range(offset + size, after);
    } else if (after > 0) {
      reshape(it, offset + size, after);
    } else {
      drop_range(it);
    }
  }

  void add_live(int64_t offset, int64_t size) {
    live_.emplace(offset, size);
    live_bytes_ += size;
  }

  // `exchange`'s changes for a large batch, already validated (`takes` sorted, disjoint, each inside
  // one free range; `frees` sorted offsets of live blocks): the free ranges become (free - takes) +
  // freed blocks, coalesced, in one merge over sorted ranges, and the map is rebuilt in order. The
  // same free ranges, live blocks and counters as the per-range path; the size index is left stale.
  void rebuild_free(const std::vector<int64_t>& frees, const std::vector<Range>& takes) {
    std::vector<Range> freed;
    freed.reserve(frees.size());
    for (int64_t offset : frees) {
      auto it = live_.find(offset);
      freed.emplace_back(offset, it->second);
      live_bytes_ -= it->second;
      free_bytes_ += it->second;
      live_.erase(it);
    }
    std::vector<Range> left;  // the free ranges minus the takes, in order
    left.reserve(free_.size() + takes.size());
    size_t t = 0;
    for (const auto& [start, length] : free_) {
      int64_t at = start;
      const int64_t end = start + length;
      for (; t < takes.size() && takes[t].first < end; ++t) {
        if (takes[t].first > at) left.emplace_back(at, takes[t].first - at);
        at = takes[t].first + takes[t].second;
      }
      if (at < end) left.emplace_back(at, end - at);
    }
    for (const auto& [offset, size] : takes) {
      add_live(offset, size);
      free_bytes_ -= size;
    }
    free_.clear();
    size_t a = 0, b = 0;
    while (a < left.size() || b < freed.size()) {  // merge the two sorted lists, coalescing touching ranges
      const Range next = (b == freed.size() || (a < left.size() && left[a].first < freed[b].first)) ? left[a++]
                                                                                                 : freed[b++];
      if (!free_.empty()) {
        auto last = std::prev(free_.end());
        if (last->first + last->second == next.first) {
          last->second += next.second;
          continue;
        }
      }
      free_.emplace_hint(free_.end(), next.first, next.second);
    }
  }
};

// -- Python bindings: the API of the Python model, tests/cpu/heap_model.py ------------------------

namespace heap_py {
namespace py = pybind11;

// An int argument as operator.index takes it: TypeError for a float (never truncated), and
// anything with __index__ (numpy integers) accepted; OverflowError past int64.
inline int64_t as_index(py::handle value) {
  PyObject* i = PyNumber_Index(value.ptr());
  if (!i) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
  Py_DECREF(i);
  if (overflow) throw std::overflow_error("heap offsets and sizes must fit in int64");
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

inline std::vector<int64_t> offsets_of(py::handle iterable) {
  std::vector<int64_t> out;
  for (py::handle item : py::iter(iterable)) out.push_back(as_index(item));
  return out;
}

// (offset, size) pairs from any iterable of 2-item iterables, as Python's `for offset, size in`.
inline std::vector<Heap::Range> ranges_of(py::handle iterable) {
  std::vector<Heap::Range> out;
  for (py::handle item : py::iter(iterable)) {
    py::tuple pair(py::reinterpret_borrow<py::object>(item));
    if (pair.size() != 2)
      throw py::value_error(pair.size() < 2 ? "not enough values to unpack (expected 2, got " +
                                                  std::to_string(pair.size()) + ")"
                                            : std::string("too many values to unpack (expected 2)"));
    out.emplace_back(as_index(pair[0]), as_index(pair[1]));
  }
  return out;
}
}  // namespace heap_py

// Binds class Heap into `m`. HeapFailure becomes defrag.errors.HeapError, looked up when raised (not
// at import), so defrag.errors may load before or after this module.
inline void bind_heap(pybind11::module_& m) {
  namespace py = pybind11;
  using heap_py::as_index;
  using R = std::optional<Heap::Range>;

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const HeapFailure& e) {
      PyObject* heap_module = PyImport_ImportModule("defrag.errors");
      PyObject* cls = heap_module ? PyObject_GetAttrString(heap_module, "HeapError") : nullptr;
      Py_XDECREF(heap_module);
      if (cls) {
        PyErr_SetString(cls, e.what());
        Py_DECREF(cls);
      } else {  // defrag.errors unimportable: still a ValueError, as HeapError is, chained to why
        py::raise_from(PyExc_ValueError, e.what());
      }
    }
  });

  // Module-local: a second build of the module loaded in the same process (a test's scratch or
  // rebuilt module) registers its own class instead of clashing with the first.
  py::class_<Heap, std::shared_ptr<Heap>>(m, "Heap", py::module_local(),
      "Best-fit free-range allocator over [base, base+span) (C++; the Python model is "
      "tests/cpu/heap_model.py). Every failing call raises HeapError and leaves the heap unchanged.")
      .def(py::init([](py::handle base, py::handle span, py::handle alignment) {
             return std::make_shared<Heap>(as_index(base), as_index(span), as_index(alignment));
           }),
           py::arg("base"), py::arg("span"), py::arg("alignment") = kAlignment)
      .def_readonly("base", &Heap::base)
      .def_readonly("span", &Heap::span)
      .def_readonly("alignment", &Heap::alignment)
      .def("round_size", [](const Heap& h, py::handle size) { return h.round_size(as_index(size)); }, py::arg("size"))
      .def("insert_free", [](Heap& h, py::handle offset, py::handle size) {
             h.insert_free(as_index(offset), as_index(size));
           }, py::arg("offset"), py::arg("size"))
      .def("remove_free", [](Heap& h, py::handle offset, py::handle size) {
             h.remove_free(as_index(offset), as_index(size));
           }, py::arg("offset"), py::arg("size"))
      .def("allocate", [](Heap& h, py::handle size) { return h.allocate(as_index(size)); }, py::arg("size"))
      .def("allocate_at", [](Heap& h, py::handle offset, py::handle size) {
             return h.allocate_at(as_index(offset), as_index(size));
           }, py::arg("offset"), py::arg("size"))
      .def("free", [](Heap& h, py::handle offset) { return h.free(as_index(offset)); }, py::arg("offset"))
      .def("allocate_many_at", [](Heap& h, py::handle ranges) { h.allocate_many_at(heap_py::ranges_of(ranges)); },
           py::arg("ranges"))
      .def("free_many", [](Heap& h, py::handle offsets) { h.free_many(heap_py::offsets_of(offsets)); },
           py::arg("offsets"))
      .def("exchange", [](Heap& h, py::handle frees, py::handle takes) {
             auto offsets = heap_py::offsets_of(frees);
             h.exchange(std::move(offsets), heap_py::ranges_of(takes));
           }, py::arg("frees"), py::arg("takes"))
      // `exchange` with its takes as two parallel lists of ints (a compaction wave's, without
      // building a tuple per range): the same checks, messages and effect.
      .def("exchange_lists", [](Heap& h, std::vector<int64_t> frees, const std::vector<int64_t>& take_offsets,
                                const std::vector<int64_t>& take_sizes) {
             if (take_offsets.size() != take_sizes.size())
               throw py::value_error("exchange_lists: take_offsets and take_sizes differ in length");
             std::vector<Heap::Range> takes(take_offsets.size());
             for (size_t i = 0; i < takes.size(); ++i) takes[i] = Heap::Range(take_offsets[i], take_sizes[i]);
             h.exchange(std::move(frees), std::move(takes));
           }, py::arg("frees"), py::arg("take_offsets"), py::arg("take_sizes"))
      .def("block_size", [](const Heap& h, py::handle offset) { return h.block_size(as_index(offset)); },
           py::arg("offset"))
      .def("is_free", [](const Heap& h, py::handle offset, py::handle size) {
             return h.is_free(as_index(offset), as_index(size));
           }, py::arg("offset"), py::arg("size"))
      .def("free_range_ending_at", [](const Heap& h, py::handle end) -> R {
             return h.free_range_ending_at(as_index(end));
           }, py::arg("end"))
      .def("free_range_starting_at", [](const Heap& h, py::handle start) -> R {
             return h.free_range_starting_at(as_index(start));
           }, py::arg("start"))
      .def("free_ranges", &Heap::free_ranges)
      .def("free_ranges_bytes", [](const Heap& h) {
             // (offset, size) int64 pairs, sorted by offset, as bytes: numpy reads them without a tuple each.
             std::vector<Heap::Range> ranges = h.free_ranges();
             std::vector<int64_t> flat;
             flat.reserve(2 * ranges.size());
             for (const auto& r : ranges) { flat.push_back(r.first); flat.push_back(r.second); }
             return py::bytes(reinterpret_cast<const char*>(flat.data()), flat.size() * sizeof(int64_t));
           })
      .def("live_blocks", &Heap::live_blocks)
      .def("free_bytes", &Heap::free_bytes)
      .def("live_bytes", &Heap::live_bytes)
      .def("managed_bytes", &Heap::managed_bytes)
      .def("largest_free", &Heap::largest_free)
      .def("free_bytes_in", [](const Heap& h, py::handle start, py::handle end) {
             return h.free_bytes_in(as_index(start), as_index(end));
           }, py::arg("start"), py::arg("end"))
      .def("free_in", [](const Heap& h, py::handle start, py::handle end) {
             return h.free_in(as_index(start), as_index(end));
           }, py::arg("start"), py::arg("end"))
      .def("managed_in", [](const Heap& h, py::handle start, py::handle end) {
             return h.managed_in(as_index(start), as_index(end));
           }, py::arg("start"), py::arg("end"))
      .def("live_pieces_in", [](const Heap& h, py::handle start, py::handle end) {
             return h.live_pieces_in(as_index(start), as_index(end));
           }, py::arg("start"), py::arg("end"))
      .def("check_invariants", &Heap::check_invariants);
}

}  // namespace defrag_native
