// defrag's planner placement in C++: best fit of items (non-increasing sizes) into holes, the
// placement loop of `defrag.planner._best_fit`, array for array the Python model
// (`defrag.planner._best_fit_python`, which tests/cpu/test_native_planner.py runs side by side).
//
// Semantics (in units of `unit` bytes; every division rounds down, as Python's //):
// - A hole [s, e) starts at s // unit and is (e - s) // unit long; empty holes are dropped.
// - Holes of `cap` units or more share one "big" list, in the order given. An item that fits no
//   shorter hole is carved from the front of the first of them; once that hole is shorter than
//   `cap` it leaves the list and its remnant, if any, joins the bucket of its length.
// - Shorter holes are bucketed by length, each bucket a stack (holes pushed in the order given,
//   the last pushed taken first).
// - Items in order; an item of `cap` units or more is never placed. Otherwise it takes the last
//   hole of the shortest non-empty bucket at least as long, at that hole's start, and the
//   remnant (start + item, length - item), if any, is pushed onto its length's bucket; if no
//   bucket fits, the big list; if that is empty too, the item is not placed (-1).
// - Offsets are the placed start (in units) times `unit`; -1 where not placed, and where the
//   start is negative (as the Python's `np.where(out >= 0, out * unit, -1)`).
//
// The Python model places runs of equal items and runs into a big hole several at a time
// (`_carve_equal_run`, `_fill_big_hole`) and skips items longer than every hole with a bisect;
// each is exactly the one-at-a-time loop above (see the model's docstrings), so this is that loop.
// Finding the shortest non-empty bucket: a 64-ary bitset tree over bucket lengths (O(log64 cap)),
// or an ordered map of the non-empty buckets when the longest possible bucket is too long for
// the tree's memory.
//
// No Python API in `best_fit`; the binding releases the GIL for large inputs only (a short call
// would only wait to get the GIL back).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace defrag_native {

namespace planner_detail {

// Python's a // b for b > 0.
inline int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if (a % b != 0 && a < 0) --q;
  return q;
}

// Holes of each length, each a stack: singly linked nodes (start, next), never freed during a call.
struct HoleStacks {
  struct Node {
    int64_t start;
    int64_t next;  // -1: bottom of its stack
  };
  std::vector<Node> nodes;
  explicit HoleStacks(std::size_t reserve) { nodes.reserve(reserve); }
  int64_t push(int64_t start, int64_t below) {
    nodes.push_back(Node{start, below});
    return static_cast<int64_t>(nodes.size()) - 1;
  }
};

// Buckets for lengths [0, size): heads indexed by length (valid only where the length's bit is
// set, so never initialised) and a 64-ary bitset tree of the non-empty lengths.
class DenseBuckets {
 public:
  DenseBuckets(int64_t size, std::size_t reserve) : heads_(new int64_t[static_cast<std::size_t>(size)]),
                                                     stacks_(reserve) {
    std::size_t bits = static_cast<std::size_t>(size);
    do {
      std::size_t words = (bits + 63) / 64;
      levels_.emplace_back(words, 0);
      bits = words;
    } while (bits > 1);
  }

  bool empty() const { return levels_.back()[0] == 0; }

  // The shortest non-empty length >= g, or -1.
  int64_t find_ge(int64_t g) const {
    std::size_t level = 0;
    uint64_t pos = static_cast<uint64_t>(g);
    const std::size_t top = levels_.size();
    for (; level < top; ++level) {
      const std::vector<uint64_t>& words = levels_[level];
      uint64_t w = pos >> 6;
      if (w >= words.size()) return -1;
      uint64_t m = words[w] & (~uint64_t{0} << (pos & 63));
      if (m) {
        pos = (w << 6) + static_cast<uint64_t>(__builtin_ctzll(m));
        break;
      }
      pos = w + 1;  // the next words of this level: bits from w + 1 one level up
    }
    if (level == top) return -1;
    while (level > 0) {
      --level;
      pos = (pos << 6) + static_cast<uint64_t>(__builtin_ctzll(levels_[level][pos]));
    }
    return static_cast<int64_t>(pos);
  }

  int64_t pop(int64_t len) {  // len non-empty
    int64_t node = heads_[len];
    const HoleStacks::Node& n = stacks_.nodes[static_cast<std::size_t>(node)];
    heads_[len] = n.next;
    if (n.next < 0) clear(static_cast<uint64_t>(len));
    return n.start;
  }

  void push(int64_t len, int64_t start) {
    const uint64_t p = static_cast<uint64_t>(len);
    const bool had = (levels_[0][p >> 6] >> (p & 63)) & 1;
    heads_[len] = stacks_.push(start, had ? heads_[len] : -1);
    if (!had) set(p);
  }

 private:
  void set(uint64_t p) {
    for (std::vector<uint64_t>& words : levels_) {
      uint64_t& w = words[p >> 6];
      const bool was = w != 0;
      w |= uint64_t{1} << (p & 63);
      if (was) return;
      p >>= 6;
    }
  }
  void clear(uint64_t p) {
    for (std::vector<uint64_t>& words : levels_) {
      uint64_t& w = words[p >> 6];
      w &= ~(uint64_t{1} << (p & 63));
      if (w) return;
      p >>= 6;
    }
  }

  std::unique_ptr<int64_t[]> heads_;
  HoleStacks stacks_;
  std::vector<std::vector<uint64_t>> levels_;  // levels_[0]: one bit per length; the last: one word
};

// The same, for lengths too many for DenseBuckets: an ordered map of the non-empty buckets.
class SparseBuckets {
 public:
  SparseBuckets(int64_t, std::size_t reserve) : stacks_(reserve) {}

  bool empty() const { return heads_.empty(); }

  int64_t find_ge(int64_t g) const {
    auto it = heads_.lower_bound(g);
    return it == heads_.end() ? -1 : it->first;
  }

  int64_t pop(int64_t len) {
    auto it = heads_.find(len);
    const HoleStacks::Node& n = stacks_.nodes[static_cast<std::size_t>(it->second)];
    if (n.next < 0) {
      heads_.erase(it);
    } else {
      it->second = n.next;
    }
    return n.start;
  }

  void push(int64_t len, int64_t start) {
    auto [it, fresh] = heads_.try_emplace(len, -1);
    it->second = stacks_.push(start, fresh ? -1 : it->second);
  }

 private:
  std::map<int64_t, int64_t> heads_;  // length -> top node
  HoleStacks stacks_;
};

// A DenseBuckets tree for this many lengths at most (2^22 lengths: heads 32 MiB of address
// space, only the touched pages used; bits 0.5 MiB, zeroed per call).
constexpr int64_t kDenseBucketLengths = int64_t{1} << 22;

struct Hole {
  int64_t start;
  int64_t len;
};

template <class Buckets>
void place(const std::vector<Hole>& small, std::vector<Hole> big, const int64_t* units, std::size_t n,
           int64_t unit, int64_t cap, int64_t lengths, int64_t* out) {
  Buckets buckets(lengths, small.size() + n);
  for (const Hole& h : small) buckets.push(h.len, h.start);
  std::size_t first_big = 0;  // big[first_big:] are the holes of cap or more, in the order given
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t g = units[i];
    if (g >= cap) continue;
    int64_t start;
    const int64_t b = buckets.find_ge(g);
    if (b >= 0) {
      start = buckets.pop(b);
      if (b != g) buckets.push(b - g, start + g);
    } else if (first_big < big.size()) {
      Hole& h = big[first_big];
      start = h.start;
      h.start += g;
      h.len -= g;
      if (h.len < cap) {
        ++first_big;
        if (h.len) buckets.push(h.len, h.start);
      }
    } else {
      if (buckets.empty()) break;  // no hole left, and placing nothing makes none
      continue;
    }
    out[i] = start >= 0 ? start * unit : -1;
  }
}

}  // namespace planner_detail

// Best fit of `n` items (`sizes`, bytes, non-increasing in units of `unit`) into `nh` holes
// [hole_s[k], hole_e[k]) (bytes, in the order given), as described at the top of this file.
// Writes each item's byte offset, or -1, to `out`. Throws std::invalid_argument for unit or cap
// not positive, a negative size, or sizes that increase (in units).
inline void best_fit(const int64_t* hole_s, const int64_t* hole_e, std::size_t nh, const int64_t* sizes,
                     std::size_t n, int64_t unit, int64_t cap, int64_t* out) {
  using namespace planner_detail;
  if (unit <= 0) throw std::invalid_argument("best_fit: unit must be positive, got " + std::to_string(unit));
  if (cap <= 0) throw std::invalid_argument("best_fit: cap must be positive, got " + std::to_string(cap));
  std::vector<int64_t> units(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (sizes[i] < 0) {
      throw std::invalid_argument("best_fit: sizes must not be negative (item " + std::to_string(i) + ": " +
                                  std::to_string(sizes[i]) + ")");
    }
    units[i] = sizes[i] / unit;
    if (i && units[i] > units[i - 1]) {
      throw std::invalid_argument("best_fit: sizes must be non-increasing in units of unit (item " +
                                  std::to_string(i) + ")");
    }
    out[i] = -1;
  }
  std::vector<Hole> small, big;
  small.reserve(nh);
  int64_t longest = 0;
  for (std::size_t k = 0; k < nh; ++k) {
    int64_t length;
    if (__builtin_sub_overflow(hole_e[k], hole_s[k], &length)) {
      throw std::overflow_error("best_fit: hole " + std::to_string(k) + " is longer than int64");
    }
    const int64_t len = floor_div(length, unit);
    const int64_t start = floor_div(hole_s[k], unit);
    if (len >= cap) {
      big.push_back(Hole{start, len});
    } else if (len > 0) {
      small.push_back(Hole{start, len});
      if (len > longest) longest = len;
    }
  }
  // Buckets hold lengths below cap, and no longer than the longest hole (remnants are shorter
  // than the hole they are cut from).
  int64_t lengths = big.empty() ? longest + 1 : cap;
  if (lengths <= kDenseBucketLengths) {
    place<DenseBuckets>(small, std::move(big), units.data(), n, unit, cap, lengths, out);
  } else {
    place<SparseBuckets>(small, std::move(big), units.data(), n, unit, cap, lengths, out);
  }
}

namespace planner_py {

using Int64Array = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;

// Above this many holes plus items, best_fit runs without the GIL.
constexpr std::size_t kReleaseGilItems = std::size_t{1} << 16;

inline std::size_t length_1d(const Int64Array& a, const char* name) {
  if (a.ndim() != 1) {
    throw std::invalid_argument(std::string("best_fit: ") + name + " must be 1-d, got " +
                                std::to_string(a.ndim()) + " dimensions");
  }
  return static_cast<std::size_t>(a.shape(0));
}

}  // namespace planner_py

inline void bind_planner(pybind11::module_& m) {
  namespace py = pybind11;
  using planner_py::Int64Array;
  m.def(
      "best_fit",
      [](const Int64Array& hole_s, const Int64Array& hole_e, const Int64Array& sizes, int64_t unit,
         int64_t cap) {
        const std::size_t nh = planner_py::length_1d(hole_s, "hole_s");
        if (planner_py::length_1d(hole_e, "hole_e") != nh) {
          throw std::invalid_argument("best_fit: hole_s and hole_e must have the same length");
        }
        const std::size_t n = planner_py::length_1d(sizes, "sizes");
        Int64Array out(static_cast<py::ssize_t>(n));
        const int64_t* s = hole_s.data();
        const int64_t* e = hole_e.data();
        const int64_t* z = sizes.data();
        int64_t* o = out.mutable_data();
        if (nh + n >= planner_py::kReleaseGilItems) {
          py::gil_scoped_release nogil;
          best_fit(s, e, nh, z, n, unit, cap, o);
        } else {
          best_fit(s, e, nh, z, n, unit, cap, o);
        }
        return out;
      },
      py::arg("hole_s"), py::arg("hole_e"), py::arg("sizes"), py::arg("unit"), py::arg("cap"),
      "Best fit of items (sizes in bytes, non-increasing in units of unit) into holes [hole_s, hole_e) "
      "(bytes, in the order given): int64 byte offsets, -1 where not placed. Units of `unit` bytes; holes "
      "of `cap` units or more are carved from the front, first given first; items of `cap` units or more "
      "are never placed. defrag.planner._best_fit_python is the model, array for array "
      "(defrag/native/planner.h).");
}

}  // namespace defrag_native
