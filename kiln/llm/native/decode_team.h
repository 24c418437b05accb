// decode_team.h — the decode step's threads: one OpenMP region per step, no barriers inside.
//
// A decode step is ~150 dependent parallel pieces (projections, attention, MLP, head), each
// a few to a few hundred microseconds. One `omp parallel for` per piece ends in a barrier
// that waits for every thread; on a shared machine a descheduled thread then stalls the
// step for a scheduler time slice (measured here under co-tenant load: 9-60 us per empty
// region on average, single regions up to 11 ms). So the step opens one OpenMP region
// (torch's libgomp pool) and synchronises by counting work, never waiting for a thread:
//
//   * thread 0 runs the step; a parallel piece is a Phase of up to 4 Tasks, each split into
//     items. Thread 0 publishes the phase, claims items itself (computing them in place)
//     and continues once every item is done.
//   * the other threads (helpers) wait for a newly published phase, claim items by an
//     atomic counter, compute each into their own scratch and commit it (copy it to the
//     output) only if thread 0 has not taken it back meanwhile. When thread 0 runs out of
//     items and a helper's item is still unfinished after twice the time thread 0's own
//     items took (the helper may have been descheduled), thread 0 steals it (a
//     compare-and-swap on the item's state) and computes it itself; the helper later
//     discards its copy. So a descheduled helper costs at most one item's duplicated
//     work, not a scheduler time slice.
//   * a helper that finds no new phase for ~100 us (thread 0 descheduled, or a long serial
//     stretch) leaves the step: it waits in libgomp's end barrier, so thread 0 never waits
//     to wake a sleeping helper. Phases follow each other within microseconds otherwise.
//
// Everything a stale helper may still read (phases, jobs, activations, weights) lives until
// the region's end, whose barrier is the step's only one. A stale helper may read inputs
// that thread 0 is already overwriting: its result is then discarded, never committed.
#pragma once
#include <immintrin.h>
#include <sched.h>
#include <x86intrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

namespace kdec {

// A parallel loop body over items [0, items). run(ctx, i, nullptr) computes item i into
// the output; run(ctx, i, scratch) into `scratch` (a helper), which commit() then copies.
struct Task {
  int64_t items = 0;
  void (*run)(const void* ctx, int64_t i, float* scratch) = nullptr;
  void (*commit)(const void* ctx, int64_t i, const float* scratch) = nullptr;
  const void* ctx = nullptr;
};

constexpr int64_t kMaxItemsPerTask = 96;
constexpr int kTasksPerPhase = 4;
constexpr int kIdleSpins = 4096;          // pauses (~25 ns each) before a helper leaves
constexpr uint64_t kMinPatience = 20000;  // TSC ticks thread 0 waits at least before stealing

// Item states: claimed by a helper (kFree until it marks it), being computed by it,
// being copied to the output by it, taken back by thread 0, finished.
enum : uint8_t { kFree, kHelping, kCommitting, kStolen, kFinished };

struct alignas(64) Phase {
  Task tasks[kTasksPerPhase];
  int ntasks = 0;
  int64_t total = 0;
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
  std::atomic<uint8_t> state[kTasksPerPhase * kMaxItemsPerTask];
  Phase() {
    for (auto& s : state) s.store(kFree, std::memory_order_relaxed);
  }
  const Task& task(int64_t& i) const {  // the task of item i; i becomes its index there
    int t = 0;
    while (i >= tasks[t].items) i -= tasks[t++].items;
    return tasks[t];
  }
};

class Team {
 public:
  // Room for `max_phases` phases; each helper gets `scratch_floats` floats of scratch.
  Team(int64_t max_phases, int threads, int64_t scratch_floats)
      : phases_(new Phase[max_phases + 1]), max_(max_phases), scratch_floats_(scratch_floats),
        scratch_(static_cast<size_t>(std::max(0, threads - 1) * scratch_floats)) {}

  // Thread 0: run `tasks` on every thread of the region; returns when all items are done.
  void run(std::initializer_list<Task> tasks) {
    if (used_ >= max_) throw std::logic_error("decode step: more phases than planned");
    Phase& ph = phases_[++used_];
    for (const Task& t : tasks) {
      if (t.items <= 0) continue;
      if (t.items > kMaxItemsPerTask) throw std::logic_error("decode step: too many items");
      ph.tasks[ph.ntasks++] = t;
      ph.total += t.items;
    }
    cur_.store(used_, std::memory_order_release);
    const uint64_t start = __rdtsc();
    int64_t mine = 0;
    for (int64_t i; (i = ph.next.fetch_add(1, std::memory_order_relaxed)) < ph.total; ++mine) {
      ph.state[i].store(kFinished, std::memory_order_relaxed);  // ours: never stolen
      int64_t k = i;
      const Task& t = ph.task(k);
      t.run(t.ctx, k, nullptr);
      ph.done.fetch_add(1, std::memory_order_relaxed);
    }
    // Patience: twice thread 0's own time per item (a helper's item takes about as long).
    const uint64_t per_item = mine > 0 ? (__rdtsc() - start) / mine : 0;
    uint64_t deadline = __rdtsc() + std::max(kMinPatience, 2 * per_item);
    while (ph.done.load(std::memory_order_acquire) < ph.total) {
      if (__rdtsc() < deadline) {
        _mm_pause();
      } else if (steal(ph)) {
        deadline = __rdtsc() + std::max(kMinPatience, 2 * per_item);
      } else {
        sched_yield();  // only items being committed remain
      }
    }
  }

  // Thread 0, once at the end of the step: lets the helpers leave.
  void finish() { cur_.store(kDone, std::memory_order_release); }

  // Helper `rank` (1 .. threads - 1): work on each phase published until finish() or idle.
  void help(int rank) {
    float* scratch = scratch_.data() + (rank - 1) * scratch_floats_;
    int64_t seen = 0;
    int spins = 0;
    for (;;) {
      const int64_t p = cur_.load(std::memory_order_acquire);
      if (p == kDone) return;
      if (p != seen) {
        seen = p;
        work(phases_[p], scratch);
        spins = 0;
      } else if (++spins < kIdleSpins) {
        _mm_pause();
      } else {
        return;  // idle: leave the step rather than make thread 0 wake us at its end
      }
    }
  }

 private:
  static constexpr int64_t kDone = -1;

  static void work(Phase& ph, float* scratch) {
    for (int64_t i; (i = ph.next.fetch_add(1, std::memory_order_relaxed)) < ph.total;) {
      uint8_t s = kFree;
      if (!ph.state[i].compare_exchange_strong(s, kHelping)) continue;  // already stolen
      int64_t k = i;
      const Task& t = ph.task(k);
      t.run(t.ctx, k, scratch);
      s = kHelping;
      if (!ph.state[i].compare_exchange_strong(s, kCommitting)) continue;  // stolen: drop
      t.commit(t.ctx, k, scratch);
      ph.state[i].store(kFinished, std::memory_order_relaxed);
      ph.done.fetch_add(1, std::memory_order_release);
    }
  }

  // Thread 0: take back one item a helper claimed but has not committed; false if none.
  static bool steal(Phase& ph) {
    for (int64_t i = 0; i < ph.total; ++i) {
      uint8_t s = ph.state[i].load(std::memory_order_acquire);
      if ((s == kFree || s == kHelping) && ph.state[i].compare_exchange_strong(s, kStolen)) {
        int64_t k = i;
        const Task& t = ph.task(k);
        t.run(t.ctx, k, nullptr);
        ph.done.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
    }
    return false;
  }

  std::unique_ptr<Phase[]> phases_;
  int64_t max_, used_ = 0, scratch_floats_;
  std::vector<float> scratch_;
  alignas(64) std::atomic<int64_t> cur_{0};
};

// Items a loop over `blocks` equal blocks is split into: enough for balance across
// `threads`, few enough that claiming (an atomic shared by the cores) stays negligible.
inline int64_t split_items(int64_t blocks, int threads) {
  const int64_t most = threads > 1 ? std::min<int64_t>(32 * threads, kMaxItemsPerTask) : 1;
  return blocks < most ? blocks : most;
}

}  // namespace kdec
