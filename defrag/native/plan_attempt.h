// defrag's planner regions in C++: `defrag.planner._Planner`'s page bookkeeping (touched, forced
// and fresh pages, densest first), steps 3-5 (one attempt at evacuating the touched pages not
// kept) and step 6 (the waves of the chosen attempt), array for array their Python model
// (`_Planner._init_python`, `_Planner.attempt_python`, `_Planner.waves_python`;
// tests/cpu/test_native_attempt.py plans with both and asserts identical plans).
//
// The model is numpy: whole-array steps whose per-call overhead was most of a small
// compaction's planning time. Each step here is the same computation on the same values:
// - interval lists are sorted, disjoint, non-empty half-open [s, e) (`_intersect`, `_minus`,
//   `_gaps`, `_page_runs`); where the model sorts starts and ends separately, so does this;
// - "largest first" is (size descending, sorted index ascending): the model's radix and lexsort
//   paths agree on it because sizes are multiples of the alignment and the indices distinct;
// - the model's per-page byte counts are float64 sums of integers below 2^53, so exact: int64 here,
//   converted to float64 only for the `waste` it returns;
// - the best fit is `best_fit` of planner.h, the function the model calls.
// Page ids map to positions in `touched` through a page table, or by binary search in regions
// too sparse for one (the model's rule; the positions are the same either way).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "planner.h"

namespace defrag_native {

namespace attempt_detail {

using Index = std::vector<int64_t>;
using Mask = std::vector<uint8_t>;

// Placement rounds after wave 1 and drop steps per attempt: `_MAX_ROUNDS_AFTER_WAVE_1` and
// `_MAX_DROP_STEPS` of defrag/planner.py (passed in, so the two cannot disagree).
struct Limits {
  int64_t rounds_after_wave_1;
  int64_t drop_steps;
};

// Sorted, disjoint, non-empty half-open intervals [s[k], e[k]).
struct Intervals {
  Index s, e;
  std::size_t size() const { return s.size(); }
  void add(int64_t a, int64_t b) {
    s.push_back(a);
    e.push_back(b);
  }
};

// `_page_runs`: byte intervals covered by sorted distinct page ids.
inline Intervals page_runs(const Index& pages, int64_t P) {
  Intervals out;
  for (std::size_t k = 0; k < pages.size();) {
    std::size_t j = k + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    out.add(pages[k] * P, (pages[j - 1] + 1) * P);
    k = j;
  }
  return out;
}

// `_intersect`: every non-empty intersection of an a- and a b-interval, in address order (both
// lists sorted and disjoint, so pairwise intersections come out sorted).
inline Intervals intersect(const Intervals& a, const Intervals& b) {
  Intervals out;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a.s[i], b.s[j]), hi = std::min(a.e[i], b.e[j]);
    if (lo < hi) out.add(lo, hi);
    if (a.e[i] < b.e[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

// `_gaps`: [0, span) less sorted starts/ends (each sorted on its own, as the model's), empty
// pieces dropped.
inline Intervals gaps(const Index& starts, const Index& ends, int64_t span) {
  Intervals out;
  int64_t from = 0;
  for (std::size_t k = 0; k <= starts.size(); ++k) {
    const int64_t to = k < starts.size() ? starts[k] : span;
    if (to > from) out.add(from, to);
    if (k < ends.size()) from = ends[k];
  }
  return out;
}

// Sorted a and b merged into one sorted list.
inline Index merged(const Index& a, const Index& b) {
  Index out(a.size() + b.size());
  std::merge(a.begin(), a.end(), b.begin(), b.end(), out.begin());
  return out;
}

// `_minus` for sorted cut starts and ends: the model pairs sorted (starts + cut ends) with sorted
// (cut starts + ends) and drops empty pieces; the same values, the same pairing.
inline Intervals minus(const Intervals& x, const Index& cut_s, const Index& cut_e) {
  if (cut_s.empty()) return x;
  const Index ps = merged(x.s, cut_e), pe = merged(cut_s, x.e);
  Intervals out;
  for (std::size_t k = 0; k < ps.size(); ++k) {
    if (pe[k] > ps[k]) out.add(ps[k], pe[k]);
  }
  return out;
}

// `_runs_first`: sorted distinct page ids, longest contiguous runs first (ties: lower first).
inline Index runs_first(const Index& pages) {
  std::vector<std::pair<std::size_t, std::size_t>> runs;  // (start position, length)
  for (std::size_t k = 0; k < pages.size();) {
    std::size_t j = k + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    runs.emplace_back(k, j - k);
    k = j;
  }
  std::stable_sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  Index out;
  out.reserve(pages.size());
  for (const auto& [at, len] : runs) out.insert(out.end(), pages.begin() + at, pages.begin() + at + len);
  return out;
}

inline bool contains(const Index& sorted, int64_t x) { return std::binary_search(sorted.begin(), sorted.end(), x); }

inline Index sorted_copy(Index v) {
  std::sort(v.begin(), v.end());
  return v;
}

// x / d for x >= 0: a shift when d is a power of two (a 64-bit division costs tens of cycles, and
// the loops divide offsets by the page size once or twice per block).
class Divisor {
 public:
  explicit Divisor(int64_t d = 1) : d_(d), shift_(d > 0 && (d & (d - 1)) == 0 ? __builtin_ctzll(d) : -1) {}
  int64_t of(int64_t x) const { return shift_ >= 0 ? x >> shift_ : x / d_; }

 private:
  int64_t d_;
  int shift_;
};

// Python's a // b for b > 0, and the ceiling -(-a // b).
inline int64_t floor_div(int64_t a, int64_t b) { return planner_detail::floor_div(a, b); }
inline int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

}  // namespace attempt_detail

// One region's layout as `_Planner` sees it (blocks sorted by offset), and what attempts share.
struct PlanRegion {
  int64_t P, span, A;
  attempt_detail::Limits limits;
  attempt_detail::Index off, size, end;
  attempt_detail::Mask fixed;          // pinned, or a page or more: never moves
  attempt_detail::Index touched;       // sorted page ids some block touches
  attempt_detail::Index first_pos, last_pos;  // each block's first/last page, as a position in `touched`
  attempt_detail::Mask forced;         // per touched page: a fixed block touches it
  attempt_detail::Index fresh;         // untouched pages a plan may open, in the order to open them
  attempt_detail::Index by_density;    // unforced touched positions, most live bytes first (ties: lower)
  int64_t n_forced = 0, lower_bound = 0;  // forced pages; max(forced, ceil(live / P))
  attempt_detail::Intervals src_gaps;  // [0, span) less the blocks
  attempt_detail::Index tpos;          // page id -> position in `touched`, -1 if untouched; empty: search
  attempt_detail::Divisor per_page, per_unit;  // by P and by A

  int64_t page_of(int64_t x) const { return per_page.of(x); }  // x >= 0
  int64_t units_of(int64_t x) const { return per_unit.of(x); }


  std::size_t blocks() const { return off.size(); }
  std::size_t pages() const { return touched.size(); }

  // Position in `touched` of a touched page.
  int64_t tix(int64_t page) const {
    if (!tpos.empty()) return tpos[page];
    return std::lower_bound(touched.begin(), touched.end(), page) - touched.begin();
  }
  // Position in `touched` of a page, or -1 if no block touches it now.
  int64_t tix_or_none(int64_t page) const {
    if (!tpos.empty()) return tpos[page];
    const int64_t t = std::lower_bound(touched.begin(), touched.end(), page) - touched.begin();
    return t < static_cast<int64_t>(touched.size()) && touched[t] == page ? t : -1;
  }
};

namespace region_detail {

using attempt_detail::Index;
using attempt_detail::Mask;

// `_Planner.__init__`'s page bookkeeping: touched pages (blocks are sorted and disjoint, so their
// pages come in non-decreasing order), each block's first/last page as a position in `touched`,
// forced pages (any page of a fixed block), live bytes per touched page, and the lower bound.
inline Index find_pages(PlanRegion& R) {
  const std::size_t n = R.blocks();
  Index live;
  R.first_pos.resize(n);
  R.last_pos.resize(n);
  int64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t at = R.off[i], stop = R.end[i];
    total += R.size[i];
    for (int64_t p = R.page_of(at), last = R.page_of(stop - 1); p <= last; ++p) {
      if (R.touched.empty() || R.touched.back() != p) {
        R.touched.push_back(p);
        live.push_back(0);
        R.forced.push_back(0);
      }
      live.back() += std::min(stop, (p + 1) * R.P) - std::max(at, p * R.P);
      R.forced.back() |= R.fixed[i];
      if (p == R.page_of(at)) R.first_pos[i] = static_cast<int64_t>(R.touched.size()) - 1;
    }
    R.last_pos[i] = static_cast<int64_t>(R.touched.size()) - 1;
  }
  R.n_forced = std::count(R.forced.begin(), R.forced.end(), 1);
  R.lower_bound = std::max(R.n_forced, attempt_detail::ceil_div(total, R.P));
  return live;
}

// The unforced touched positions, densest first (ties: lower position first).
inline Index densest_first(const PlanRegion& R, const Index& live) {
  Index out;
  for (std::size_t t = 0; t < R.pages(); ++t) {
    if (!R.forced[t]) out.push_back(static_cast<int64_t>(t));
  }
  std::stable_sort(out.begin(), out.end(), [&live](int64_t a, int64_t b) { return live[a] > live[b]; });
  return out;
}

// `_Planner._fresh_pages`: up to `limit` pages no block touches, longest runs first; with
// `mapped` (one flag per page), the mapped ones first, each kind in runs, longest first.
inline Index fresh_pages(const PlanRegion& R, int64_t limit, const uint8_t* mapped) {
  if (limit <= 0) return {};
  const int64_t npages = R.span / R.P;
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first page, pages) of untouched runs, ascending
  int64_t from = 0;
  for (std::size_t t = 0; t <= R.pages(); ++t) {
    const int64_t to = t < R.pages() ? R.touched[t] : npages;
    if (to > from) runs.emplace_back(from, to - from);
    if (t < R.pages()) from = R.touched[t] + 1;
  }
  Index out;
  if (mapped) {
    Index on, off;
    for (const auto& [first, count] : runs) {
      for (int64_t p = first; p < first + count; ++p) (mapped[p] ? on : off).push_back(p);
    }
    out = attempt_detail::runs_first(on);
    const Index rest = attempt_detail::runs_first(off);
    out.insert(out.end(), rest.begin(), rest.end());
    if (static_cast<int64_t>(out.size()) > limit) out.resize(static_cast<std::size_t>(limit));
    return out;
  }
  std::stable_sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& [first, count] : runs) {
    for (int64_t p = first; p < first + count && static_cast<int64_t>(out.size()) < limit; ++p) out.push_back(p);
    if (static_cast<int64_t>(out.size()) >= limit) break;
  }
  return out;
}

}  // namespace region_detail

// What `_Planner.attempt` returns (`defrag.planner._Result`).
struct AttemptResult {
  attempt_detail::Mask kept;
  attempt_detail::Index mover_idx, dst;  // moved blocks (ascending) and their destinations
  int64_t rounds = 1, pages_after = 0, moved_bytes = 0, movers = 0;
  std::vector<double> waste;  // per touched page: free bytes if kept and touched after, else 0
};

// One attempt: evacuate the touched pages not in `kept` (steps 3-5 of defrag/planner.py).
// Invariants between steps: a block is `waiting` iff it is at its source; `dst[i] >= 0` iff
// block i is placed (not waiting); placed blocks are movers; `pending` lists the movers still
// waiting, largest first, distinct.
// Up to this many lengths (page / alignment) `largest_first` sorts by counting.
constexpr int64_t kCountingSortLengths = int64_t{1} << 16;

class Attempt {
 public:
  Attempt(const PlanRegion& region, attempt_detail::Mask kept)
      : R(region), kept_(std::move(kept)), mover_(region.blocks()), dst_(region.blocks(), -1),
        waiting_(region.blocks(), 1) {}

  AttemptResult run() {
    find_movers(mover_);
    for (std::size_t i = 0; i < R.blocks(); ++i) {
      if (mover_[i]) pending_.push_back(static_cast<int64_t>(i));
    }
    largest_first(pending_);
    movers_ = static_cast<int64_t>(pending_.size());
    wave_one();
    return finish(rounds_after_wave_one());
  }

 private:
  using Index = attempt_detail::Index;
  using Mask = attempt_detail::Mask;
  using Intervals = attempt_detail::Intervals;

  // `_movers`: blocks that are not fixed and not wholly on kept pages.
  void find_movers(Mask& out) const {
    for (std::size_t i = 0; i < R.blocks(); ++i) {
      out[i] = !R.fixed[i] && !(kept_[R.first_pos[i]] && kept_[R.last_pos[i]]);
    }
  }

  // `_largest_first`: size descending, then index ascending (indices distinct). Movers are
  // shorter than a page, so with few lengths (in units of the alignment) a counting sort.
  void largest_first(Index& idx) const {
    const int64_t cap = R.P / R.A;
    if (cap > kCountingSortLengths) {
      std::sort(idx.begin(), idx.end(), [this](int64_t a, int64_t b) {
        return R.size[a] != R.size[b] ? R.size[a] > R.size[b] : a < b;
      });
      return;
    }
    Mask listed(R.blocks(), 0);
    Index at(static_cast<std::size_t>(cap) + 1, 0);  // at[cap - units]: where that length's blocks start
    for (int64_t i : idx) {
      listed[i] = 1;
      ++at[cap - R.units_of(R.size[i])];
    }
    int64_t sum = 0;
    for (int64_t& c : at) {
      const int64_t count = c;
      c = sum;
      sum += count;
    }
    for (std::size_t i = 0; i < R.blocks(); ++i) {
      if (listed[i]) idx[at[cap - R.units_of(R.size[i])]++] = static_cast<int64_t>(i);
    }
  }

  // `_busy`: per touched page, whether one of the blocks `idx` touches it at its source (its first
  // or last page: blocks that can be pending are shorter than a page).
  template <class Blocks>
  Mask busy(const Blocks& idx) const {
    Mask out(R.pages(), 0);
    for (int64_t i : idx) out[R.first_pos[i]] = out[R.last_pos[i]] = 1;
    return out;
  }

  Index kept_pages() const {
    Index out;
    for (std::size_t t = 0; t < R.pages(); ++t) {
      if (kept_[t]) out.push_back(R.touched[t]);
    }
    return out;
  }

  // `_place`: best-fit `pending_` (largest first) into `holes`; what does not fit stays pending.
  void place(const Intervals& holes) {
    if (!holes.size() || pending_.empty()) return;
    Index sizes(pending_.size()), placed(pending_.size());
    for (std::size_t k = 0; k < pending_.size(); ++k) sizes[k] = R.size[pending_[k]];
    best_fit(holes.s.data(), holes.e.data(), holes.size(), sizes.data(), sizes.size(), R.A, R.P / R.A,
             placed.data());
    std::size_t left = 0;
    for (std::size_t k = 0; k < pending_.size(); ++k) {
      const int64_t i = pending_[k];
      if (placed[k] >= 0) {
        dst_[i] = placed[k];
        waiting_[i] = 0;
      } else {
        pending_[left++] = i;
      }
    }
    pending_.resize(left);
  }

  // Starts and ends of every placed block's destination, sorted (destinations are disjoint, so
  // one order sorts both).
  std::pair<Index, Index> placed_ranges() const {
    Index placed;
    for (std::size_t i = 0; i < R.blocks(); ++i) {
      if (!waiting_[i]) placed.push_back(static_cast<int64_t>(i));
    }
    std::sort(placed.begin(), placed.end(), [this](int64_t a, int64_t b) { return dst_[a] < dst_[b]; });
    Index s(placed.size()), e(placed.size());
    for (std::size_t k = 0; k < placed.size(); ++k) {
      s[k] = dst_[placed[k]];
      e[k] = s[k] + R.size[placed[k]];
    }
    return {std::move(s), std::move(e)};
  }

  void wave_one();
  bool drop();
  Index drop_order(std::vector<int64_t>& waste) const;
  int64_t drops_to_make(const Index& cand, const std::vector<int64_t>& waste) const;
  void undo_drops(const Index& cand, int64_t d);
  int64_t rounds_after_wave_one();
  Intervals free_now() const;
  Index open_zone_pages(Index& zone, Index& fresh) const;
  AttemptResult finish(int64_t rounds);
  int64_t pages_touched(const Index& at) const;

  const PlanRegion& R;
  Mask kept_, mover_;
  Index dst_;
  Mask waiting_;
  Index pending_;
  int64_t movers_ = 0;
};

// Steps 3-4, up to drop_steps + 1 times: best-fit the pending blocks into kept-page holes free now
// (wave 1), then drop the kept pages whose holes stayed emptiest (`drop`), which turns the
// blocks placed into them, and those straddling into them, into pending blocks.
inline void Attempt::wave_one() {
  Intervals free = R.src_gaps;
  for (int64_t step = 0; step <= R.limits.drop_steps; ++step) {
    // Kept only shrinks, so the free space of kept pages is the last one's, on the kept pages.
    free = attempt_detail::intersect(attempt_detail::page_runs(kept_pages(), R.P), free);
    const auto [cut_s, cut_e] = placed_ranges();
    place(attempt_detail::minus(free, cut_s, cut_e));
    if (pending_.empty() || !drop()) break;
    find_movers(mover_);
    movers_ += static_cast<int64_t>(pending_.size());
  }
}

// Step 4 (`_drop`): drop the fewest emptiest kept pages that minimise the pages needed, capped by
// the zone pages that can be free soon; false if none is dropped.
inline bool Attempt::drop() {
  std::vector<int64_t> waste;
  const Index cand = drop_order(waste);
  const int64_t d = drops_to_make(cand, waste);
  if (!d) return false;
  undo_drops(cand, d);
  return true;
}

// The kept, unforced pages with free bytes (`waste`: page bytes less the bytes of blocks that are
// not pending, at their source or destination), emptiest first (ties: lower position first).
inline attempt_detail::Index Attempt::drop_order(std::vector<int64_t>& waste) const {
  const int64_t P = R.P;
  std::vector<int64_t> used(R.pages(), 0);
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (waiting_[i] && mover_[i]) continue;  // pending
    const int64_t at = waiting_[i] ? R.off[i] : dst_[i], stop = at + R.size[i];
    for (int64_t p = R.page_of(at), last = R.page_of(stop - 1); p <= last; ++p) {
      used[R.tix(p)] += std::min(stop, (p + 1) * P) - std::max(at, p * P);
    }
  }
  waste.assign(R.pages(), 0);
  Index cand;
  for (std::size_t t = 0; t < R.pages(); ++t) {
    waste[t] = used[t] > 0 ? P - used[t] : 0;
    if (kept_[t] && !R.forced[t] && waste[t] > 0) cand.push_back(static_cast<int64_t>(t));
  }
  std::stable_sort(cand.begin(), cand.end(), [&waste](int64_t a, int64_t b) { return waste[a] > waste[b]; });
  return cand;
}

// How many of `cand` to drop (`_drop`'s d): dropping the first d leaves `extra[d]` pages needed
// beyond the kept ones; the fewest drops reaching the minimum, among the d whose zone pages can
// be free soon (unmapped pages, and evacuated pages that no pending block touches: a page counts
// for d drops iff it is evacuated, idle, and no block from it went to one of the first d).
inline int64_t Attempt::drops_to_make(const Index& cand, const std::vector<int64_t>& waste) const {
  const int64_t C = static_cast<int64_t>(cand.size());
  int64_t left = 0;
  for (int64_t i : pending_) left += R.size[i];
  Index extra(C + 1);
  for (int64_t k = 0; k <= C; ++k) {
    extra[k] = attempt_detail::ceil_div(left, R.P);  // may be negative
    if (k < C) left -= waste[cand[k]];
  }
  Index rank(R.pages(), C), first_drop(R.pages(), C);
  for (int64_t k = 0; k < C; ++k) rank[cand[k]] = k;
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (!mover_[i] || waiting_[i]) continue;  // placed blocks only; they lie on kept pages
    const int64_t r =
        std::min(rank[R.tix(R.page_of(dst_[i]))], rank[R.tix(R.page_of(dst_[i] + R.size[i] - 1))]);
    first_drop[R.first_pos[i]] = std::min(first_drop[R.first_pos[i]], r);
    first_drop[R.last_pos[i]] = std::min(first_drop[R.last_pos[i]], r);
  }
  const Mask busy_now = busy(pending_);
  Index lost(C + 1, 0);
  int64_t idle = 0;
  for (std::size_t t = 0; t < R.pages(); ++t) {
    if (!kept_[t] && !busy_now[t]) {
      ++idle;
      ++lost[first_drop[t]];
    }
  }
  int64_t n_ok = C + 1, supply = static_cast<int64_t>(R.fresh.size()) + idle;
  for (int64_t k = 0; k <= C; ++k) {
    if (extra[k] + k > supply) {
      n_ok = std::max<int64_t>(1, k);
      break;
    }
    supply -= lost[k];
  }
  return std::min_element(extra.begin(), extra.begin() + n_ok) - extra.begin();
}

// Stop keeping the first `d` of `cand`: blocks placed into them go back to pending, blocks that
// straddled into them become movers; pending is sorted largest first again.
inline void Attempt::undo_drops(const Index& cand, int64_t d) {
  Mask gone(R.pages(), 0);
  for (int64_t k = 0; k < d; ++k) {
    kept_[cand[k]] = 0;
    gone[cand[k]] = 1;
  }
  Index undo, joined;
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (!mover_[i] || waiting_[i]) continue;
    if (gone[R.tix(R.page_of(dst_[i]))] || gone[R.tix(R.page_of(dst_[i] + R.size[i] - 1))]) {
      undo.push_back(static_cast<int64_t>(i));
    }
  }
  for (int64_t i : undo) {
    dst_[i] = -1;
    waiting_[i] = 1;
  }
  Mask now(R.blocks());
  find_movers(now);
  pending_.insert(pending_.end(), undo.begin(), undo.end());
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (now[i] && !mover_[i]) pending_.push_back(static_cast<int64_t>(i));
  }
  largest_first(pending_);
}

// Step 5: rounds after wave 1. Each places what is pending into kept-page space free by then
// (remnants, and what wave-1 movers left) and, failing that, into zone pages: unmapped pages
// first, then evacuated pages that earlier rounds emptied, newly opened pages last. Returns the
// last round that placed a block (1: none did).
inline int64_t Attempt::rounds_after_wave_one() {
  Index zone, fresh = R.fresh;
  int64_t rounds = 1;
  for (int64_t r = 2; r <= R.limits.rounds_after_wave_1 + 1; ++r) {
    if (pending_.empty()) break;
    const Intervals free = free_now();
    const Index opened = open_zone_pages(zone, fresh);
    Index pages = kept_pages();
    pages.insert(pages.end(), zone.begin(), zone.end());
    std::sort(pages.begin(), pages.end());  // kept pages are touched, zone pages not: distinct
    const Intervals holes = attempt_detail::intersect(attempt_detail::page_runs(pages, R.P), free);
    const Index opened_sorted = attempt_detail::sorted_copy(opened);
    Intervals ordered, last;  // space in pages already counted first, in newly opened pages last
    for (std::size_t k = 0; k < holes.size(); ++k) {
      const bool is_new = attempt_detail::contains(opened_sorted, R.page_of(holes.s[k])) &&
                          attempt_detail::contains(opened_sorted, R.page_of(holes.e[k] - 1));
      (is_new ? last : ordered).add(holes.s[k], holes.e[k]);
    }
    ordered.s.insert(ordered.s.end(), last.s.begin(), last.s.end());
    ordered.e.insert(ordered.e.end(), last.e.begin(), last.e.end());
    const std::size_t before = pending_.size();
    place(ordered);
    if (pending_.size() < before) {
      rounds = r;
    } else if (opened.empty()) {
      break;  // no progress and nothing new to open: give up
    }
  }
  return rounds;
}

// [0, span) less every block where it is now (its source if waiting, else its destination).
inline attempt_detail::Intervals Attempt::free_now() const {
  Index s, e;  // sources of waiting blocks: sorted, as the blocks are
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (waiting_[i]) {
      s.push_back(R.off[i]);
      e.push_back(R.end[i]);
    }
  }
  const auto [placed_s, placed_e] = placed_ranges();
  return attempt_detail::gaps(attempt_detail::merged(s, placed_s), attempt_detail::merged(e, placed_e), R.span);
}

// The zone pages this round opens: as many pages as the pending bytes fill, from `fresh`, then the
// evacuated pages no waiting block touches and not in `zone` yet, longest runs first. Moves them
// from `fresh` to `zone`.
inline attempt_detail::Index Attempt::open_zone_pages(Index& zone, Index& fresh) const {
  Index waiting;
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (waiting_[i]) waiting.push_back(static_cast<int64_t>(i));
  }
  const Mask busy_now = busy(waiting);
  const Index zone_sorted = attempt_detail::sorted_copy(zone);
  Index vacated;
  for (std::size_t t = 0; t < R.pages(); ++t) {
    if (!kept_[t] && !busy_now[t] && !attempt_detail::contains(zone_sorted, R.touched[t])) {
      vacated.push_back(R.touched[t]);
    }
  }
  int64_t bytes = 0;
  for (int64_t i : pending_) bytes += R.size[i];
  const std::size_t need = static_cast<std::size_t>(attempt_detail::ceil_div(bytes, R.P));
  Index opened(fresh.begin(), fresh.begin() + static_cast<std::ptrdiff_t>(std::min(need, fresh.size())));
  if (opened.size() < need) {
    const Index more = attempt_detail::runs_first(vacated);
    opened.insert(opened.end(), more.begin(),
                  more.begin() + static_cast<std::ptrdiff_t>(std::min(need - opened.size(), more.size())));
  }
  // Fresh pages are distinct, so the ones opened are its first ones.
  fresh.erase(fresh.begin(), fresh.begin() + static_cast<std::ptrdiff_t>(std::min(need, fresh.size())));
  zone.insert(zone.end(), opened.begin(), opened.end());
  return opened;
}

// The result (`attempt`'s end): the movers placed, the pages every block touches then, and per
// kept touched page the bytes it leaves free (0 for pages nothing touches then, or not kept).
// What is still pending stays where it is.
inline AttemptResult Attempt::finish(int64_t rounds) {
  const int64_t P = R.P;
  AttemptResult out;
  Index at(R.off);  // every block's offset at the end
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    if (mover_[i] && dst_[i] >= 0) {
      at[i] = dst_[i];
      out.mover_idx.push_back(static_cast<int64_t>(i));
      out.dst.push_back(dst_[i]);
      out.moved_bytes += R.size[i];
    }
  }
  std::vector<int64_t> used(R.pages(), 0);
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    const int64_t stop = at[i] + R.size[i];
    for (int64_t p = R.page_of(at[i]), last = R.page_of(stop - 1); p <= last; ++p) {
      const int64_t t = R.tix_or_none(p);
      if (t >= 0) used[t] += std::min(stop, (p + 1) * P) - std::max(at[i], p * P);
    }
  }
  out.pages_after = pages_touched(at);
  out.waste.resize(R.pages());
  for (std::size_t t = 0; t < R.pages(); ++t) {
    out.waste[t] = kept_[t] && used[t] > 0 ? static_cast<double>(P - used[t]) : 0.0;
  }
  out.kept = std::move(kept_);
  out.rounds = rounds;
  out.movers = movers_;
  return out;
}

// Distinct pages touched by the blocks at offsets `at`: marked in a table over the region's pages
// where the region has a page table, else the union of the blocks' page ranges, sorted.
inline int64_t Attempt::pages_touched(const Index& at) const {
  const int64_t P = R.P;
  int64_t count = 0;
  if (!R.tpos.empty()) {
    Mask seen(R.tpos.size(), 0);
    for (std::size_t i = 0; i < R.blocks(); ++i) {
      for (int64_t p = R.page_of(at[i]), last = R.page_of(at[i] + R.size[i] - 1); p <= last; ++p) {
        count += !seen[p];
        seen[p] = 1;
      }
    }
    return count;
  }
  std::vector<std::pair<int64_t, int64_t>> spans;  // (first page, last page)
  spans.reserve(R.blocks());
  for (std::size_t i = 0; i < R.blocks(); ++i) {
    spans.emplace_back(R.page_of(at[i]), R.page_of(at[i] + R.size[i] - 1));
  }
  std::sort(spans.begin(), spans.end());
  int64_t covered = -1;  // last page counted; pages are not negative
  for (const auto& [first, last] : spans) {
    if (last > covered) {
      count += last - std::max(first - 1, covered);
      covered = last;
    }
  }
  return count;
}

// Step 6 (`_Planner.waves`): each move runs one wave after the latest move whose block's source
// its destination covers, wave 1 if none. Returns the moves' order (positions into `mover_idx`)
// by wave then destination (destinations are distinct), and their waves in that order. Iterates
// as the model does (every move's wave from the last pass's) until nothing changes; terminates
// because a destination only covers sources vacated in an earlier round (acyclic, at most
// `rounds` deep).
inline std::pair<attempt_detail::Index, attempt_detail::Index> plan_waves(const PlanRegion& R,
                                                                          const attempt_detail::Index& mover_idx,
                                                                          const attempt_detail::Index& dst) {
  using attempt_detail::Index;
  const std::size_t m = mover_idx.size();
  Index by_dst(m);
  std::iota(by_dst.begin(), by_dst.end(), 0);
  std::sort(by_dst.begin(), by_dst.end(), [&dst](int64_t a, int64_t b) { return dst[a] < dst[b]; });
  Index lo(m), hi(m), wave(m, 1), next(m);
  for (std::size_t j = 0; j < m; ++j) {
    const int64_t i = mover_idx[by_dst[j]], d = dst[by_dst[j]];
    lo[j] = std::upper_bound(R.end.begin(), R.end.end(), d) - R.end.begin();  // first source ending after d
    hi[j] = std::lower_bound(R.off.begin(), R.off.end(), d + R.size[i]) - R.off.begin();  // starting before
  }
  Index wave_of(R.blocks(), 0);  // wave of each block's move (0: it stays)
  for (bool changed = true; changed;) {
    for (std::size_t j = 0; j < m; ++j) wave_of[mover_idx[by_dst[j]]] = wave[j];
    changed = false;
    for (std::size_t j = 0; j < m; ++j) {
      next[j] = wave[j];
      if (hi[j] <= lo[j]) continue;
      next[j] = *std::max_element(wave_of.begin() + lo[j], wave_of.begin() + hi[j]) + 1;
      changed |= next[j] != wave[j];
    }
    wave.swap(next);
  }
  Index by_wave(m);
  std::iota(by_wave.begin(), by_wave.end(), 0);
  std::stable_sort(by_wave.begin(), by_wave.end(), [&wave](int64_t a, int64_t b) { return wave[a] < wave[b]; });
  Index order(m), waves(m);
  for (std::size_t k = 0; k < m; ++k) {
    order[k] = by_dst[by_wave[k]];
    waves[k] = wave[by_wave[k]];
  }
  return {std::move(order), std::move(waves)};
}

namespace attempt_py {

namespace py = pybind11;
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using BoolArray = py::array_t<bool, py::array::c_style | py::array::forcecast>;

// Above this many blocks an attempt runs without the GIL (a short one would only wait to get it back).
constexpr std::size_t kReleaseGilBlocks = std::size_t{1} << 16;
// defrag/planner.py's _PAGE_TABLE_PAGES_PER_TOUCHED and _PAGE_TABLE_PAGES_ALWAYS.
constexpr int64_t kPageTablePagesPerTouched = 8;
constexpr int64_t kPageTablePagesAlways = int64_t{1} << 16;

template <class T, class Array>
std::vector<T> to_vector(const Array& a, const char* name, std::ptrdiff_t expect = -1) {
  if (a.ndim() != 1 || (expect >= 0 && a.shape(0) != expect)) {
    throw std::invalid_argument(std::string("PlanRegion: ") + name + " must be 1-d" +
                                (expect >= 0 ? " with " + std::to_string(expect) + " entries" : std::string()));
  }
  return std::vector<T>(a.data(), a.data() + a.shape(0));
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

inline py::array_t<bool> to_bool_array(const attempt_detail::Mask& v) {
  py::array_t<bool> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// `_Planner.__init__` for a layout sorted by offset and checked (`defrag.planner._layout`): blocks
// inside [0, span), aligned, positive, disjoint. `limit`: most untouched pages a plan may open;
// `mapped`: None or one flag per page.
inline PlanRegion make_region(const Int64Array& off, const Int64Array& size, const BoolArray& movable,
                              int64_t page_size, int64_t span, int64_t alignment, int64_t limit,
                              const py::object& mapped, int64_t rounds_after_wave_1, int64_t drop_steps) {
  if (alignment <= 0 || page_size <= 0 || page_size % alignment || span < 0 || span % page_size) {
    throw std::invalid_argument("PlanRegion: page_size must be a positive multiple of a positive alignment, "
                                "span a non-negative multiple of page_size");
  }
  PlanRegion R;
  R.P = page_size;
  R.span = span;
  R.A = alignment;
  R.per_page = attempt_detail::Divisor(page_size);
  R.per_unit = attempt_detail::Divisor(alignment);
  R.limits = attempt_detail::Limits{rounds_after_wave_1, drop_steps};
  R.off = to_vector<int64_t>(off, "off");
  const auto n = static_cast<std::ptrdiff_t>(R.off.size());
  R.size = to_vector<int64_t>(size, "size", n);
  const auto mov = to_vector<uint8_t>(movable, "movable", n);
  for (std::ptrdiff_t i = 0; i < n; ++i) {
    if (R.size[i] <= 0 || R.off[i] < 0 || R.off[i] > span - R.size[i] || (i && R.off[i] < R.end.back())) {
      throw std::invalid_argument("PlanRegion: blocks must be sorted, disjoint and inside the span (block " +
                                  std::to_string(i) + ")");
    }
    R.end.push_back(R.off[i] + R.size[i]);
    R.fixed.push_back(!mov[i] || R.size[i] >= page_size);
  }
  const attempt_detail::Index live = region_detail::find_pages(R);
  R.by_density = region_detail::densest_first(R, live);
  const int64_t npages = span / page_size;
  std::vector<uint8_t> on;
  if (!mapped.is_none()) on = to_vector<uint8_t>(BoolArray::ensure(mapped), "mapped", npages);
  R.fresh = region_detail::fresh_pages(R, limit, mapped.is_none() ? nullptr : on.data());
  R.src_gaps = attempt_detail::gaps(R.off, R.end, span);
  // A page table where the region is not much sparser than its blocks (the model's rule; binary
  // searches give the same positions).
  const auto T = static_cast<int64_t>(R.pages());
  if (npages <= kPageTablePagesPerTouched * T + kPageTablePagesAlways) {
    R.tpos.assign(static_cast<std::size_t>(npages), -1);
    for (int64_t t = 0; t < T; ++t) R.tpos[R.touched[t]] = t;
  }
  return R;
}

inline py::tuple attempt(const PlanRegion& R, const BoolArray& kept) {
  attempt_detail::Mask k = to_vector<uint8_t>(kept, "kept", static_cast<std::ptrdiff_t>(R.pages()));
  AttemptResult r;
  if (R.blocks() >= kReleaseGilBlocks) {
    py::gil_scoped_release nogil;
    r = Attempt(R, std::move(k)).run();
  } else {
    r = Attempt(R, std::move(k)).run();
  }
  return py::make_tuple(to_bool_array(r.kept), to_array(r.mover_idx), to_array(r.dst), r.rounds, r.pages_after,
                        r.moved_bytes,
                        to_array(r.waste), r.movers);
}

inline py::tuple waves(const PlanRegion& R, const Int64Array& mover_idx, const Int64Array& dst) {
  const auto idx = to_vector<int64_t>(mover_idx, "mover_idx");
  const auto d = to_vector<int64_t>(dst, "dst", static_cast<std::ptrdiff_t>(idx.size()));
  for (int64_t i : idx) {
    if (i < 0 || static_cast<std::size_t>(i) >= R.blocks()) throw std::invalid_argument("waves: bad mover index");
  }
  auto [order, wave] = plan_waves(R, idx, d);
  return py::make_tuple(to_array(order), to_array(wave));
}

}  // namespace attempt_py

inline void bind_plan_attempt(pybind11::module_& m) {
  namespace py = pybind11;
  using attempt_py::to_array;
  py::class_<PlanRegion>(m, "PlanRegion",
                         "One region's layout for defrag.planner._Planner: its page bookkeeping, attempts and "
                         "waves (defrag/native/plan_attempt.h); the Python model is _Planner's *_python methods.")
      .def(py::init(&attempt_py::make_region), py::arg("off"), py::arg("size"), py::arg("movable"),
           py::arg("page_size"), py::arg("span"), py::arg("alignment"), py::arg("limit"), py::arg("mapped"),
           py::arg("rounds_after_wave_1"), py::arg("drop_steps"))
      .def_property_readonly("touched", [](const PlanRegion& R) { return to_array(R.touched); })
      .def_property_readonly("first_pos", [](const PlanRegion& R) { return to_array(R.first_pos); })
      .def_property_readonly("last_pos", [](const PlanRegion& R) { return to_array(R.last_pos); })
      .def_property_readonly("forced", [](const PlanRegion& R) { return attempt_py::to_bool_array(R.forced); })
      .def_property_readonly("by_density", [](const PlanRegion& R) { return to_array(R.by_density); })
      .def_property_readonly("tpos", [](const PlanRegion& R) -> py::object {
        if (R.tpos.empty()) return py::none();
        return to_array(R.tpos);
      })
      .def_readonly("n_forced", &PlanRegion::n_forced)
      .def_readonly("lower_bound", &PlanRegion::lower_bound)
      .def("attempt", &attempt_py::attempt, py::arg("kept"),
           "Steps 3-5 for the kept mask over touched pages: (kept, mover_idx, dst, rounds, pages_after, "
           "moved_bytes, waste, movers), as _Planner.attempt_python's _Result.")
      .def("waves", &attempt_py::waves, py::arg("mover_idx"), py::arg("dst"),
           "Step 6: (order, wave) as _Planner.waves_python.");
}

}  // namespace defrag_native
