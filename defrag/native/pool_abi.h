// The pool's C ABI for PyTorch's CUDA allocator backend (`torch_cuda_backend.cpp`, its own extension
// module): what the backend may ask of the pool installed for a CUDA device, and nothing else.
//
// The native module (defrag_native) exports these functions (`pool_abi.cpp`); the backend finds them
// with dlsym in the already-loaded module, checks `defrag_pool_abi_version()`, and calls nothing else
// of the pool natively. The ABI is C: no C++ type, no exception and no ownership crosses it. Fields of
// DefragPoolStats are only ever appended (a caller passes the size it knows), functions are only ever
// added; a change of meaning bumps DEFRAG_POOL_ABI_VERSION.
//
// Threads: every function may be called from any thread, with or without the GIL. Those marked
// "native" take only the books' mutex (no GIL, no Python); those marked "asks the pool" take the GIL
// and call the pool's Python side (never while holding the books' mutex), and answer
// DEFRAG_POOL_BUSY instead when that cannot be done safely now: the calling thread is running the
// pool's own code (inside its gate, or inside a Python call an entry made), Python is exiting, or
// this is a forked child.
//
// Devices: `device` is a CUDA device index; a pool serves it once `defrag.install(pool)` (through
// `defrag.allocator_install.register_native`) registered it, for the life of the process.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define DEFRAG_POOL_ABI_VERSION 2

// Status codes of every int32_t-returning function.
#define DEFRAG_POOL_OK 0
#define DEFRAG_POOL_OUT_OF_MEMORY 1  // the pool cannot serve the request; `why` says what it tried
#define DEFRAG_POOL_ERROR 2          // a bad argument or a pool that cannot serve at all; `why` says which
#define DEFRAG_POOL_NO_POOL 3        // no pool was installed for this device
#define DEFRAG_POOL_BUSY 4           // the answer needs the pool's Python side, which cannot be asked now

// The pool's figures in PyTorch's meaning (`torch.cuda.memory_stats()`), as `Pool.stats()` has them.
// Accumulated counters (num_*) count from the last `defrag_pool_reset_accumulated` on this device.
typedef struct DefragPoolStats {
  int64_t struct_size;             // set by the caller: sizeof(DefragPoolStats) as it knows it
  int64_t allocated_bytes;         // bytes in live blocks (each rounded to 512): allocated_bytes.all.current
  int64_t allocated_bytes_peak;    // its peak since the last reset of peaks
  int64_t active_bytes;            // allocated plus blocks released but waiting for their streams
  int64_t active_bytes_peak;
  int64_t reserved_bytes;          // mapped physical pages x page size (each physical page once)
  int64_t reserved_bytes_peak;
  int64_t requested_bytes;         // the bytes asked for of live blocks (unrounded)
  int64_t inactive_split_bytes;    // free bytes inside pages that hold live data (stranded_bytes)
  int64_t live_blocks;             // live blocks, PyTorch's and the pool's own tensors
  int64_t num_allocs;
  int64_t num_frees;
  int64_t num_alloc_retries;       // allocations that needed the ladder's rescue (compaction, meshing)
  int64_t num_ooms;                // allocations the pool refused
  int64_t num_device_alloc;        // physical pages created
  int64_t num_device_free;         // physical pages released
  int64_t mapped_pages;            // pages.mapped
  int64_t page_size;
  int64_t capacity_bytes;          // the pool's capacity
  int64_t device_total_bytes;      // the device's memory
  int64_t largest_mapped_free;     // the largest block servable without mapping a page (cacheInfo)
} DefragPoolStats;

#ifdef __cplusplus
extern "C" {
#endif

// DEFRAG_POOL_ABI_VERSION of the module that exports these functions. Native.
int32_t defrag_pool_abi_version(void);

// sizeof(DefragPoolStats) as this module knows it (a caller with an older, shorter struct still works).
int64_t defrag_pool_stats_size(void);

// A block of `size` bytes (> 0) for PyTorch on `device`, for `stream` (a cudaStream_t; the books know
// no streams, see the backend). OK: `*out` is its address, pinned in the pool (never moved), counted
// in the pool's statistics; it stays the caller's until `defrag_pool_free`. Otherwise `*out` is NULL,
// nothing was placed or counted, and `why` (a NUL-terminated message, cut to `why_len`; may be NULL)
// says why: OUT_OF_MEMORY (the pool's explained OOM: what it tried), ERROR, NO_POOL. Native unless
// pages must be mapped: then it asks the pool (the ladder, which never compacts here: PyTorch may be
// in the middle of an op). Never throws.
int32_t defrag_pool_alloc(int32_t device, size_t size, void* stream, void** out, char* why, size_t why_len);

// Release the block at `ptr` made by `defrag_pool_alloc` (any device's pool; `device` is where to look
// first). Returns its size as the pool counted it (rounded up to 512) and, if `device_out` is not NULL,
// the device whose pool made it; -1 when no installed pool made a block there (counted and ignored,
// as the pluggable entry's foreign frees are). Native; noexcept; safe at exit after Python is gone.
int64_t defrag_pool_free(int32_t device, void* ptr, int32_t* device_out);

// The pool's figures (see DefragPoolStats), `out->struct_size` set by the caller: fields past it are
// not written. Asks the pool (exact: the pool's own `stats()`, with what the native side did folded in).
int32_t defrag_pool_stats(int32_t device, DefragPoolStats* out);

// Every peak becomes its current value (`Pool.reset_peak_stats()`). Asks the pool.
int32_t defrag_pool_reset_peaks(int32_t device);

// The accumulated counters of `defrag_pool_stats` (num_*) start again from 0 on this device. The
// pool's own counters are not changed (`Pool.stats()` keeps counting since the pool was made). Asks
// the pool.
int32_t defrag_pool_reset_accumulated(int32_t device);

// The largest block the pool can serve without mapping a page: its largest free range in mapped
// pages (PyTorch's `cacheInfo`: cuDNN sizes its benchmark workspaces by it). Asks the pool.
int32_t defrag_pool_largest_block(int32_t device, int64_t* out);

// Give empty pages back to the driver (`Pool.trim()`: unmap pages no block touches, release cached
// physical pages; live tensors never move). `*released` (may be NULL): the bytes given back. Asks
// the pool.
int32_t defrag_pool_empty_cache(int32_t device, int64_t* released);

// The pool's capacity as a fraction of the device's memory. Native once the pool's geometry is known
// (the first call asks the pool).
int32_t defrag_pool_memory_fraction(int32_t device, double* out);

// PyTorch's `set_per_process_memory_fraction(fraction, device)`: the pool's capacity is fixed when it
// is made, so a fraction that leaves room for the whole capacity is accepted (the capacity stays the
// limit) and a smaller one is an ERROR whose `why` says to give `defrag run --capacity` (or
// `Pool(capacity=)`) instead. A fraction outside (0, 1] is an ERROR. Like
// `defrag_pool_memory_fraction`.
int32_t defrag_pool_set_memory_fraction(int32_t device, double fraction, char* why, size_t why_len);

// PyTorch's `recordStream(ptr, stream)`: the block at `ptr` (one `defrag_pool_alloc` handed out) is
// used on `stream` too. Its free then waits, in the pool's books, for an event on `stream` (and on
// every other stream recorded) before its range is reused; a free with none recorded is reusable at
// once on its own stream (defrag/native/streams.h). NO_POOL when no pool of `device` handed `ptr`
// out. Native: the books' mutex, no GIL.
int32_t defrag_pool_record_stream(int32_t device, void* ptr, void* stream);

// PyTorch's `setMemoryFraction(fraction, device)` (`torch.cuda.set_per_process_memory_fraction`), as
// PyTorch's own allocator answers it: the pool's budget becomes `fraction` x the device's memory
// (whole pages, at least one), lower or higher than the capacity it was made with (up to the device).
// Pages held beyond a lower budget that hold nothing are given back at once (`Pool.trim`, no meshing);
// pages that hold live blocks stay (as PyTorch keeps reserved memory), new pages are made only within
// the budget, and each later `defrag_pool_empty_cache` brings the pool down to it. A fraction outside
// (0, 1] is an ERROR (PyTorch's own check). Asks the pool. Then `defrag_pool_memory_fraction` answers the
// fraction set. (`defrag_pool_set_memory_fraction`, ABI 2, keeps its meaning: the capacity stays.)
int32_t defrag_pool_set_budget(int32_t device, double fraction, char* why, size_t why_len);

// A CUDA graph capture on `stream` (a cudaStream_t) begins (`begin` 1) or ends (0): PyTorch's
// beginAllocateToPool / endAllocateToPool. While any is underway the books query no event and a
// capturing stream waits for no event recorded outside its capture (streams.h). Native.
int32_t defrag_pool_capture(int32_t device, void* stream, int32_t begin);

// Calls CUDA forbids during a capture that the fake events of `device`'s books saw (tests; -1 when
// its books use no fake events), and fences that left a producer unordered during a capture.
int32_t defrag_pool_capture_counts(int32_t device, int64_t* violations, int64_t* unordered);

#ifdef __cplusplus
}
#endif
