// GML engine: the row split of the one-row woq_linear GEMVs (decode steps) over a pool of helper threads
// that the caller never waits for unless they took work.
//
// Why not `#pragma omp parallel for`: an OpenMP region ends in a barrier, so the caller waits for every
// thread of the team to arrive — also for a thread the OS has not scheduled yet. A decode step makes
// ~75 such calls (4 per layer + the LM head); on a machine shared with other jobs one of two threads is
// often descheduled, and each call then waits a scheduler time slice for it (measured on a 2-core VM at
// load ~9: 14 ms per 1-2 MB GEMV with 2 OpenMP threads, 0.5 ms with one; docs/llm.md).
//
// Here the work is a ticket counter of chunks (runs of row blocks). The caller publishes the job and
// claims chunks itself from the start; helpers claim chunks when they get to run. The caller then waits
// only for chunks a helper has *claimed* and not finished — a helper that was not scheduled in time
// claims nothing and costs nothing. Idle helpers spin briefly (the next GEMV of a decode step follows
// within tens of µs), then sleep on a condition variable.
//
// Memory ordering. ticket = generation (24 bits) | chunk count (20) | next chunk (20): one atomic word
// says which job a claim is for and whether a chunk is left. The caller writes the job (fn), sets
// done = 0, then stores the ticket of a new generation (release). A helper claims chunk c of
// generation g by a CAS on the ticket (acquire), so it sees that job; it can read the job safely until it
// marks c done (release), because the caller does not return — and so does not publish the next job —
// before done == chunks (acquire). A claim for an old generation fails its CAS. Helpers are detached
// and the pool is never destroyed (no join at process exit).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

#include "woq.h"
#include "woq_int8act.h"

namespace gml_woq {

class HelperPool {
 public:
  // Runs fn(c) for c in [0, chunks) on the caller and up to `helpers` helper threads; returns when all
  // are done. One job at a time (a second caller blocks until the first returns).
  void run(int64_t chunks, int helpers, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> one(run_mutex_);
    grow(helpers);
    if (chunks <= 0) return;
    if (chunks >= kMaxChunks) throw std::invalid_argument("HelperPool: too many chunks");
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (generation(ticket_.load(std::memory_order_relaxed)) + 1) & kGenMask;
    ticket_.store((gen << 40) | (static_cast<uint64_t>(chunks) << 20), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      cv_.notify_all();
    }
    int64_t mine = 0;
    for (int64_t c; (c = claim(gen)) >= 0; ++mine) fn(c);
    int64_t finished = done_.fetch_add(mine, std::memory_order_acq_rel) + mine;
    for (int spins = 0; finished < chunks; ++spins) {  // only chunks a helper claimed are left
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
      finished = done_.load(std::memory_order_acquire);
    }
  }

  static HelperPool& get() {
    static HelperPool* pool = new HelperPool();  // never destroyed: helpers are detached
    return *pool;
  }

 private:
  static constexpr int64_t kMaxChunks = 1 << 20;
  static constexpr uint64_t kGenMask = (1u << 24) - 1;
  static uint64_t generation(uint64_t t) { return t >> 40; }

  // The next unclaimed chunk of generation `gen`, or -1.
  int64_t claim(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (generation(t) == gen && (t & 0xFFFFF) < ((t >> 20) & 0xFFFFF)) {
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return static_cast<int64_t>(t & 0xFFFFF);
    }
    return -1;
  }

  void grow(int helpers) {
    while (static_cast<int>(started_) < helpers) {
      std::thread(&HelperPool::helper, this).detach();
      ++started_;
    }
  }

  void helper() {
    uint64_t seen = 0;  // the last generation this helper looked at
    for (;;) {
      uint64_t gen = generation(ticket_.load(std::memory_order_acquire));
      const auto start = std::chrono::steady_clock::now();
      while (gen == seen) {  // spin ~100 µs for the next job, then sleep
        _mm_pause();
        gen = generation(ticket_.load(std::memory_order_acquire));
        if (gen == seen && std::chrono::steady_clock::now() - start > std::chrono::microseconds(100)) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lock, [&] { return generation(ticket_.load(std::memory_order_seq_cst)) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
          gen = generation(ticket_.load(std::memory_order_acquire));
        }
      }
      seen = gen;
      int64_t mine = 0;
      for (int64_t c; (c = claim(gen)) >= 0; ++mine) (*fn_)(c);  // fn_ is this generation's until done
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;      // the sleepers' condition variable
  std::condition_variable cv_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  unsigned started_ = 0;
};

// Row blocks [0, blocks) split into chunks over the caller and nthreads - 1 helpers (nthreads <= 1: the
// caller alone, no pool).
inline void for_row_blocks(int64_t blocks, int nthreads, const std::function<void(int64_t, int64_t)>& body) {
  if (nthreads <= 1 || blocks < 2) {
    body(0, blocks);
    return;
  }
  // ~8 chunks per thread (a late helper still finds work; a chunk is long enough to amortise its claim)
  int64_t chunk = std::max<int64_t>(1, blocks / (8 * nthreads));
  while ((blocks + chunk - 1) / chunk >= (1 << 20)) chunk *= 2;
  const int64_t chunks = (blocks + chunk - 1) / chunk;
  HelperPool::get().run(chunks, nthreads - 1, [&](int64_t c) { body(c * chunk, std::min(blocks, (c + 1) * chunk)); });
}


// woq.h's `linear` and woq_int8act.h's `linear_act8` (the same row kernels and row blocks) with
// the blocks split by for_row_blocks instead of an OpenMP region: for one-row calls (decode steps).
inline void linear_pooled(const Problem& p, const std::string& isa, int nthreads, int act_bits) {
  check(p, isa);
  const int threads = nthreads > 0 ? nthreads : omp_get_max_threads();
  if (act_bits == 8) {
    const Act8Kernel kern = act8_kernel(isa);
    const Acts a = quantize_acts(p, kern != Act8Kernel::kScalar);
    for_row_blocks((p.N + kAct8Rows - 1) / kAct8Rows, threads, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) act8_block(p, a, blk, kern);  // woq_int8act.h
    });
    return;
  }
  if (act_bits != 0) throw std::invalid_argument("woq_linear: act_bits is 0 (fp32 activations) or 8");
  const int which = fp32_level(isa);
  for_row_blocks((p.N + kRowBlock - 1) / kRowBlock, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) row_block(p, blk, which);  // woq.h's dispatch
  });
}

}  // namespace gml_woq
