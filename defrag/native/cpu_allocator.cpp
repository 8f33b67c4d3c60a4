// PyTorch's CPU allocator over one pool's books (`defrag.install(pool)` on the emulated device, whose
// pool pages are host memory): every CPU tensor the program makes afterwards lives in the pool.
// Compiled in the same unit as module.cpp, after `pool_allocator.h` (the placement ladder, install
// records and release it shares with the CUDA entry points, `cuda_allocator.cpp`).
//
// Hot path (`allocate`, `free_pooled`): no Python, no GIL, no syscall; the books' mutex once each
// way (`place_from_pool`, `release_installed`). When the pool cannot serve a request, the pool's
// explained OOM becomes c10::OutOfMemoryError, which reaches Python as torch.OutOfMemoryError (thrown
// before any counter changed: the program may catch it and go on).
//
// Invariants:
// - An allocation goes to the allocator that was current before install ("previous") when the
//   calling thread runs the pool's own code (inside a pool's gate: `books_held_here`; or inside the
//   Python call this allocator makes: `t_pool_code`): never a recursion into the pool, never a
//   deadlock on its gate. Also when the pool does not serve the allocator (asleep, closed),
//   when the pool declines (see `place_from_pool`: a worker of a parallel region that cannot place
//   natively), during interpreter finalization, and in a forked child. Any other thread waits for
//   the pool's answer.
// - A DataPtr's context is its data pointer (torch's copy-on-write and lazy clones require it); the
//   deleter finds the slot by address in the installs' `by_address` maps.
// - Install records live forever (pool_allocator.h); the allocator object itself is never destroyed
//   either (PyTorch keeps its pointer). The deleter is noexcept and touches only them.
// - fork: the child switches PyTorch back to the previous allocator (`cpu_allocator_after_fork`) and
//   its deleter forgets blocks it inherited (pool_allocator.h).
#include <c10/core/CPUAllocator.h>

namespace {

constexpr uint8_t kAllocatorPriority = 0;  // the default allocator's: SetCPUAllocator replaces on >=

std::atomic<Installed*> g_current{nullptr};  // the pool allocations go to; nullptr: none
std::atomic<c10::Allocator*> g_previous{nullptr};
EntryCounters g_cpu_counters;

void free_pooled(void* data) noexcept;

class PoolCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &free_pooled; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static c10::DataPtr previous_allocate(size_t n);
  static c10::DataPtr from_pool(Installed* in, int64_t nbytes);
};

PoolCpuAllocator* const g_allocator = new PoolCpuAllocator();  // leaked: PyTorch may call it at exit

c10::DataPtr PoolCpuAllocator::previous_allocate(size_t n) {
  c10::Allocator* previous = g_previous.load(std::memory_order_acquire);
  if (previous == nullptr) previous = c10::GetDefaultCPUAllocator();
  return previous->allocate(n);
}

c10::DataPtr PoolCpuAllocator::allocate(size_t n) {
  Installed* in = g_current.load(std::memory_order_acquire);
  if (in == nullptr || t_pool_code > 0 || defrag_native::books_held_here > 0 ||
      g_forked_child.load(std::memory_order_relaxed) || !in->fast->serves_allocator.load(std::memory_order_relaxed)) {
    return previous_allocate(n);
  }
  if (n == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));  // nothing to place or free
  note_allocating_thread();
  if (n > static_cast<size_t>(kLargestRequest)) {
    g_cpu_counters.ooms += 1;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "defrag: PyTorch asked the pool for ", n,
                     " bytes, more than any pool can hold");
  }
  return from_pool(in, static_cast<int64_t>(n));
}

c10::DataPtr PoolCpuAllocator::from_pool(Installed* in, int64_t nbytes) {
  Placement placed = place_from_pool(in, g_current, nbytes, /*stream=*/0, /*may_ask=*/true, g_cpu_counters);
  if (placed.address != 0) {
    void* data = reinterpret_cast<void*>(placed.address);
    return c10::DataPtr(data, data, &free_pooled, c10::Device(c10::DeviceType::CPU));
  }
  if (placed.answer == Answer::kRefused) TORCH_CHECK_WITH(OutOfMemoryError, false, placed.refusal);
  return previous_allocate(static_cast<size_t>(nbytes));
}

// The deleter of every DataPtr this allocator made (and its raw_deleter): any thread, any time.
void free_pooled(void* data) noexcept {
  if (data == nullptr) return;
  // A block inherited from the parent: the pool and its pages are the parent's. Forgotten (the
  // child's copy of the books is never used again); likewise a raw allocation made before the fork.
  if (g_forked_child.load(std::memory_order_relaxed)) return;
  // The installed pool's block, or one of an earlier install (uninstalled since).
  if (release_installed(g_current.load(std::memory_order_acquire), reinterpret_cast<uintptr_t>(data))) return;
  // Not a pool block: the previous allocator's, handed out through our raw_allocate (`allocate`
  // declined); its DataPtr's context was its data pointer, so its raw deleter frees it.
  c10::Allocator* previous = g_previous.load(std::memory_order_acquire);
  if (previous != nullptr) {
    c10::DeleterFnPtr deleter = previous->raw_deleter();
    if (deleter != nullptr) deleter(data);
  }
}

// In the child right after fork() (pool_allocator.h's handler): PyTorch's previous allocator for
// everything from now on.
void cpu_allocator_after_fork() noexcept {
  Installed* in = g_current.load();
  if (in != nullptr) c10::SetCPUAllocator(in->previous, kAllocatorPriority);
}

// Make this pool PyTorch's CPU allocator (with the GIL). The caller checked the pool is open.
void install(py::object fast_object) {
  if (g_forked_child.load())
    throw std::runtime_error("defrag.install: this process is a fork of one that installed a pool; "
                             "a forked child uses PyTorch's own allocator");
  if (g_current.load() != nullptr) throw std::runtime_error("defrag.install: a pool is installed already");
  Installed* in = record_for(fast_object);
  c10::Allocator* previous = c10::GetCPUAllocator();
  if (previous == g_allocator) throw std::runtime_error("defrag.install: defrag's CPU allocator is current already");
  ensure_fork_handler();
  in->fast->take_lease();
  in->previous = previous;
  g_previous.store(previous, std::memory_order_release);
  g_current.store(in, std::memory_order_release);
  c10::SetCPUAllocator(g_allocator, kAllocatorPriority);
  if (c10::GetCPUAllocator() != g_allocator) {  // someone set one with a higher priority
    g_current.store(nullptr);
    in->fast->drop_lease();
    throw std::runtime_error("defrag.install: PyTorch kept its current CPU allocator (set with a higher priority "
                             "than the default's)");
  }
}

// PyTorch's previous CPU allocator again (with the GIL); false when none was installed. Blocks made
// meanwhile stay valid and go back to their pool when freed.
bool uninstall() {
  Installed* in = g_current.load();
  if (in == nullptr) return false;
  if (!g_forked_child.load()) c10::SetCPUAllocator(in->previous, kAllocatorPriority);
  g_current.store(nullptr, std::memory_order_release);
  if (!g_forked_child.load()) in->fast->drop_lease();  // a child leaves the parent's pool alone
  return true;
}

py::dict counters() {
  py::dict out;
  Installed* in = g_current.load();
  out["installed"] = in != nullptr && !g_forked_child.load();
  out["current"] = c10::GetCPUAllocator() == g_allocator;
  out["forked_child"] = g_forked_child.load();
  out["declined"] = g_cpu_counters.declined.load();
  out["asked"] = g_cpu_counters.asked.load();
  out["ooms"] = g_cpu_counters.ooms.load();
  out["blocks"] = in != nullptr ? in->fast->allocator_blocks.load() : 0;
  return out;
}

// Whether `tensor`'s memory was made by this allocator (its DataPtr's deleter is ours).
bool made_here(const at::Tensor& tensor) {
  return tensor.storage().data_ptr().get_deleter() == &free_pooled;
}

void bind_cpu_allocator(py::module_& m) {
  g_allocator_deleter.store(&free_pooled, std::memory_order_release);
  m.def("install_cpu_allocator", &install, py::arg("fast_path"),
        "Make the pool of this FastPath PyTorch's CPU allocator (see cpu_allocator.cpp).");
  m.def("uninstall_cpu_allocator", &uninstall, "PyTorch's previous CPU allocator again; False when none was installed.");
  m.def("cpu_allocator_counters", &counters);
  m.def("cpu_allocator_made", &made_here, py::arg("tensor"));
}

}  // namespace
