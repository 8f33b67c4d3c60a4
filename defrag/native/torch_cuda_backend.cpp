// PyTorch's CUDA allocator backend over a defrag pool: a subclass of
// c10::cuda::CUDACachingAllocator::CUDAAllocator (`DefragAllocator`), installed the way PyTorch installs
// a custom allocator (`torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator`, which stores it
// into `CUDACachingAllocator::allocator` before PyTorch's first CUDA allocation). Its own extension
// module (`defrag_cuda_backend`, built by `defrag.cuda_backend` on first use where torch has CUDA):
// it links c10_cuda, which the main native module must not need.
//
// It talks to the pool only through the pool's C ABI (`pool_abi.h`), found with dlsym in the loaded
// main module (`attach`); PyTorch's questions are answered from the pool:
// - allocate / the DataPtr's deleter: `defrag_pool_alloc` / `defrag_pool_free` (the books' mutex, no
//   GIL unless pages must be mapped); every DataPtr (zero-size ones and graphs' private blocks
//   included) carries `raw_deleter()`'s deleter, as cudagraph trees require; the DataPtr's context is
//   its data pointer (PyTorch's copy-on-write needs that); allocations and frees are reported to
//   PyTorch's profiler (its memory timeline) as PyTorch's allocator reports them;
// - getDeviceStats / reset*: `defrag_pool_stats` and friends (they take the GIL: see the ABI), plus
//   the per-pool "small"/"large" split this backend counts itself (PyTorch's 1 MiB threshold);
// - cacheInfo, emptyCache, get/setMemoryFraction: the ABI;
// - snapshots and history: segments and blocks from the pool's own `Pool.snapshot()` (this backend
//   takes the GIL to ask it, never while holding any lock of its own or the pool's), traces and
//   frames recorded here with PyTorch's own context recorder (`recordHistory`), so PyTorch's
//   `_snapshot`, `_dump_snapshot`, `_memory_viz` and `defrag replay` read them;
// - recordStream: `defrag_pool_record_stream`: the pool's books make the block's free wait for events
//   on those streams before its range is reused, as PyTorch's caching allocator does (a block only its
//   own stream used is reusable at once on that stream; another stream is fenced first: streams.h);
// - CUDA graphs and MemPools (beginAllocateToPool / endAllocateToPool / releasePool, graph trees'
//   getCheckpointState / setCheckpointPoolState): a private pool per MemPool id, carved here from
//   segments that are ordinary pool blocks (pinned: never moved), reused only by that private pool,
//   given back to the pool when it is released and empty;
// - IPC (shareIpcHandle, getIpcDevPtr, getBaseAllocation): one clear error (the pool's pages are CUDA
//   virtual memory made without a shareable handle).
//
// Versions: torch 2.4 and later. The virtual interface changed between versions (the base class,
// emptyCache's and snapshot's MempoolId_t, recordHistory's clearHistory and skip_actions, MemPool's
// createOrIncrefPool / setUseOnOOM / setNoSplit, getExpandableSegmentSizes, the OOM rejection
// observer, ...). Every variant is declared here; a method overrides when its signature is the
// base's, and is an unused extra otherwise. Types an older torch lacks come from
// `defrag_torch_fallback` (found only when the torch namespace does not declare the name). On the
// versions whose headers were compile-checked (2.13, 2.14) every override is marked `override`; on the
// others the static_assert below catches a missed pure virtual, and `features()` reports which
// non-pure ones PyTorch's calls reach.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "pool_abi.h"

#define DEFRAG_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !DEFRAG_TORCH_AT_LEAST(2, 4)
#error "defrag's CUDA allocator backend needs torch >= 2.4 (older torch keeps the pluggable allocator route)"
#endif

// `override` where the signature was checked against the installed torch's headers (2.13, 2.14);
// elsewhere a declaration overrides exactly when its signature is the base's.
#if DEFRAG_TORCH_AT_LEAST(2, 13)
#define DEFRAG_CHECKED override
#else
#define DEFRAG_CHECKED
#endif

namespace py = pybind11;

// Types that older torch lacks, so that the declarations that use them compile there (as extras that
// override nothing). Qualified lookup in the torch namespace finds torch's own declaration first.
namespace defrag_torch_fallback {
struct ShareableHandle {
  ptrdiff_t offset;
  std::string handle;
};
struct StreamSegmentSize {
  StreamSegmentSize(cudaStream_t s, bool small_, size_t sz) : stream(s), is_small_pool(small_), total_size(sz) {}
  cudaStream_t stream;
  bool is_small_pool;
  size_t total_size;
};
using OomRejectionObserver = std::function<void(int64_t, size_t, size_t, size_t)>;
}  // namespace defrag_torch_fallback

namespace c10::cuda::CUDACachingAllocator {
using namespace ::defrag_torch_fallback;  // NOLINT: only for names this torch does not declare
}  // namespace c10::cuda::CUDACachingAllocator

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;
using Context = std::shared_ptr<c10::GatheredContext>;

constexpr int kDevices = 64;
constexpr size_t kAlignment = 512;           // the pool's block alignment
constexpr size_t kSmallSize = 1 << 20;       // PyTorch's small pool: blocks up to 1 MiB
constexpr size_t kSmallSegment = 2 << 20;    // PyTorch's segment sizes, for graphs' private pools
constexpr size_t kMediumSegment = 20 << 20;
constexpr size_t kMediumLimit = 10 << 20;
constexpr size_t kWhyLength = 4096;
enum { kAll = 0, kSmall = 1, kLarge = 2 };  // c10::CachingAllocator::StatType

const char* const kIpcRefusal =
    "defrag: this CUDA tensor lives in a defrag pool (`defrag run` / defrag.install), whose pages are CUDA "
    "virtual memory made without a shareable handle, so it cannot be shared with another process "
    "(torch.multiprocessing, CUDA IPC). Send a copy made outside the pool instead (tensor.cpu(), or run the "
    "process that shares it without `defrag run`).";

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Whether Python may be called now (PyTorch's context recorder and trace trackers call into it): not
// once the interpreter is finalizing, when late frees still arrive.
bool python_alive() {
  if (!Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

// ---------------------------------------------------------------------------------------------- ABI
struct PoolAbi {
  decltype(&defrag_pool_abi_version) version = nullptr;
  decltype(&defrag_pool_stats_size) stats_size = nullptr;
  decltype(&defrag_pool_alloc) alloc = nullptr;
  decltype(&defrag_pool_free) free = nullptr;
  decltype(&defrag_pool_stats) stats = nullptr;
  decltype(&defrag_pool_reset_peaks) reset_peaks = nullptr;
  decltype(&defrag_pool_reset_accumulated) reset_accumulated = nullptr;
  decltype(&defrag_pool_largest_block) largest_block = nullptr;
  decltype(&defrag_pool_empty_cache) empty_cache = nullptr;
  decltype(&defrag_pool_memory_fraction) memory_fraction = nullptr;
  decltype(&defrag_pool_set_memory_fraction) set_memory_fraction = nullptr;
  decltype(&defrag_pool_record_stream) record_stream = nullptr;
  decltype(&defrag_pool_set_budget) set_budget = nullptr;
  decltype(&defrag_pool_capture) capture = nullptr;
};
PoolAbi g_abi;                        // filled once by `attach` (with the GIL), read-only afterwards
std::atomic<bool> g_attached{false};

template <class Fn>
void find(void* library, const char* name, Fn& slot) {
  slot = reinterpret_cast<Fn>(dlsym(library, name));
  if (slot == nullptr) throw std::runtime_error(std::string("defrag's native module does not export ") + name);
}

// Find the pool's ABI in the loaded native module at `path` (dlopen of a loaded library returns it).
void attach(const std::string& path) {
  if (g_attached.load()) return;
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) throw std::runtime_error("defrag's native module is not loaded from " + path);
  PoolAbi abi;
  find(library, "defrag_pool_abi_version", abi.version);
  if (abi.version() != DEFRAG_POOL_ABI_VERSION)
    throw std::runtime_error("defrag's native module speaks pool ABI version " + std::to_string(abi.version()) +
                             ", this backend version " + std::to_string(DEFRAG_POOL_ABI_VERSION));
  find(library, "defrag_pool_stats_size", abi.stats_size);
  find(library, "defrag_pool_alloc", abi.alloc);
  find(library, "defrag_pool_free", abi.free);
  find(library, "defrag_pool_stats", abi.stats);
  find(library, "defrag_pool_reset_peaks", abi.reset_peaks);
  find(library, "defrag_pool_reset_accumulated", abi.reset_accumulated);
  find(library, "defrag_pool_largest_block", abi.largest_block);
  find(library, "defrag_pool_empty_cache", abi.empty_cache);
  find(library, "defrag_pool_memory_fraction", abi.memory_fraction);
  find(library, "defrag_pool_set_memory_fraction", abi.set_memory_fraction);
  find(library, "defrag_pool_record_stream", abi.record_stream);
  find(library, "defrag_pool_set_budget", abi.set_budget);
  find(library, "defrag_pool_capture", abi.capture);
  g_abi = abi;
  g_attached.store(true);
}

// -------------------------------------------------------------------------------------- counters
// What this backend counts itself: PyTorch's blocks by its small/large split (the pool knows no such
// split). Atomics only: no lock on the allocation path.
struct Tally {
  std::atomic<int64_t> bytes{0}, bytes_peak{0}, bytes_allocated{0}, bytes_freed{0};
  std::atomic<int64_t> blocks{0}, blocks_peak{0}, blocks_allocated{0}, blocks_freed{0};
};

void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void count_alloc(Tally& t, int64_t size) {
  raise_to(t.bytes_peak, t.bytes.fetch_add(size, std::memory_order_relaxed) + size);
  raise_to(t.blocks_peak, t.blocks.fetch_add(1, std::memory_order_relaxed) + 1);
  t.bytes_allocated.fetch_add(size, std::memory_order_relaxed);
  t.blocks_allocated.fetch_add(1, std::memory_order_relaxed);
}

void count_free(Tally& t, int64_t size) {
  t.bytes.fetch_sub(size, std::memory_order_relaxed);
  t.blocks.fetch_sub(1, std::memory_order_relaxed);
  t.bytes_freed.fetch_add(size, std::memory_order_relaxed);
  t.blocks_freed.fetch_add(1, std::memory_order_relaxed);
}

// ------------------------------------------------------------------------------ graphs' private pools
// One MemPool id's memory: segments that are pool blocks, carved here (best fit, coalescing).
struct Segment {
  uintptr_t base = 0;
  size_t size = 0;
  std::map<uintptr_t, size_t> free;  // start -> length
  size_t live = 0;
};

// A live block of a private pool: its size, segment, the stream it was made for and the other streams
// that used it (recordStream): its free waits for an event on each (PyTorch's stream_uses).
struct PrivateBlock {
  size_t size = 0;
  Segment* segment = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> uses;
};

// A freed private block waiting for its streams: events recorded (`events`), or none yet because a
// capture was underway when it was freed (recorded once none is, as PyTorch's allocator defers them).
struct PendingFree {
  uintptr_t addr = 0;
  PrivateBlock block;
  std::vector<cudaEvent_t> events;
};

struct PrivatePool {
  int use_count = 0;
  std::vector<std::unique_ptr<Segment>> segments;
  std::unordered_map<uintptr_t, PrivateBlock> blocks;  // live
  std::vector<PendingFree> pending;                     // freed, waiting for other streams
};

// A checkpoint of a private pool (graph trees): its live blocks.
struct PrivateState : cca::AllocatorState {
  int device = 0;
  MempoolId id{0, 0};
  std::vector<std::pair<uintptr_t, size_t>> blocks;
};

// Recorded history (`recordHistory`), process-wide as PyTorch's is.
struct History {
  std::mutex mu;
  std::atomic<bool> on{false};
  cca::CreateContextFn recorder = nullptr;
  cca::RecordContext when = cca::RecordContext::NEVER;
  size_t max_entries = 0;
  std::vector<std::vector<cca::TraceEntry>> traces;  // per device, a ring of max_entries
  std::vector<size_t> next;                          // per device: the ring's oldest entry once full
  std::unordered_map<uintptr_t, Context> contexts;   // live block -> its allocation's context
};

// Everything per device. Leaked: deleters may run at exit, after static destructors.
struct Device {
  Tally small, large;
  std::atomic<int64_t> retries{0}, ooms{0};  // this backend's own (on top of the pool's)
  // CUDA graphs and MemPools.
  std::mutex graphs_mu;
  std::atomic<int> capturing{0};  // entries of `captures`: 0 skips the lock on every allocation
  std::atomic<bool> had_pools{false};  // a private pool was ever made here
  std::atomic<int64_t> private_live{0};  // live private blocks: frees look in the private pools only then
  std::atomic<int64_t> frees{0};         // blocks given back to the pool (emptyCache trims only after one)
  int64_t frees_at_trim = -1;           // `frees` at the last trim (graphs_mu)
  std::atomic<double> fraction{-1.0};    // setMemoryFraction on a device no pool serves (PyTorch's answer)
  std::vector<std::pair<MempoolId, std::function<bool(cudaStream_t)>>> captures;
  std::map<MempoolId, PrivatePool> pools;
  // The pool's statistics as last answered (used when the pool cannot be asked now).
  std::mutex stats_mu;
  DefragPoolStats last{};
  int64_t inactive_peak = 0, requested_peak = 0;
  py::object* snapshot_source = nullptr;  // the pool's snapshot(), leaked
};

Device* const g_devices = new Device[kDevices];
History* const g_history = new History();
std::mutex* const g_observers_mu = new std::mutex();
auto* const g_oom_observers = new std::vector<cca::OutOfMemoryObserver>();
auto* const g_trace_trackers = new std::vector<cca::AllocatorTraceTracker>();
std::atomic<bool> g_tracking{false};

Device& device_state(int device) {
  TORCH_CHECK(device >= 0 && device < kDevices, "defrag: cuda:", device, " is beyond the devices this allocator serves");
  return g_devices[device];
}

Tally& tally(Device& d, size_t size) { return size <= kSmallSize ? d.small : d.large; }

// ---------------------------------------------------------------------------------------- history
// TraceEntry's constructor took a MempoolId_t from some torch version on: a template, so that only the
// matching construction is compiled.
template <class TE = cca::TraceEntry>
TE make_entry(typename TE::Action action, int device, uintptr_t addr, size_t size, cudaStream_t stream,
              MempoolId pool, Context context) {
  const c10::approx_time_t now = c10::getApproximateTime();
  const auto index = static_cast<c10::DeviceIndex>(device);
  if constexpr (std::is_constructible_v<TE, typename TE::Action, c10::DeviceIndex, size_t, size_t, cudaStream_t,
                                        MempoolId, c10::approx_time_t, Context>) {
    TE e(action, index, addr, size, stream, pool, now, std::move(context));
    e.time_.t_ = static_cast<time_t>(wall_us());  // PyTorch's snapshots carry microseconds
    return e;
  } else {
    TE e(action, index, addr, size, stream, now, std::move(context));
    e.time_.t_ = static_cast<time_t>(wall_us());
    return e;
  }
}

// One trace entry for `device` (and the trace trackers). `context`: the caller gathered it (outside
// every lock: PyTorch's recorder may take the GIL).
void trace(cca::TraceEntry::Action action, int device, uintptr_t addr, size_t size, cudaStream_t stream,
           MempoolId pool, Context context) {
  History& h = *g_history;
  cca::TraceEntry entry = make_entry(action, device, addr, size, stream, pool, std::move(context));
  if (g_tracking.load(std::memory_order_relaxed) && python_alive()) {
    std::vector<cca::AllocatorTraceTracker> trackers;
    {
      std::lock_guard<std::mutex> guard(*g_observers_mu);
      trackers = *g_trace_trackers;
    }
    for (auto& tracker : trackers) tracker(entry);
  }
  if (!h.on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> guard(h.mu);
  if (!h.on.load() || h.max_entries == 0) return;
  if (static_cast<size_t>(device) >= h.traces.size()) {
    h.traces.resize(device + 1);
    h.next.resize(device + 1, 0);
  }
  auto& ring = h.traces[device];
  if (ring.size() < h.max_entries) {
    ring.push_back(std::move(entry));
  } else {
    ring[h.next[device]] = std::move(entry);
    h.next[device] = (h.next[device] + 1) % h.max_entries;
  }
}

Context gather(bool on_free) {
  History& h = *g_history;
  if (!h.on.load(std::memory_order_relaxed) || !python_alive()) return nullptr;
  cca::CreateContextFn recorder;
  cca::RecordContext when;
  {
    std::lock_guard<std::mutex> guard(h.mu);
    recorder = h.recorder;
    when = h.when;
  }
  const bool wanted = on_free ? when == cca::RecordContext::ALL : when != cca::RecordContext::NEVER;
  return wanted && recorder != nullptr ? recorder() : nullptr;
}

void history_alloc(int device, uintptr_t addr, size_t size, cudaStream_t stream, MempoolId pool) {
  if (!g_history->on.load(std::memory_order_relaxed) && !g_tracking.load(std::memory_order_relaxed)) return;
  Context context = gather(false);
  {
    History& h = *g_history;
    std::lock_guard<std::mutex> guard(h.mu);
    if (h.on.load() && context != nullptr && h.when != cca::RecordContext::NEVER) h.contexts[addr] = context;
  }
  trace(cca::TraceEntry::ALLOC, device, addr, size, stream, pool, std::move(context));
}

void history_free(int device, uintptr_t addr, size_t size, MempoolId pool) noexcept {
  if (!g_history->on.load(std::memory_order_relaxed) && !g_tracking.load(std::memory_order_relaxed)) return;
  try {
    Context context = gather(true);
    {
      History& h = *g_history;
      std::lock_guard<std::mutex> guard(h.mu);
      h.contexts.erase(addr);
    }
    trace(cca::TraceEntry::FREE_REQUESTED, device, addr, size, nullptr, pool, context);
    trace(cca::TraceEntry::FREE_COMPLETED, device, addr, size, nullptr, pool, std::move(context));
  } catch (...) {  // a deleter never throws: the entry is lost
  }
}

// ---------------------------------------------------------------------------------- release paths
// What PyTorch's profiler is told of each allocation and free (its memory timeline), as PyTorch's own
// allocator tells it: the block's size (negative on a free), the bytes allocated and reserved after it.
void report_to_profiler(int device, uintptr_t addr, int64_t size) noexcept {
  try {
    if (!c10::memoryProfilingEnabled()) return;
    Device& d = g_devices[device];
    const int64_t allocated = d.small.bytes.load(std::memory_order_relaxed) + d.large.bytes.load(std::memory_order_relaxed);
    int64_t reserved;
    {
      std::lock_guard<std::mutex> guard(d.stats_mu);
      reserved = std::max(d.last.reserved_bytes, allocated);
    }
    c10::reportMemoryUsageToProfiler(reinterpret_cast<void*>(addr), size, static_cast<size_t>(allocated),
                                     static_cast<size_t>(reserved),
                                     c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  } catch (...) {  // a deleter never throws: the report is lost
  }
}

// A pool block goes back to the pool (counted, traced). noexcept: runs in deleters.
void give_back(int device, uintptr_t addr) noexcept {
  int32_t where = device;
  const int64_t size = g_abi.free(device, reinterpret_cast<void*>(addr), &where);
  if (size < 0) return;  // not the pool's (counted there as a foreign free)
  Device& d = g_devices[where];
  count_free(tally(d, static_cast<size_t>(size)), size);
  d.frees.fetch_add(1, std::memory_order_relaxed);
  report_to_profiler(where, addr, -size);
  history_free(where, addr, static_cast<size_t>(size), MempoolId{0, 0});
}

// Whether `addr` is a live block of one of `d`'s private pools (graphs_mu not held).
bool is_private(Device& d, uintptr_t addr) {
  if (d.private_live.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> guard(d.graphs_mu);
  for (auto& entry : d.pools)
    if (entry.second.blocks.count(addr) > 0) return true;
  return false;
}

void free_private(int device, uintptr_t addr) noexcept;

// The one deleter of every DataPtr this backend hands out, and `raw_deleter()` (PyTorch's
// `_has_Standard_Deleter`, which cudagraph trees require of each output): a graph's private block
// goes back to its private pool, any other to the pool. A block's device is looked up (private pools
// only while they hold live blocks; the pool's books find their own blocks on any device).
void free_any(void* ptr) noexcept {
  if (ptr == nullptr) return;
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  for (int dev = 0; dev < kDevices; ++dev) {
    Device& d = g_devices[dev];
    if (!d.had_pools.load(std::memory_order_acquire)) continue;
    bool mine = false;
    try {
      mine = is_private(d, addr);
    } catch (...) {
    }
    if (mine) {
      free_private(dev, addr);
      return;
    }
  }
  int device = 0;
  try {
    device = c10::cuda::current_device();
  } catch (...) {
  }
  give_back(device, addr);
}

// ------------------------------------------------------------------------------------ private pools
// Best fit in `pool`'s segments for `size` (rounded), for `stream`: its address, or 0. graphs_mu held.
uintptr_t carve(PrivatePool& pool, size_t size, cudaStream_t stream) {
  Segment* best_seg = nullptr;
  std::map<uintptr_t, size_t>::iterator best;
  for (auto& seg : pool.segments) {
    for (auto it = seg->free.begin(); it != seg->free.end(); ++it) {
      if (it->second >= size && (best_seg == nullptr || it->second < best->second)) {
        best_seg = seg.get();
        best = it;
      }
    }
  }
  if (best_seg == nullptr) return 0;
  const uintptr_t addr = best->first;
  const size_t left = best->second - size;
  best_seg->free.erase(best);
  if (left > 0) best_seg->free.emplace(addr + size, left);
  best_seg->live += 1;
  PrivateBlock block;
  block.size = size;
  block.segment = best_seg;
  block.stream = stream;
  pool.blocks.emplace(addr, std::move(block));
  return addr;
}

// Carve exactly [addr, addr + size) out of `seg`'s free ranges (a checkpoint's block); false if not free.
bool carve_at(PrivatePool& pool, Segment& seg, uintptr_t addr, size_t size) {
  auto it = seg.free.upper_bound(addr);
  if (it == seg.free.begin()) return false;
  --it;
  const uintptr_t start = it->first;
  const size_t length = it->second;
  if (addr + size > start + length) return false;
  seg.free.erase(it);
  if (addr > start) seg.free.emplace(start, addr - start);
  if (start + length > addr + size) seg.free.emplace(addr + size, start + length - addr - size);
  seg.live += 1;
  PrivateBlock block;
  block.size = size;
  block.segment = &seg;
  pool.blocks.emplace(addr, std::move(block));
  return true;
}

void uncarve(Segment& seg, uintptr_t addr, size_t size) {
  auto next = seg.free.lower_bound(addr);
  if (next != seg.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == addr) {
      addr = prev->first;
      size += prev->second;
      seg.free.erase(prev);
    }
  }
  if (next != seg.free.end() && addr + size == next->first) {
    size += next->second;
    seg.free.erase(next);
  }
  seg.free.emplace(addr, size);
  seg.live -= 1;
}

// Empty segments of a private pool nobody uses any more, taken out (graphs_mu held); the caller gives
// them back to the pool after letting the mutex go.
std::vector<uintptr_t> take_empty_segments(PrivatePool& pool, bool only_unused) {
  std::vector<uintptr_t> out;
  if (only_unused && pool.use_count > 0) return out;
  auto keep = pool.segments.begin();
  for (auto& seg : pool.segments) {
    if (seg->live == 0) {
      out.push_back(seg->base);
    } else {
      *keep++ = std::move(seg);
    }
  }
  pool.segments.erase(keep, pool.segments.end());
  return out;
}

// Whether the calling thread's current stream on `device` is capturing a CUDA graph (true where CUDA
// will not say).
bool stream_capturing(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Freed private blocks whose streams finished go back to their segments (graphs_mu held), as PyTorch's
// `process_events`: nothing while a capture is underway on this device (no event may be recorded for or
// queried then); blocks freed during a capture get their events now.
void settle_private(Device& d, PrivatePool& pool) noexcept {
  if (pool.pending.empty() || d.capturing.load(std::memory_order_acquire) > 0) return;
  size_t kept = 0;
  for (size_t i = 0; i < pool.pending.size(); ++i) {
    PendingFree& f = pool.pending[i];
    bool done = true;
    if (f.events.empty()) {  // freed during a capture: its events are recorded now
      for (cudaStream_t s : f.block.uses) {
        cudaEvent_t e = nullptr;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess ||
            cudaEventRecord(e, s) != cudaSuccess) {
          (void)cudaGetLastError();
          if (e != nullptr) cudaEventDestroy(e);
          e = nullptr;
        }
        if (e != nullptr) f.events.push_back(e);
      }
      if (f.events.empty()) f.events.push_back(nullptr);  // none could be recorded: done below
    }
    for (cudaEvent_t e : f.events) {
      if (e == nullptr) continue;
      const cudaError_t q = cudaEventQuery(e);
      if (q == cudaErrorNotReady) {
        (void)cudaGetLastError();
        done = false;
        break;
      }
      if (q != cudaSuccess) (void)cudaGetLastError();
    }
    if (!done) {
      if (kept != i) pool.pending[kept] = std::move(f);
      ++kept;
      continue;
    }
    for (cudaEvent_t e : f.events)
      if (e != nullptr) cudaEventDestroy(e);
    uncarve(*f.block.segment, f.addr, f.block.size);
  }
  pool.pending.resize(kept);
}

void free_private(int device, uintptr_t addr) noexcept {
  Device& d = g_devices[device];
  std::vector<uintptr_t> back;
  size_t size = 0;
  MempoolId id{0, 0};
  {
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    for (auto it = d.pools.begin(); it != d.pools.end(); ++it) {
      auto found = it->second.blocks.find(addr);
      if (found == it->second.blocks.end()) continue;
      size = found->second.size;
      PrivateBlock block = std::move(found->second);
      it->second.blocks.erase(found);
      d.private_live.fetch_sub(1, std::memory_order_release);
      if (block.uses.empty()) {
        uncarve(*block.segment, addr, size);
      } else {
        // Used on other streams (recordStream): reused once an event on each completed (recorded at
        // once, or after the capture underway, as PyTorch's allocator does).
        try {
          PendingFree f;
          f.addr = addr;
          f.block = std::move(block);
          it->second.pending.push_back(std::move(f));
        } catch (...) {  // no host memory: the range stays carved (a leak, never a double use)
        }
        settle_private(d, it->second);
      }
      id = it->first;
      back = take_empty_segments(it->second, true);
      if (it->second.use_count == 0 && it->second.segments.empty()) d.pools.erase(it);
      break;
    }
  }
  if (size == 0) return;
  count_free(tally(d, size), static_cast<int64_t>(size));
  report_to_profiler(device, addr, -static_cast<int64_t>(size));
  history_free(device, addr, size, id);
  for (uintptr_t seg : back) give_back(device, seg);
}

// ------------------------------------------------------------------------------------- the allocator
std::string ask_failed(int32_t status, const char* what) {
  switch (status) {
    case DEFRAG_POOL_NO_POOL:
      return std::string("defrag: ") + what + ": no pool was installed for this device";
    case DEFRAG_POOL_BUSY:
      return std::string("defrag: ") + what + " cannot ask the pool now (it is called from the pool's own code, "
                                              "or while Python exits)";
    default:
      return std::string("defrag: ") + what + " failed in the pool";
  }
}

// Whether a pool serves `d` (defrag.install registered one for its device): PyTorch's answers for a
// device without one are its defaults (zeros, fraction 1.0), as for a device it never allocated on.
bool served(const Device& d) { return d.snapshot_source != nullptr; }

cudaStream_t capture_stream(int device) noexcept {
  try {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  } catch (...) {
    return nullptr;
  }
}

class DefragAllocator : public cca::CUDAAllocator {
 public:
  // ------------------------------------------------------------------ allocation
  c10::DataPtr allocate(size_t n) DEFRAG_CHECKED { return allocate_now(n); }
  c10::DataPtr allocate(size_t n) const { return const_cast<DefragAllocator*>(this)->allocate_now(n); }

  // Every DataPtr this backend hands out carries this deleter (cudagraph trees check it).
  c10::DeleterFnPtr raw_deleter() const DEFRAG_CHECKED { return &free_any; }

  void* raw_alloc(size_t nbytes) DEFRAG_CHECKED {
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream().stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) DEFRAG_CHECKED {
    if (nbytes == 0) return nullptr;
    const int device = c10::cuda::current_device();
    c10::DataPtr p = place(nbytes, device, stream);
    return p.release_context();  // the context is the pointer; raw_delete gives it back
  }

  void raw_delete(void* ptr) DEFRAG_CHECKED { free_any(ptr); }

  void copy_data(void* dest, const void* src, std::size_t count) const DEFRAG_CHECKED {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void init(int device_count) DEFRAG_CHECKED {
    TORCH_CHECK(device_count <= kDevices, "defrag: ", device_count, " CUDA devices; defrag's allocator serves ",
                kDevices);
    initialized_ = true;
  }
  bool initialized() DEFRAG_CHECKED { return initialized_; }

  // ------------------------------------------------------------------ statistics
  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) DEFRAG_CHECKED {
    Device& d = device_state(device);
    cca::DeviceStats out;
    if (!served(d)) return out;  // no pool serves this device: nothing allocated there (PyTorch's zeros)
    DefragPoolStats s = pool_stats(device, d);
    auto set = [](auto& stat, int64_t current, int64_t peak, int64_t allocated, int64_t freed) {
      stat.current = current;
      stat.peak = peak;
      stat.allocated = allocated;
      stat.freed = freed;
    };
    // The aggregate is the pool's (every block, PyTorch's and the pool's own); the small/large split
    // is what PyTorch asked for, counted here.
    const Tally* parts[2] = {&d.small, &d.large};
    for (int i = 0; i < 2; ++i) {
      const Tally& t = *parts[i];
      set(out.allocated_bytes[kSmall + i], t.bytes.load(), t.bytes_peak.load(), t.bytes_allocated.load(),
          t.bytes_freed.load());
      set(out.active_bytes[kSmall + i], t.bytes.load(), t.bytes_peak.load(), t.bytes_allocated.load(),
          t.bytes_freed.load());
      set(out.allocation[kSmall + i], t.blocks.load(), t.blocks_peak.load(), t.blocks_allocated.load(),
          t.blocks_freed.load());
      set(out.active[kSmall + i], t.blocks.load(), t.blocks_peak.load(), t.blocks_allocated.load(),
          t.blocks_freed.load());
    }
    const int64_t bytes_allocated = d.small.bytes_allocated.load() + d.large.bytes_allocated.load();
    const int64_t bytes_freed = d.small.bytes_freed.load() + d.large.bytes_freed.load();
    set(out.allocated_bytes[kAll], s.allocated_bytes, s.allocated_bytes_peak, bytes_allocated, bytes_freed);
    set(out.active_bytes[kAll], s.active_bytes, s.active_bytes_peak, bytes_allocated, bytes_freed);
    set(out.allocation[kAll], s.live_blocks, std::max(s.live_blocks, d.small.blocks_peak.load() + d.large.blocks_peak.load()),
        s.num_allocs, s.num_frees);
    set(out.active[kAll], s.live_blocks, out.allocation[kAll].peak, s.num_allocs, s.num_frees);
    // Reserved memory is the pool's mapped pages: one "large" pool of page-sized segments.
    const int64_t page = std::max<int64_t>(s.page_size, 1);
    for (int which : {kAll, kLarge}) {
      set(out.reserved_bytes[which], s.reserved_bytes, s.reserved_bytes_peak, s.num_device_alloc * page,
          s.num_device_free * page);
      set(out.segment[which], s.mapped_pages, s.reserved_bytes_peak / page, s.num_device_alloc, s.num_device_free);
      set(out.inactive_split_bytes[which], s.inactive_split_bytes, d.inactive_peak, 0, 0);
    }
    set(out.requested_bytes[kAll], s.requested_bytes, d.requested_peak, 0, 0);
    out.num_alloc_retries = s.num_alloc_retries + d.retries.load();
    out.num_ooms = s.num_ooms;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) DEFRAG_CHECKED {
    Device& d = device_state(device);
    for (Tally* t : {&d.small, &d.large}) {
      t->bytes_allocated = 0;
      t->bytes_freed = 0;
      t->blocks_allocated = 0;
      t->blocks_freed = 0;
    }
    d.retries = 0;
    d.ooms = 0;
    if (!served(d)) return;
    const int32_t status = g_abi.reset_accumulated(device);
    TORCH_CHECK(status == DEFRAG_POOL_OK || status == DEFRAG_POOL_NO_POOL,
                ask_failed(status, "resetAccumulatedStats"));
  }

  void resetPeakStats(c10::DeviceIndex device) DEFRAG_CHECKED {
    Device& d = device_state(device);
    for (Tally* t : {&d.small, &d.large}) {
      t->bytes_peak = t->bytes.load();
      t->blocks_peak = t->blocks.load();
    }
    if (!served(d)) return;
    const int32_t status = g_abi.reset_peaks(device);
    TORCH_CHECK(status == DEFRAG_POOL_OK || status == DEFRAG_POOL_NO_POOL, ask_failed(status, "resetPeakStats"));
    std::lock_guard<std::mutex> guard(d.stats_mu);
    d.inactive_peak = d.last.inactive_split_bytes;
    d.requested_peak = d.last.requested_bytes;
  }

  // PyTorch's answer: the larger of the caller's guess (or, when it passes 0, the device's free
  // memory) and the largest cached block. Here the device's free memory counts only as far as the
  // pool may still grow (its budget less what it holds), and the largest cached block is the pool's
  // largest free range in mapped pages. cuDNN sizes its benchmark workspaces by it.
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) DEFRAG_CHECKED {
    Device& d = device_state(device);
    size_t largest = *largestBlock;
    if (!served(d)) return;  // no pool: nothing can be placed on this device
    DefragPoolStats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    if (g_abi.stats(device, &s) == DEFRAG_POOL_OK) {
      std::lock_guard<std::mutex> guard(d.stats_mu);
      d.last = s;
    } else {
      std::lock_guard<std::mutex> guard(d.stats_mu);
      s = d.last;
    }
    if (largest == 0) {
      size_t device_free = 0, device_total = 0;
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
      const int64_t room = std::max<int64_t>(0, s.capacity_bytes - s.reserved_bytes);
      largest = std::min(device_free, static_cast<size_t>(room));
    }
    *largestBlock = std::max(largest, static_cast<size_t>(std::max<int64_t>(0, s.largest_mapped_free)));
  }

  // The pool's budget as a fraction of the device; on a device no pool serves, what was set there,
  // else PyTorch's default 1.0.
  double getMemoryFraction(c10::DeviceIndex device) DEFRAG_CHECKED {
    Device& d = device_state(device);
    if (!served(d)) {
      const double set = d.fraction.load();
      return set > 0 ? set : 1.0;
    }
    double fraction = 0;
    const int32_t status = g_abi.memory_fraction(device, &fraction);
    TORCH_CHECK(status == DEFRAG_POOL_OK, ask_failed(status, "getMemoryFraction"));
    return fraction;
  }

  // PyTorch's `set_per_process_memory_fraction`: the pool's budget becomes fraction x the device's
  // memory, lower or higher (up to the device) than its capacity; see `defrag_pool_set_budget`.
  void setMemoryFraction(double fraction, c10::DeviceIndex device) DEFRAG_CHECKED {
    Device& d = device_state(device);
    TORCH_CHECK(fraction > 0.0 && fraction <= 1.0, "defrag: invalid fraction ", fraction,
                "; a memory fraction must be in (0, 1]");
    if (!served(d)) {
      d.fraction.store(fraction);
      return;
    }
    char why[kWhyLength] = "";
    const int32_t status = g_abi.set_budget(device, fraction, why, sizeof why);
    TORCH_CHECK(status == DEFRAG_POOL_OK, why[0] ? why : ask_failed(status, "setMemoryFraction").c_str());
  }

  // ------------------------------------------------------------------ empty cache
  void emptyCache() { empty_cache(MempoolId{0, 0}); }
  void emptyCache(MempoolId mempool_id) DEFRAG_CHECKED { empty_cache(mempool_id); }

  // ------------------------------------------------------------------ streams
  // PyTorch's recordStream: the block's free waits for `stream` (the pool's books for a pool block; for
  // a graph's private block, its private pool, as PyTorch's stream_uses).
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) DEFRAG_CHECKED {
    const int index = ptr.device().index();
    if (ptr.get() == nullptr || index < 0 || index >= kDevices || ptr.get_deleter() != &free_any) return;
    Device& d = g_devices[index];
    const auto addr = reinterpret_cast<uintptr_t>(ptr.get());
    if (d.private_live.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> guard(d.graphs_mu);
      for (auto& entry : d.pools) {
        auto found = entry.second.blocks.find(addr);
        if (found == entry.second.blocks.end()) continue;
        PrivateBlock& block = found->second;
        const cudaStream_t s = stream.stream();
        if (s != block.stream && std::find(block.uses.begin(), block.uses.end(), s) == block.uses.end())
          block.uses.push_back(s);
        return;
      }
    }
    (void)g_abi.record_stream(index, ptr.get(), stream.stream());
  }

  void* getBaseAllocation(void* /*ptr*/, size_t* /*size*/) DEFRAG_CHECKED { TORCH_CHECK(false, kIpcRefusal); }

  // ------------------------------------------------------------------ IPC
  cca::ShareableHandle shareIpcHandle(void* /*ptr*/) DEFRAG_CHECKED { TORCH_CHECK(false, kIpcRefusal); }

  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) DEFRAG_CHECKED {
    TORCH_CHECK(false,
                "defrag: this process runs under defrag's allocator (`defrag run` / defrag.install), which cannot "
                "open a CUDA tensor shared by another process (CUDA IPC): receive a CPU copy instead, or run this "
                "process without `defrag run`.");
  }

  // ------------------------------------------------------------------ snapshots and history
  cca::SnapshotInfo snapshot() { return take_snapshot(true); }
  cca::SnapshotInfo snapshot(MempoolId /*mempool_id*/) { return take_snapshot(true); }
  cca::SnapshotInfo snapshot(MempoolId /*mempool_id*/, bool include_traces) DEFRAG_CHECKED {
    return take_snapshot(include_traces);
  }

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when) {
    record_history(enabled, context_recorder, alloc_trace_max_entries, when, false);
  }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory) {
    record_history(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory);
  }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& /*skip_actions*/) DEFRAG_CHECKED {
    record_history(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory);
  }

  bool isHistoryEnabled() DEFRAG_CHECKED { return g_history->on.load(); }

  Context getContextForPointer(const void* ptr) DEFRAG_CHECKED {
    std::lock_guard<std::mutex> guard(g_history->mu);
    auto it = g_history->contexts.find(reinterpret_cast<uintptr_t>(ptr));
    return it != g_history->contexts.end() ? it->second : nullptr;
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) DEFRAG_CHECKED {
    std::lock_guard<std::mutex> guard(*g_observers_mu);
    g_oom_observers->push_back(std::move(observer));
  }

  // The pool never rejects a request before trying it, so these observers are never called.
  void attachOomRejectionObserver(cca::OomRejectionObserver /*observer*/) DEFRAG_CHECKED {}

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) DEFRAG_CHECKED {
    std::lock_guard<std::mutex> guard(*g_observers_mu);
    g_trace_trackers->push_back(std::move(tracker));
    g_tracking.store(true);
  }

  // ------------------------------------------------------------------ graphs and MemPools
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id,
                           std::function<bool(cudaStream_t)> filter) DEFRAG_CHECKED {
    Device& d = device_state(device);
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    for (auto& capture : d.captures)
      TORCH_CHECK(capture.first != mempool_id, "defrag: beginAllocateToPool: already allocating to this pool");
    d.pools[mempool_id].use_count += 1;  // made on first use
    d.had_pools.store(true, std::memory_order_release);
    d.captures.emplace_back(mempool_id, std::move(filter));
    d.capturing.store(static_cast<int>(d.captures.size()), std::memory_order_release);
    // The pool's books query no event and fence no capturing stream with an outside event meanwhile.
    (void)g_abi.capture(device, capture_stream(device), 1);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id) DEFRAG_CHECKED {
    Device& d = device_state(device);
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    auto it = std::find_if(d.captures.begin(), d.captures.end(),
                           [&](const auto& capture) { return capture.first == mempool_id; });
    TORCH_CHECK(it != d.captures.end(), "defrag: endAllocateToPool: not allocating to this pool");
    d.captures.erase(it);
    d.capturing.store(static_cast<int>(d.captures.size()), std::memory_order_release);
    (void)g_abi.capture(device, capture_stream(device), 0);
  }

  void releasePool(c10::DeviceIndex device, MempoolId mempool_id) DEFRAG_CHECKED {
    Device& d = device_state(device);
    std::vector<uintptr_t> back;
    {
      std::lock_guard<std::mutex> guard(d.graphs_mu);
      auto it = d.pools.find(mempool_id);
      TORCH_CHECK(it != d.pools.end() && it->second.use_count > 0, "defrag: releasePool: no such pool in use");
      it->second.use_count -= 1;
      back = take_empty_segments(it->second, true);
      if (it->second.use_count == 0 && it->second.segments.empty()) d.pools.erase(it);
    }
    for (uintptr_t seg : back) give_back(device, seg);
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId mempool_id) DEFRAG_CHECKED {
    Device& d = device_state(device);
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    auto it = d.pools.find(mempool_id);
    return it != d.pools.end() ? it->second.use_count : 0;
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) DEFRAG_CHECKED {
    incref(device, mempool_id, allocator.get());
  }
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId mempool_id, cca::CUDAAllocator* allocator) {
    incref(device, mempool_id, allocator);
  }

  // Every private pool is served from the pool, whatever its OOM and split settings.
  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId /*mempool_id*/, bool /*use_on_oom*/) DEFRAG_CHECKED {}
  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId /*mempool_id*/) {}
  void setNoSplit(c10::DeviceIndex /*device*/, MempoolId /*mempool_id*/) DEFRAG_CHECKED {}

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) DEFRAG_CHECKED {
    Device& d = device_state(device);
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    auto it = d.pools.find(mempool_id);
    if (it == d.pools.end()) return expected_live_allocations.empty();
    if (it->second.blocks.size() != expected_live_allocations.size()) return false;
    for (void* p : expected_live_allocations)
      if (!it->second.blocks.count(reinterpret_cast<uintptr_t>(p))) return false;
    return true;
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId id) DEFRAG_CHECKED {
    Device& d = device_state(device);
    auto state = std::make_shared<PrivateState>();
    state->device = device;
    state->id = id;
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    auto it = d.pools.find(id);
    TORCH_CHECK(it != d.pools.end(), "defrag: getCheckpointState: no such private pool");
    for (const auto& [addr, block] : it->second.blocks) state->blocks.emplace_back(addr, block.size);
    std::sort(state->blocks.begin(), state->blocks.end());
    return state;
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) DEFRAG_CHECKED {
    auto state = std::dynamic_pointer_cast<PrivateState>(as);
    TORCH_CHECK(state != nullptr && state->device == device,
                "defrag: setCheckpointPoolState: this checkpoint was not made by defrag's allocator for cuda:", device);
    Device& d = device_state(device);
    cca::CheckpointDelta delta;
    std::vector<std::pair<uintptr_t, size_t>> freed;
    {
      std::lock_guard<std::mutex> guard(d.graphs_mu);
      auto it = d.pools.find(state->id);
      TORCH_CHECK(it != d.pools.end(), "defrag: setCheckpointPoolState: the private pool is gone");
      PrivatePool& pool = it->second;
      // Every checkpointed block must lie in a segment the pool still holds (segments of a pool in use
      // are never given back), checked before anything changes.
      auto segment_of = [&](uintptr_t addr, size_t size) -> Segment* {
        for (auto& seg : pool.segments)
          if (addr >= seg->base && addr + size <= seg->base + seg->size) return seg.get();
        return nullptr;
      };
      for (const auto& [addr, size] : state->blocks)
        TORCH_CHECK(segment_of(addr, size) != nullptr,
                    "defrag: setCheckpointPoolState: a checkpointed block lies outside the pool's segments");
      for (const auto& [addr, block] : pool.blocks) freed.emplace_back(addr, block.size);
      pool.blocks.clear();
      for (auto& f : pool.pending)
        for (cudaEvent_t e : f.events)
          if (e != nullptr) cudaEventDestroy(e);
      pool.pending.clear();  // the checkpoint says what is live; the rest of its segments is free
      for (auto& seg : pool.segments) {
        seg->free.clear();
        seg->free.emplace(seg->base, seg->size);
        seg->live = 0;
      }
      for (const auto& [addr, size] : state->blocks) {
        const bool carved = carve_at(pool, *segment_of(addr, size), addr, size);
        TORCH_INTERNAL_ASSERT(carved, "defrag: checkpointed blocks overlap");
        delta.dataptrs_allocd.emplace_back(reinterpret_cast<void*>(addr), reinterpret_cast<void*>(addr), &free_any,
                                           c10::Device(c10::DeviceType::CUDA, device));
      }
    }
    for (const auto& [addr, size] : freed) {
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(addr));
      count_free(tally(d, size), static_cast<int64_t>(size));
    }
    for (const auto& [addr, size] : state->blocks) count_alloc(tally(d, size), static_cast<int64_t>(size));
    d.private_live.fetch_add(static_cast<int64_t>(state->blocks.size()) - static_cast<int64_t>(freed.size()),
                             std::memory_order_release);
    return delta;
  }

  // ------------------------------------------------------------------ peers, copies, settings
  // As PyTorch's allocator: `dev` may access `dev_to_access`'s memory (cudaDeviceEnablePeerAccess; already
  // enabled is fine). The pool maps its pages for its own device only: kernels on `dev` reach a pool's
  // pages on `dev_to_access` only through copies (memcpyAsync's peer copy).
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) DEFRAG_CHECKED {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool /*p2p_enabled*/) DEFRAG_CHECKED {
    if (dstDevice == srcDevice) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex /*device*/) DEFRAG_CHECKED {
    return {};
  }

  void enable(bool value) DEFRAG_CHECKED { enabled_ = value; }
  bool isEnabled() const DEFRAG_CHECKED { return enabled_; }

  std::string name() DEFRAG_CHECKED { return "defrag"; }

 private:
  // ------------------------------------------------------------------ allocation
  c10::DataPtr allocate_now(size_t n) {
    const int device = c10::cuda::current_device();
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &free_any, c10::Device(c10::DeviceType::CUDA, device));
    return place(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  c10::DataPtr place(size_t n, int device, cudaStream_t stream) {
    Device& d = device_state(device);
    if (d.capturing.load(std::memory_order_acquire) > 0) {
      c10::DataPtr p = place_private(d, n, device, stream);
      if (p.get() != nullptr) return p;
    }
    void* ptr = nullptr;
    char why[kWhyLength] = "";
    // Frees still waiting for other streams are the pool's: its ladder waits for them before an OOM.
    const int32_t status = g_abi.alloc(device, n, stream, &ptr, why, sizeof why);
    if (status != DEFRAG_POOL_OK) fail(d, device, n, status, why);
    const size_t size = round_up(n, kAlignment);
    count_alloc(tally(d, size), static_cast<int64_t>(size));
    report_to_profiler(device, reinterpret_cast<uintptr_t>(ptr), static_cast<int64_t>(size));
    history_alloc(device, reinterpret_cast<uintptr_t>(ptr), size, stream, MempoolId{0, 0});  // as PyTorch: the block's size
    return c10::DataPtr(ptr, ptr, &free_any, c10::Device(c10::DeviceType::CUDA, device));
  }

  // From the private pool of a capture whose filter takes `stream`; an empty DataPtr when none does.
  c10::DataPtr place_private(Device& d, size_t n, int device, cudaStream_t stream) {
    const size_t size = round_up(n, kAlignment);
    for (int attempt = 0; attempt < 2; ++attempt) {
      MempoolId id{0, 0};
      uintptr_t addr = 0;
      {
        std::lock_guard<std::mutex> guard(d.graphs_mu);
        bool found = false;
        for (auto it = d.captures.rbegin(); it != d.captures.rend() && !found; ++it) {
          if (it->second(stream)) {
            id = it->first;
            found = true;
          }
        }
        if (!found) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CUDA, device));
        PrivatePool& pool = d.pools[id];
        settle_private(d, pool);
        addr = carve(pool, size, stream);
        if (addr != 0) d.private_live.fetch_add(1, std::memory_order_release);
      }
      if (addr != 0) {
        count_alloc(tally(d, size), static_cast<int64_t>(size));
        report_to_profiler(device, addr, static_cast<int64_t>(size));
        history_alloc(device, addr, size, stream, id);
        return c10::DataPtr(reinterpret_cast<void*>(addr), reinterpret_cast<void*>(addr), &free_any,
                            c10::Device(c10::DeviceType::CUDA, device));
      }
      if (attempt == 1) break;
      // A new segment for this private pool: a pool block (pinned, never moved), asked for without any
      // lock of ours (the pool may take the GIL). During a capture the thread may map pages, as
      // PyTorch's own allocator may call cudaMalloc there (relaxed capture mode); the pool's books then
      // query no event and make the capturing stream wait for no event recorded outside the capture
      // (streams.h: the capture was announced by beginAllocateToPool), and nothing synchronizes.
      const size_t segment = size <= kSmallSize    ? kSmallSegment
                             : size < kMediumLimit ? kMediumSegment
                                                   : round_up(size, kSmallSegment);
      void* base = nullptr;
      char why[kWhyLength] = "";
      int32_t status;
      {
        c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
        status = g_abi.alloc(device, segment, stream, &base, why, sizeof why);
      }
      if (status != DEFRAG_POOL_OK) fail(d, device, n, status, why);
      auto seg = std::make_unique<Segment>();
      seg->base = reinterpret_cast<uintptr_t>(base);
      seg->size = segment;
      seg->free.emplace(seg->base, segment);
      std::lock_guard<std::mutex> guard(d.graphs_mu);
      d.pools[id].segments.push_back(std::move(seg));
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "defrag: a graph's private pool could not place ", n, " bytes");
  }

  [[noreturn]] void fail(Device& d, int device, size_t n, int32_t status, const char* why) {
    if (status == DEFRAG_POOL_OUT_OF_MEMORY) {
      d.ooms += 1;
      notify_oom(d, device, n);
      TORCH_CHECK_WITH(OutOfMemoryError, false, why[0] ? why : "defrag: out of memory");
    }
    TORCH_CHECK(false, why[0] ? why : "defrag: the pool could not serve PyTorch's allocation");
    __builtin_unreachable();
  }

  void notify_oom(Device& d, int device, size_t n) {
    size_t device_free = 0, device_total = 0;
    if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
    try {
      trace(cca::TraceEntry::OOM, device, device_free, n, nullptr, MempoolId{0, 0}, gather(false));
    } catch (...) {
    }
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> guard(*g_observers_mu);
      observers = *g_oom_observers;
    }
    const int64_t allocated = d.small.bytes.load() + d.large.bytes.load();
    for (auto& observer : observers) observer(device, static_cast<size_t>(allocated), device_total, device_free);
  }

  // ------------------------------------------------------------------ pieces of the interface
  DefragPoolStats pool_stats(int device, Device& d) {
    DefragPoolStats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    const int32_t status = g_abi.stats(device, &s);
    std::lock_guard<std::mutex> guard(d.stats_mu);
    if (status == DEFRAG_POOL_OK) {
      d.last = s;
    } else {
      TORCH_CHECK(status == DEFRAG_POOL_BUSY, ask_failed(status, "getDeviceStats"));
      s = d.last;  // asked from the pool's own code: what it said last, with this backend's own counts
      s.allocated_bytes = d.small.bytes.load() + d.large.bytes.load();
      s.active_bytes = s.allocated_bytes;
    }
    d.inactive_peak = std::max(d.inactive_peak, s.inactive_split_bytes);
    d.requested_peak = std::max(d.requested_peak, s.requested_bytes);
    return s;
  }

  // PyTorch's emptyCache: for the default id, on every device a pool serves, empty segments of private
  // pools nobody uses and the pool's empty pages (`Pool.trim`, which waits for frees still held for other
  // streams first); for
  // a MemPool's id, that private pool's empty segments.
  void empty_cache(MempoolId id) {
    for (int device = 0; device < kDevices; ++device) {
      Device& d = g_devices[device];
      if (d.snapshot_source == nullptr) continue;  // no pool serves this device
      std::vector<uintptr_t> back;
      {
        std::lock_guard<std::mutex> guard(d.graphs_mu);
        for (auto it = d.pools.begin(); it != d.pools.end();) {
          const bool this_one = it->first == id;
          if (this_one || it->second.use_count == 0) {
            auto empty = take_empty_segments(it->second, !this_one);
            back.insert(back.end(), empty.begin(), empty.end());
          }
          if (it->second.use_count == 0 && it->second.segments.empty()) {
            it = d.pools.erase(it);
          } else {
            ++it;
          }
        }
      }
      for (uintptr_t seg : back) give_back(device, seg);
      if (id != MempoolId{0, 0}) continue;
      // The pool's trim may synchronize: never during a capture (PyTorch's own emptyCache may not run
      // then either), and not at all when no block went back to the pool since the last one (nothing
      // new to give back: `torch.cuda.graph` and some training loops call it every time).
      if (d.capturing.load(std::memory_order_acquire) > 0 || stream_capturing(capture_stream(device))) continue;
      const int64_t frees = d.frees.load(std::memory_order_relaxed);
      {
        std::lock_guard<std::mutex> guard(d.graphs_mu);
        if (frees == d.frees_at_trim) continue;
      }
      const int32_t status = g_abi.empty_cache(device, nullptr);
      TORCH_CHECK(status == DEFRAG_POOL_OK || status == DEFRAG_POOL_BUSY || status == DEFRAG_POOL_NO_POOL,
                  ask_failed(status, "emptyCache"));
      if (status == DEFRAG_POOL_OK) {
        std::lock_guard<std::mutex> guard(d.graphs_mu);
        d.frees_at_trim = frees;
      }
    }
  }

  void incref(c10::DeviceIndex device, MempoolId id, cca::CUDAAllocator* allocator) {
    TORCH_CHECK(allocator == nullptr || allocator == this,
                "defrag: a MemPool with an allocator of its own cannot be used under defrag's allocator (`defrag "
                "run` / defrag.install): every CUDA allocation of this process comes from the pool; make the "
                "MemPool without an allocator");
    Device& d = device_state(device);
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    d.pools[id].use_count += 1;
    d.had_pools.store(true, std::memory_order_release);
  }

  // PyTorch's recordHistory: recording starts or stops; what was recorded stays for the next
  // snapshot unless `clear` (or the ring's size changes).
  void record_history(bool enabled, cca::CreateContextFn recorder, size_t max_entries, cca::RecordContext when,
                      bool clear) {
    History& h = *g_history;
    std::lock_guard<std::mutex> guard(h.mu);
    if (clear || (enabled && max_entries != h.max_entries)) {
      h.traces.clear();
      h.next.clear();
    }
    if (enabled) {
      h.recorder = recorder;
      h.when = when;
      h.max_entries = max_entries;
    } else {
      h.contexts.clear();  // no longer kept up to date: a reused address would show another block's frames
    }
    h.on.store(enabled);
  }

  // The pool's segments and blocks (its `snapshot()`, asked with the GIL) with the frames recorded
  // here, and the traces recorded here.
  cca::SnapshotInfo take_snapshot(bool include_traces) {
    cca::SnapshotInfo info{};
    std::unordered_map<uintptr_t, Context> contexts;
    {
      std::lock_guard<std::mutex> guard(g_history->mu);
      contexts = g_history->contexts;
    }
    for (int device = 0; device < kDevices; ++device) {
      py::object* source = g_devices[device].snapshot_source;
      if (source == nullptr || !Py_IsInitialized()) continue;
      py::gil_scoped_acquire gil;
      py::object taken;
      try {
        taken = (*source)();
      } catch (py::error_already_set& e) {
        TORCH_CHECK(false, "defrag: the pool's snapshot failed: ", e.what());
      }
      for (py::handle seg : taken["segments"]) {
        cca::SegmentInfo s;
        s.device = static_cast<c10::DeviceIndex>(device);
        s.address = seg["address"].cast<size_t>();
        s.total_size = seg["total_size"].cast<size_t>();
        s.allocated_size = seg["allocated_size"].cast<size_t>();
        s.active_size = seg["active_size"].cast<size_t>();
        s.requested_size = seg["requested_size"].cast<size_t>();
        s.is_large = true;
        s.is_expandable = true;  // runs of mapped pages grow and shrink, as expandable segments do
        for (py::handle b : seg["blocks"]) {
          cca::BlockInfo block;
          block.size = b["size"].cast<size_t>();
          block.requested_size = b["requested_size"].cast<size_t>();
          const std::string state = b["state"].cast<std::string>();
          block.allocated = state == "active_allocated";
          block.active = state != "inactive";
          if (block.allocated) {
            auto it = contexts.find(b["address"].cast<uintptr_t>());
            if (it != contexts.end()) block.context_when_allocated = it->second;
          }
          s.blocks.push_back(std::move(block));
        }
        info.segments.push_back(std::move(s));
      }
    }
    if (include_traces) {
      for (int device = 0; device < kDevices; ++device) {
        if (g_devices[device].snapshot_source == nullptr) continue;
        trace(cca::TraceEntry::SNAPSHOT, device, 0, 0, nullptr, MempoolId{0, 0}, nullptr);
      }
      History& h = *g_history;
      std::lock_guard<std::mutex> guard(h.mu);
      info.device_traces.resize(h.traces.size());
      for (size_t device = 0; device < h.traces.size(); ++device) {
        const auto& ring = h.traces[device];
        const size_t start = ring.size() < h.max_entries ? 0 : h.next[device];
        for (size_t i = 0; i < ring.size(); ++i) info.device_traces[device].push_back(ring[(start + i) % ring.size()]);
      }
    }
    return info;
  }

  bool initialized_ = false;
  bool enabled_ = true;
};

static_assert(!std::is_abstract_v<DefragAllocator>,
              "defrag's CUDA allocator backend misses a pure virtual method of this torch's CUDAAllocator "
              "(its interface changed): this torch keeps the pluggable allocator route");

// ------------------------------------------------------------------------------- what reaches us
// Which of PyTorch's non-pure virtual methods, called as PyTorch calls them, reach this backend: on a
// torch whose interface differs they may silently keep the base class's "does not yet support".
template <class A>
auto probe_history(A& a, int) -> decltype(a.isHistoryEnabled(), std::string()) {
  try {
    a.isHistoryEnabled();
    return "served";
  } catch (const std::exception& e) {
    return std::string("NOT served: ") + e.what();
  }
}
template <class A>
std::string probe_history(A&, long) {
  return "absent in this torch";
}

template <class A>
auto probe_use_count(A& a, int) -> decltype(a.getPoolUseCount(c10::DeviceIndex(0), MempoolId{0, 0}), std::string()) {
  try {
    a.getPoolUseCount(0, MempoolId{0, 0});
    return "served";
  } catch (const std::exception& e) {
    return std::string("NOT served: ") + e.what();
  }
}
template <class A>
std::string probe_use_count(A&, long) {
  return "absent in this torch";
}

template <class A>
auto probe_live(A& a, int)
    -> decltype(a.checkPoolLiveAllocations(c10::DeviceIndex(0), MempoolId{0, 0}, std::unordered_set<void*>()),
                std::string()) {
  try {
    a.checkPoolLiveAllocations(0, MempoolId{0, 0}, {});
    return "served";
  } catch (const std::exception& e) {
    return std::string("NOT served: ") + e.what();
  }
}
template <class A>
std::string probe_live(A&, long) {
  return "absent in this torch";
}

template <class A>
auto probe_no_split(A& a, int) -> decltype(a.setNoSplit(c10::DeviceIndex(0), MempoolId{0, 0}), std::string()) {
  try {
    a.setNoSplit(0, MempoolId{0, 0});
    return "served";
  } catch (const std::exception& e) {
    return std::string("NOT served: ") + e.what();
  }
}
template <class A>
std::string probe_no_split(A&, long) {
  return "absent in this torch";
}

py::dict features() {
  DefragAllocator probe;  // a fresh one: the probes change nothing installed
  cca::CUDAAllocator& base = probe;
  py::dict out;
  out["isHistoryEnabled"] = probe_history(base, 0);
  out["getPoolUseCount"] = probe_use_count(base, 0);
  out["checkPoolLiveAllocations"] = probe_live(base, 0);
  out["setNoSplit"] = probe_no_split(base, 0);
  out["name"] = base.name();
  out["torch"] = std::string(TORCH_VERSION);
  out["checked_overrides"] = bool(DEFRAG_TORCH_AT_LEAST(2, 13));
  return out;
}

std::shared_ptr<DefragAllocator>* g_installed = nullptr;  // leaked: PyTorch keeps a raw pointer

// Serve `device`'s snapshots from `snapshot` (the pool's snapshot(), called with the GIL).
void set_snapshot_source(int device, py::object snapshot) {
  Device& d = device_state(device);
  if (d.snapshot_source == nullptr) d.snapshot_source = new py::object(std::move(snapshot));
}

// Make this backend PyTorch's CUDA allocator (before PyTorch's first CUDA allocation; PyTorch's
// RuntimeError otherwise). Idempotent.
void install() {
  TORCH_CHECK(g_attached.load(), "defrag's CUDA allocator backend: attach() first");
  if (g_installed != nullptr) return;
  auto made = std::make_shared<DefragAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(made);
  g_installed = new std::shared_ptr<DefragAllocator>(std::move(made));
}

py::dict counters(int device) {
  Device& d = device_state(device);
  py::dict out;
  out["installed"] = g_installed != nullptr;
  out["small_bytes"] = d.small.bytes.load();
  out["large_bytes"] = d.large.bytes.load();
  out["blocks"] = d.small.blocks.load() + d.large.blocks.load();
  out["ooms"] = d.ooms.load();
  out["retries"] = d.retries.load();
  {
    std::lock_guard<std::mutex> guard(d.graphs_mu);
    out["private_pools"] = d.pools.size();
    size_t segments = 0, blocks = 0;
    for (const auto& [id, pool] : d.pools) {
      segments += pool.segments.size();
      blocks += pool.blocks.size();
    }
    out["private_segments"] = segments;
    out["private_blocks"] = blocks;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "defrag's CUDA allocator backend (a CUDAAllocator over a defrag pool; see the source's header)";
  m.def("attach", &attach, py::arg("native_library"),
        "Find the pool's C ABI in defrag's loaded native module (dlsym); RuntimeError if it cannot.");
  m.def("set_snapshot_source", &set_snapshot_source, py::arg("device"), py::arg("snapshot"));
  m.def("install", &install, "Make this backend PyTorch's CUDA allocator (changeCurrentAllocator).");
  m.def("features", &features, "Which of PyTorch's optional allocator methods reach this backend.");
  m.def("counters", &counters, py::arg("device"));
  m.attr("abi_version") = DEFRAG_POOL_ABI_VERSION;
}
