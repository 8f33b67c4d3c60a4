// Stream-ordered reuse for the books (`books.h`): the events a release waits on, and the fences that
// order a reuse across streams. PyTorch's caching allocator's rules, over one set of books:
//
// - A block freed on the stream it was allocated on is reusable at once by that stream: the
//   stream's own order keeps its later kernels after the ones that used the block.
// - A block that other streams used (`record_stream`) waits, after its free, for an event on each
//   of those streams (`pending`); its range is free once they all completed.
// - The books have no pool per stream: a range one stream freed may be placed for another stream.
//   That placement first makes the other stream wait (stream-ordered, on the device: no host wait)
//   for an event recorded on every stream that freed ranges into the books since that stream last
//   waited for it (`fence`). A program on one stream never records an event.
//
// - During a CUDA graph capture (stream capture, CUDA's rules): no event query (`done` answers "not
//   yet" while any capture this process announced is underway, as PyTorch's allocator defers its
//   event queries), and a capturing stream never waits for an event recorded outside its capture: the
//   fence of a capturing stream waits only for producers that capture too; the others are left for
//   its first fence after the capture (`Captures::unordered`). Nothing here synchronizes. What makes
//   that safe is what PyTorch's `torch.cuda.graph` does: it synchronizes the device before the
//   capture begins, so every range freed before it is done on the device.
//
// `EventOps` is how the books record, query and wait on events: the CUDA driver's (libcuda, found
// with dlsym; no CUDA headers or runtime needed: the module is built once for CPU and GPU torch
// alike), or a fake that tests drive on a machine without a GPU. No ops (the emulated and memory-less
// devices): the device is always done, every release is immediate and no fence is needed.
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace defrag_native {

// CUDA graph captures this process announced (PyTorch's beginAllocateToPool / endAllocateToPool,
// through the pool ABI's `defrag_pool_capture`): how many are underway, and the streams capturing.
// While any is underway no event is queried (PyTorch's allocator defers its event queries the same way).
class Captures {
 public:
  void begin(uintptr_t stream) {
    std::lock_guard<std::mutex> guard(mu_);
    streams_.push_back(stream);
    underway_.fetch_add(1, std::memory_order_release);
  }
  void end(uintptr_t stream) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = std::find(streams_.begin(), streams_.end(), stream);
    if (it == streams_.end()) return;
    streams_.erase(it);
    underway_.fetch_sub(1, std::memory_order_release);
  }
  bool underway() const noexcept { return underway_.load(std::memory_order_acquire) > 0; }
  // A fence left a producer unordered for a capturing stream (see StreamFences::fence).
  void unordered() noexcept { unordered_.fetch_add(1, std::memory_order_relaxed); }
  int64_t unordered_count() const noexcept { return unordered_.load(std::memory_order_relaxed); }
  bool announced(uintptr_t stream) {
    if (!underway()) return false;
    std::lock_guard<std::mutex> guard(mu_);
    return std::find(streams_.begin(), streams_.end(), stream) != streams_.end();
  }

 private:
  std::mutex mu_;
  std::vector<uintptr_t> streams_;
  std::atomic<int> underway_{0};
  std::atomic<int64_t> unordered_{0};
};

inline Captures& captures() {
  static Captures* const all = new Captures();  // leaked: frees may run at exit
  return *all;
}

class EventOps {
 public:
  virtual ~EventOps() = default;
  // An event recorded on `stream` now, or nullptr when it could not be (the caller then treats the
  // work as unfinished until the device is synchronized).
  virtual void* record(uintptr_t stream) noexcept = 0;
  // Whether the work before `event` has finished.
  virtual bool done(void* event) noexcept = 0;
  // `stream` waits (on the device) for `event`; false when it could not be made to.
  virtual bool wait(uintptr_t stream, void* event) noexcept = 0;
  virtual void destroy(void* event) noexcept = 0;
  // Whether `stream` is capturing a CUDA graph now (an error answers true: nothing that capture
  // forbids is tried on a stream whose state is unknown).
  virtual bool capturing(uintptr_t stream) noexcept { return captures().announced(stream); }
};

// The CUDA driver's events, through libcuda's C entry points (the process has libcuda loaded: torch
// and cuda-python use it). The calling thread needs a current context; where it has none the
// device's primary context (`context`) is made current first.
class CudaEventOps final : public EventOps {
 public:
  explicit CudaEventOps(uintptr_t context) : context_(reinterpret_cast<void*>(context)) {
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (lib == nullptr) throw std::runtime_error("stream events need libcuda.so.1, which cannot be loaded");
    auto find = [&](const char* name) {
      void* f = dlsym(lib, name);
      if (f == nullptr) throw std::runtime_error(std::string("libcuda has no ") + name);
      return f;
    };
    create_ = reinterpret_cast<int (*)(void**, unsigned)>(find("cuEventCreate"));
    record_ = reinterpret_cast<int (*)(void*, void*)>(find("cuEventRecord"));
    query_ = reinterpret_cast<int (*)(void*)>(find("cuEventQuery"));
    destroy_ = reinterpret_cast<int (*)(void*)>(find("cuEventDestroy_v2"));
    wait_ = reinterpret_cast<int (*)(void*, void*, unsigned)>(find("cuStreamWaitEvent"));
    get_current_ = reinterpret_cast<int (*)(void**)>(find("cuCtxGetCurrent"));
    set_current_ = reinterpret_cast<int (*)(void*)>(find("cuCtxSetCurrent"));
    is_capturing_ = reinterpret_cast<int (*)(void*, int*)>(find("cuStreamIsCapturing"));
  }

  void* record(uintptr_t stream) noexcept override {
    if (!has_context()) return nullptr;
    void* event = nullptr;
    if (create_(&event, kDisableTiming) != 0) return nullptr;
    if (record_(event, reinterpret_cast<void*>(stream)) != 0) {
      destroy_(event);
      return nullptr;
    }
    return event;
  }

  bool done(void* event) noexcept override {
    if (captures().underway()) return false;  // no query during a capture: asked again after it
    if (!has_context()) return false;
    return query_(event) == 0;  // CUDA_SUCCESS; CUDA_ERROR_NOT_READY (600) otherwise
  }

  bool capturing(uintptr_t stream) noexcept override {
    if (captures().announced(stream)) return true;
    if (!has_context()) return true;
    int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
    if (is_capturing_(reinterpret_cast<void*>(stream), &status) != 0) return true;
    return status != 0;  // ACTIVE or INVALIDATED
  }

  bool wait(uintptr_t stream, void* event) noexcept override {
    return has_context() && wait_(reinterpret_cast<void*>(stream), event, 0) == 0;
  }

  void destroy(void* event) noexcept override {
    if (has_context()) destroy_(event);  // legal while a stream still waits for it
  }

 private:
  static constexpr unsigned kDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING

  bool has_context() noexcept {
    void* current = nullptr;
    if (get_current_(&current) != 0) return false;
    if (current != nullptr) return true;
    return context_ != nullptr && set_current_(context_) == 0;
  }

  void* context_;
  int (*create_)(void**, unsigned) = nullptr;
  int (*record_)(void*, void*) = nullptr;
  int (*query_)(void*) = nullptr;
  int (*destroy_)(void*) = nullptr;
  int (*wait_)(void*, void*, unsigned) = nullptr;
  int (*get_current_)(void**) = nullptr;
  int (*set_current_)(void*) = nullptr;
  int (*is_capturing_)(void*, int*) = nullptr;
};

// Events a test drives (no GPU): an event recorded on a stream completes once the test says that
// stream has finished everything recorded on it so far (`finish`). Every wait is logged as
// (waiting stream, stream waited for).
class FakeEventOps final : public EventOps {
 public:
  void* record(uintptr_t stream) noexcept override {
    const bool in_capture = capturing(stream);
    std::lock_guard<std::mutex> guard(mu_);
    auto* e = new (std::nothrow) Event{stream, ++serial_[stream], in_capture};
    if (e != nullptr) recorded_ += 1;
    return e;
  }
  bool done(void* event) noexcept override {
    const bool forbidden = captures().underway();
    std::lock_guard<std::mutex> guard(mu_);
    if (forbidden) {  // CUDA: an event query while a capture is underway (global mode) fails it
      capture_violations_ += 1;
      return false;
    }
    auto* e = static_cast<Event*>(event);
    return finished_[e->stream] >= e->serial;
  }
  bool wait(uintptr_t stream, void* event) noexcept override {
    const bool waiter_captures = capturing(stream);
    std::lock_guard<std::mutex> guard(mu_);
    if (waiter_captures && !static_cast<Event*>(event)->in_capture) {
      capture_violations_ += 1;  // CUDA: a capturing stream waits for an event recorded outside it
      return false;
    }
    try {
      waits_.emplace_back(stream, static_cast<Event*>(event)->stream);
    } catch (...) {
      return false;
    }
    return true;
  }
  void destroy(void* event) noexcept override {
    std::lock_guard<std::mutex> guard(mu_);
    delete static_cast<Event*>(event);
    destroyed_ += 1;
  }

  // Everything recorded on `stream` so far has finished.
  void finish(uintptr_t stream) {
    std::lock_guard<std::mutex> guard(mu_);
    finished_[stream] = serial_[stream];
  }
  int64_t recorded() {
    std::lock_guard<std::mutex> guard(mu_);
    return recorded_;
  }
  int64_t destroyed() {
    std::lock_guard<std::mutex> guard(mu_);
    return destroyed_;
  }
  std::vector<std::pair<uintptr_t, uintptr_t>> waits() {
    std::lock_guard<std::mutex> guard(mu_);
    return waits_;
  }
  // Calls CUDA forbids during a capture that were tried (each would have failed the capture).
  int64_t capture_violations() {
    std::lock_guard<std::mutex> guard(mu_);
    return capture_violations_;
  }

 private:
  struct Event {
    uintptr_t stream;
    int64_t serial;
    bool in_capture;  // recorded on a capturing stream
  };
  std::mutex mu_;
  std::map<uintptr_t, int64_t> serial_, finished_;
  std::vector<std::pair<uintptr_t, uintptr_t>> waits_;
  int64_t recorded_ = 0, destroyed_ = 0, capture_violations_ = 0;
};

// Which streams freed ranges into the books since each other stream last waited for them.
class StreamFences {
 public:
  // `stream` freed a range into the books just now.
  void freed(uintptr_t stream) { epoch_[stream] += 1; }

  // Before placing for `stream`: make it wait for every other stream that freed ranges since it last
  // waited for that stream (an event there, a wait here). False when an event or wait failed (the
  // caller then treats the books' free ranges as unsafe for `stream` until a synchronize).
  // While `stream` captures a CUDA graph it waits only for producers that capture too (an event
  // recorded outside its capture cannot be waited for there); the others stay unseen, fenced at its
  // first placement after the capture, and are counted (`Captures::unordered`). Never false then:
  // false makes the caller synchronize, which a capture forbids.
  bool fence(EventOps& ops, uintptr_t stream) noexcept {
    bool ok = true;
    int capture = -1;  // whether `stream` captures: asked once, when a wait is needed
    for (auto& [producer, epoch] : epoch_) {
      if (producer == stream) continue;
      int64_t& seen = seen_[{stream, producer}];
      seen = std::max(seen, safe_[producer]);
      if (seen >= epoch) continue;
      if (capture < 0) capture = ops.capturing(stream) ? 1 : 0;
      if (capture == 1 && !ops.capturing(producer)) {
        captures().unordered();
        continue;
      }
      void* event = ops.record(producer);
      if (event == nullptr || !ops.wait(stream, event)) ok = false;
      if (event != nullptr) ops.destroy(event);
      if (ok) seen = epoch;
    }
    return ok || capture == 1;
  }


  // The device was synchronized: every stream's frees are done for everyone.
  void synchronized() {
    for (auto& [producer, epoch] : epoch_) safe_[producer] = epoch;
  }

 private:
  std::map<uintptr_t, int64_t> epoch_;  // frees into the books, per stream, ever
  std::map<uintptr_t, int64_t> safe_;   // per stream: the epoch the last device synchronize covered
  std::map<std::pair<uintptr_t, uintptr_t>, int64_t> seen_;
};

}  // namespace defrag_native
