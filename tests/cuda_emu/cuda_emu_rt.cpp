// cuda_emu_rt.cpp: the emulator behind cuda_emu.h. A CTA is run as cooperative fibers, one per
// thread, switched at every barrier and collective (x86-64 only), one warpgroup at a time
// favoured for a while so that warpgroups drift apart; blocks run one at a time in random
// order; shared memory starts as NaN bytes; warp collectives (shuffles, ldmatrix,
// stmatrix, mma.sync) and warpgroup wgmma (descriptor decoded, 128-byte swizzle applied to the
// address bits, products in fp64; executed asynchronously, at a commit or at the wait that
// retires them) meet all their threads first; cp.async copies land at their commit or at
// the wait_group that needs them (at random) and are checked against the registered input
// buffers; mbarriers keep phases;
// setmaxnreg moves registers between a warpgroup and the CTA's pool (blocking inc).
#include "cuda_emu.h"
#include <cstdarg>
#include <functional>
#include <map>
#include <random>
#include <vector>

extern "C" void emu_switch(void **save_sp, void *new_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");

namespace emu {
struct Barrier {
  int count = 0;
  long gen = 0;
};
struct Copy {
  uint32_t dst;
  const void *src;
  int bytes;
  bool valid;
};
struct Fiber {
  int tid;
  void *sp;
  bool done;
  Barrier *wait_on;
  long wait_gen;
  std::vector<std::vector<Copy>> groups;
  std::vector<Copy> open;
  Dim3 t3;
  char *stack;
};
struct Warp {
  Barrier bar;
  uint32_t addr[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
  float c[32][4];
  float f[32];
};
struct Buf {
  const char *p;
  size_t n;
};

static const int kStack = 256 * 1024;
static Fiber fibers[512];
static Fiber *g_cur;
static void *sched_sp;
static Barrier cta_bar;
static Warp warps[16];
/* One issued wgmma of a warpgroup: each thread's accumulator array and A fragment (nullptr:
 * A from shared memory through adesc), read and written when the product executes. */
struct WgOp {
  float *d[128];
  const uint32_t *a[128];
  uint64_t desc, adesc;
  int N, tnsp, tnsp_a;
  bool bf16;
};
struct WGrp {
  Barrier bar;
  float *d[128];
  const uint32_t *a[128];
  uint64_t desc[128], adesc[128];
  int n[128];
  std::vector<WgOp> open;                /* issued since the last commit */
  std::vector<std::vector<WgOp>> groups; /* committed, not yet executed (oldest first) */
};
static WGrp wgrps[4];
static std::vector<unsigned char> g_smem;
static uint32_t g_smem_size;
Dim3 g_grid, g_block;
static Dim3 g_bid;
static std::mt19937_64 rng(12345);
static std::function<void()> g_kernel;
static std::vector<Buf> g_bufs;
long g_switches = 0;
long g_spins = 0;

void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "EMU FAIL (block %u thread %d): ", g_bid.x, g_cur ? g_cur->tid : -1);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  fflush(stderr);
  abort();
}
Fiber *cur() { return g_cur; }
const Dim3 &tid3() { return g_cur->t3; }
const Dim3 &bid3() { return g_bid; }
unsigned char *smem_base() { return g_smem.data(); }
uint32_t smem_size() { return g_smem_size; }
void register_buffer(const void *p, size_t n) { g_bufs.push_back({(const char *)p, n}); }
void clear_buffers() { g_bufs.clear(); }

static void yield() {
  ++g_switches;
  emu_switch(&g_cur->sp, sched_sp);
}
static void barrier_wait(Barrier &b, int n) {
  long g = b.gen;
  if (++b.count == n) {
    b.count = 0;
    b.gen++;
    if (rng() & 1) yield();
  } else {
    g_cur->wait_on = &b;
    g_cur->wait_gen = g;
    yield();
    g_cur->wait_on = nullptr;
  }
}
static int g_nt = 128;
void syncthreads() { barrier_wait(cta_bar, g_nt); }
static Warp &mywarp() { return warps[g_cur->tid >> 5]; }
float shfl(float v, int s, bool x) {
  Warp &w = mywarp();
  int lane = g_cur->tid & 31;
  w.f[lane] = v;
  barrier_wait(w.bar, 32);
  float r = w.f[(x ? (lane ^ s) : s) & 31];
  barrier_wait(w.bar, 32);
  return r;
}
void ldsm(uint32_t addr, uint32_t *r, bool trans) {
  Warp &w = mywarp();
  int lane = g_cur->tid & 31;
  if (addr % 16 || addr + 16 > g_smem_size)
    fail("ldmatrix address %u (smem %u)", addr, g_smem_size);
  w.addr[lane] = addr;
  barrier_wait(w.bar, 32);
  const unsigned char *s = g_smem.data();
  for (int i = 0; i < 4; ++i) {
    if (!trans) {
      memcpy(&r[i], s + w.addr[8 * i + lane / 4] + 4 * (lane % 4), 4);
    } else {
      uint16_t lo, hi;
      int r0 = 2 * (lane % 4), col = lane / 4;
      memcpy(&lo, s + w.addr[8 * i + r0] + 2 * col, 2);
      memcpy(&hi, s + w.addr[8 * i + r0 + 1] + 2 * col, 2);
      r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
  }
  barrier_wait(w.bar, 32);
}
void stsm(uint32_t addr, const uint32_t *r) {
  Warp &w = mywarp();
  int lane = g_cur->tid & 31;
  if (addr % 16 || addr + 16 > g_smem_size)
    fail("stmatrix address %u (smem %u)", addr, g_smem_size);
  w.addr[lane] = addr;
  for (int i = 0; i < 4; ++i) w.a[lane][i] = r[i];
  barrier_wait(w.bar, 32);
  if (lane == 0) {
    unsigned char *s = g_smem.data();
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) memcpy(s + w.addr[8 * i + l / 4] + 4 * (l % 4), &w.a[l][i], 4);
  }
  barrier_wait(w.bar, 32);
}
int any(int pred) {
  Warp &w = mywarp();
  int lane = g_cur->tid & 31;
  w.f[lane] = pred ? 1.f : 0.f;
  barrier_wait(w.bar, 32);
  int r = 0;
  for (int l = 0; l < 32; ++l) r |= w.f[l] != 0.f;
  barrier_wait(w.bar, 32);
  return r;
}
static std::vector<std::pair<float *, size_t>> g_red_bufs;
void red_region(float *p, size_t n) { g_red_bufs.push_back({p, n}); }
void red_add(float *p, float v) {
  bool in = g_red_bufs.empty();
  for (auto &b : g_red_bufs)
    if (p >= b.first && p < b.first + b.second) in = true;
  if (!in) fail("red.global.add outside the dQ buffer");
  *p += v;
}
static float h2f(uint32_t reg, int half, bool bf16);
static float h2f_(uint32_t reg, int half, bool bf16) {
  uint16_t u = (uint16_t)(reg >> (16 * half));
  if (bf16) {
    uint32_t x = (uint32_t)u << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
  }
  __half_raw hr;
  hr.x = u;
  return __half2float(__half(hr));
}
void mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1, bool bf16) {
  Warp &w = mywarp();
  int lane = g_cur->tid & 31;
  for (int i = 0; i < 4; ++i) {
    w.a[lane][i] = a[i];
    w.c[lane][i] = c[i];
  }
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  barrier_wait(w.bar, 32);
  const int g = lane / 4, t = lane % 4;
  float out[4];
  for (int j = 0; j < 4; ++j) {
    const int row = g + 8 * (j >> 1), col = 2 * t + (j & 1);
    double sum = w.c[lane][j];
    for (int k = 0; k < 16; ++k) {
      const int la = (row % 8) * 4 + (k % 8) / 2, ra = (row / 8) + 2 * (k / 8);
      const int lb = col * 4 + (k % 8) / 2, rb = k / 8;
      sum += (double)h2f(w.a[la][ra], k % 2, bf16) * (double)h2f(w.b[lb][rb], k % 2, bf16);
    }
    out[j] = (float)sum;
  }
  barrier_wait(w.bar, 32);
  for (int j = 0; j < 4; ++j) c[j] = out[j];
}

static float h2f(uint32_t reg, int half, bool bf16) { return h2f_(reg, half, bf16); }
static float smem16(uint32_t addr, bool bf16) {
  addr ^= ((addr >> 7) & 7u) << 4; /* 128-byte swizzle on the address bits */
  if (addr + 2 > g_smem_size) fail("wgmma reads shared byte %u (smem %u)", addr, g_smem_size);
  uint16_t u;
  memcpy(&u, g_smem.data() + addr, 2);
  return h2f(u, 0, bf16);
}
/* The element (m, k) or (k, n) of an operand in shared memory through a 128-byte-swizzle
 * descriptor: K-major (tnsp 0): row m (or n), 8-row groups SBO apart, k contiguous; MN-major
 * (tnsp 1): row k, 8-row groups SBO apart, 64-column panels LBO apart. */
static uint32_t desc_addr(uint64_t desc, int mn, int k, int tnsp) {
  if ((desc >> 62) != 1) fail("wgmma descriptor without the 128-byte swizzle");
  if ((desc >> 49) & 7) fail("wgmma base offset");
  const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4,
                 lbo = (uint32_t)((desc >> 16) & 0x3FFF) << 4,
                 sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
  if (tnsp == 0) {
    if ((start & 127) + 32 > 128) fail("K-major slice crosses a 128-byte row");
    return start + (mn / 8) * sbo + (mn % 8) * 128 + k * 2;
  }
  if (start & 127) fail("MN-major operand not at the start of a 128-byte row");
  return start + (mn / 64) * lbo + (mn % 64) * 2 + (k / 8) * sbo + (k % 8) * 128;
}
/* D[64 x N] += A[64 x 16] B[16 x N] of one issued wgmma, for every thread of its warpgroup:
 * the accumulators and A fragments read through the threads' pointers now, the products in
 * fp64, the results written back. */
static void wgmma_exec(const WgOp &op) {
  for (int lt = 0; lt < 128; ++lt) {
    const int wq = lt >> 5, lane = lt & 31, g = lane >> 2, t4 = lane & 3;
    float *d = op.d[lt];
    for (int x = 0; x < op.N / 2; ++x) {
      const int j = x >> 2, e = x & 3;
      const int row = 16 * wq + g + 8 * (e >> 1), col = 8 * j + 2 * t4 + (e & 1);
      double sum = d[x];
      for (int k = 0; k < 16; ++k) {
        double av;
        if (op.a[lt]) {
          const int r16 = row & 15;
          const int la = (r16 % 8) * 4 + (k % 8) / 2, ra = (r16 / 8) + 2 * (k / 8);
          av = h2f(op.a[wq * 32 + la][ra], k % 2, op.bf16);
        } else {
          av = smem16(desc_addr(op.adesc, row, k, op.tnsp_a), op.bf16);
        }
        sum += av * (double)smem16(desc_addr(op.desc, col, k, op.tnsp), op.bf16);
      }
      d[x] = (float)sum;
    }
  }
}
/* Issues D[64 x N] += A[64 x 16] B[16 x N] for the calling thread's warpgroup: A from the
 * threads' registers (a != nullptr) or through the descriptor adesc (M-major when tnsp_a).
 * Every thread of the warpgroup must pass the same descriptors and shape. Asynchronous like
 * the hardware's: the product executes (reads the accumulators, the A registers and shared
 * memory, writes the accumulators) at a commit or at the wait_group that retires its group,
 * at random, so that a kernel that touches its operands or accumulators, or releases the
 * shared memory it reads, before the wait sees wrong values. */
static void wgmma_any(float *d, const uint32_t *a, uint64_t adesc, int tnsp_a, uint64_t desc, int N,
                      int tnsp, bool bf16) {
  const int t = g_cur->tid, lt = t & 127;
  if ((t >> 7) >= 4 || (t | 127) >= g_nt) fail("wgmma by thread %d of a CTA of %d", t, g_nt);
  WGrp &w = wgrps[t >> 7];
  w.d[lt] = d;
  w.a[lt] = a;
  w.desc[lt] = desc;
  w.adesc[lt] = a ? 0 : adesc;
  w.n[lt] = N * 4 + tnsp * 2 + tnsp_a;
  barrier_wait(w.bar, 128);
  if (lt == 0) {
    for (int i = 0; i < 128; ++i)
      if (w.desc[i] != desc || w.n[i] != w.n[lt] || w.adesc[i] != w.adesc[lt] || !w.a[i] != !a)
        fail("wgmma operands differ across the warpgroup");
    WgOp op;
    for (int i = 0; i < 128; ++i) {
      op.d[i] = w.d[i];
      op.a[i] = w.a[i];
    }
    op.desc = desc;
    op.adesc = a ? 0 : adesc;
    op.N = N;
    op.tnsp = tnsp;
    op.tnsp_a = tnsp_a;
    op.bf16 = bf16;
    w.open.push_back(op);
  }
  barrier_wait(w.bar, 128);
}
/* Executes the warpgroup's committed groups, oldest first, until at most `keep` are pending. */
static void wgmma_retire(WGrp &w, size_t keep) {
  while (w.groups.size() > keep) {
    for (const WgOp &op : w.groups.front()) wgmma_exec(op);
    w.groups.erase(w.groups.begin());
  }
}
static WGrp &wgmma_group_of_caller(const char *what) {
  const int t = g_cur->tid;
  if ((t >> 7) >= 4 || (t | 127) >= g_nt) fail("%s by thread %d of a CTA of %d", what, t, g_nt);
  return wgrps[t >> 7];
}
void wgmma_commit() {
  WGrp &w = wgmma_group_of_caller("wgmma.commit_group");
  barrier_wait(w.bar, 128);
  if ((g_cur->tid & 127) == 0) {
    w.groups.push_back(std::move(w.open));
    w.open.clear();
    if (rng() & 1) wgmma_retire(w, 0); /* executes now, at random */
  }
  barrier_wait(w.bar, 128);
}
void wgmma_wait(int n) {
  WGrp &w = wgmma_group_of_caller("wgmma.wait_group");
  barrier_wait(w.bar, 128);
  if ((g_cur->tid & 127) == 0) wgmma_retire(w, (size_t)n);
  barrier_wait(w.bar, 128);
}
void wgmma(float *d, const uint32_t *a, uint64_t desc, int N, int tnsp, bool bf16) {
  wgmma_any(d, a, 0, 0, desc, N, tnsp, bf16);
}
void wgmma_ss(float *d, uint64_t adesc, int tnsp_a, uint64_t desc, int N, int tnsp, bool bf16) {
  wgmma_any(d, nullptr, adesc, tnsp_a, desc, N, tnsp, bf16);
}

/* setmaxnreg: each warpgroup's per-thread register limit and the CTA's pool of registers that
 * no warpgroup holds; g_launch_regs (set_launch_regs before a launch, 0: not checked) is the
 * per-thread count the kernel was launched with, the pool starts empty. */
static int g_launch_regs = 0;
static int wg_regs[4];
static long reg_pool = 0;
static int wg_req[4][128];
void set_launch_regs(int n) { g_launch_regs = n; }
void setmaxnreg(int n, bool inc) {
  const int t = g_cur->tid, lt = t & 127, wi = t >> 7;
  if (wi >= 4 || (t | 127) >= g_nt) fail("setmaxnreg by thread %d of a CTA of %d", t, g_nt);
  if (n % 8 || n < 24 || n > 256) fail("setmaxnreg count %d", n);
  WGrp &w = wgrps[wi];
  wg_req[wi][lt] = inc ? n : -n;
  barrier_wait(w.bar, 128); /* .sync.aligned: every thread of the warpgroup */
  for (int i = 0; i < 128; ++i)
    if (wg_req[wi][i] != wg_req[wi][lt])
      fail("setmaxnreg differs across the warpgroup (%d, %d)", wg_req[wi][i], wg_req[wi][lt]);
  if (lt == 0 && g_launch_regs > 0) {
    const int cur = wg_regs[wi];
    if (inc ? n < cur : n > cur)
      fail("setmaxnreg.%s %d from %d registers", inc ? "inc" : "dec", n, cur);
    if (inc) {
      /* blocks until the pool holds the registers (another warpgroup's dec) */
      long spins = 0;
      while (reg_pool < 128L * (n - cur)) {
        if (++spins > 100000000L)
          fail("setmaxnreg.inc %d waits for registers that no warpgroup releases (pool %ld)", n,
               reg_pool);
        yield();
      }
      reg_pool -= 128L * (n - cur);
    } else {
      reg_pool += 128L * (cur - n);
    }
    wg_regs[wi] = n;
  }
  barrier_wait(w.bar, 128);
}

struct MBar {
  int count, pending, phase;
};
static std::map<uint32_t, MBar> g_mbars;
static Barrier named_bars[16];
void mbar_init(uint32_t bar, int count) {
  if (bar % 8 || bar + 8 > g_smem_size) fail("mbarrier address %u", bar);
  g_mbars[bar] = {count, count, 0};
}
void mbar_arrive(uint32_t bar) {
  auto it = g_mbars.find(bar);
  if (it == g_mbars.end()) fail("arrive on an uninitialised mbarrier %u", bar);
  if (--it->second.pending == 0) {
    it->second.phase ^= 1;
    it->second.pending = it->second.count;
  }
  if (rng() & 1) yield();
}
bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  auto it = g_mbars.find(bar);
  if (it == g_mbars.end()) fail("wait on an uninitialised mbarrier %u", bar);
  /* phase `parity` has completed once the current phase parity differs */
  if ((uint32_t)it->second.phase != (parity & 1)) return true;
  if (++g_spins > 200000000L) fail("mbarrier wait spins without end (deadlock?)");
  yield();
  return false;
}
void named_barrier(int id, int count) { barrier_wait(named_bars[id], count); }
/* bar.arrive: counts the calling thread's arrival, does not wait (the
 * barrier's phase completes when its count is reached, by arrivals and
 * waits together) */
void named_barrier_arrive(int id, int count) {
  Barrier &b = named_bars[id];
  if (++b.count == count) {
    b.count = 0;
    b.gen++;
  }
}
void cp_async(uint32_t dst, const void *src, int bytes, bool valid) {
  if (dst % bytes || dst + bytes > g_smem_size)
    fail("cp.async dst %u (%d bytes, smem %u)", dst, bytes, g_smem_size);
  if (valid) {
    if ((uintptr_t)src % bytes) fail("cp.async misaligned src");
    bool in = false;
    for (auto &b : g_bufs)
      if ((const char *)src >= b.p && (const char *)src + bytes <= b.p + b.n) in = true;
    if (!in) fail("cp.async reads outside every registered buffer (%p, %d bytes)", src, bytes);
  }
  g_cur->open.push_back({dst, src, bytes, valid});
}
static void cp_land(std::vector<Copy> &g) {
  for (auto &c : g) {
    if (c.valid)
      memcpy(g_smem.data() + c.dst, c.src, c.bytes);
    else
      memset(g_smem.data() + c.dst, 0, c.bytes);
  }
  g.clear();
}
/* A committed group lands at once (at random) or at the wait_group that needs it: the copies
 * complete at some time between their issue and that wait, as on the hardware, so that a
 * stage overwritten too early, or read too early, is seen. A landed group stays in the list
 * (empty) so that wait_group counts the most recent groups as the hardware does. */
void cp_commit() {
  g_cur->groups.push_back(std::move(g_cur->open));
  g_cur->open.clear();
  if (rng() & 1) cp_land(g_cur->groups.back());
}
void cp_wait(int n) {
  while ((int)g_cur->groups.size() > n) {
    cp_land(g_cur->groups.front());
    g_cur->groups.erase(g_cur->groups.begin());
  }
}
static void fiber_main() {
  g_kernel();
  g_cur->done = true;
  emu_switch(&g_cur->sp, sched_sp);
  abort();
}
void launch(int grid, int smem_bytes, std::function<void()> k, bool shuffle_blocks, int nt) {
  if (nt % 32 || nt > 512) fail("block size %d", nt);
  g_nt = nt;
  g_kernel = std::move(k);
  g_grid = {(unsigned)grid, 1, 1};
  g_block = {(unsigned)nt, 1, 1};
  g_smem_size = smem_bytes;
  g_smem.assign(smem_bytes + 16, 0xFF);
  std::vector<int> order(grid);
  for (int i = 0; i < grid; ++i) order[i] = i;
  if (shuffle_blocks) std::shuffle(order.begin(), order.end(), rng);
  for (int bi : order) {
    g_bid = {(unsigned)bi, 0, 0};
    memset(g_smem.data(), 0xFF, g_smem.size()); // NaN garbage
    cta_bar = Barrier();
    for (auto &w : warps) w.bar = Barrier();
    for (auto &w : wgrps) {
      w.bar = Barrier();
      w.open.clear();
      w.groups.clear();
    }
    for (auto &b : named_bars) b = Barrier();
    g_mbars.clear();
    for (int &r : wg_regs) r = g_launch_regs;
    reg_pool = 0;
    for (int t = 0; t < g_nt; ++t) {
      Fiber &f = fibers[t];
      if (!f.stack) f.stack = (char *)aligned_alloc(64, kStack);
      f.tid = t;
      f.done = false;
      f.wait_on = nullptr;
      f.groups.clear();
      f.open.clear();
      f.t3 = {(unsigned)t, 0, 0};
      uintptr_t top = ((uintptr_t)(f.stack + kStack)) & ~(uintptr_t)15;
      void **sp = (void **)top;
      *--sp = nullptr;
      *--sp = (void *)&fiber_main;
      for (int i = 0; i < 6; ++i) *--sp = nullptr;
      f.sp = sp;
    }
    std::vector<int> run, fav;
    int favour = 0;
    long favour_left = 0;
    for (;;) {
      run.clear();
      bool all_done = true;
      for (int t = 0; t < g_nt; ++t) {
        Fiber &f = fibers[t];
        if (f.done) continue;
        all_done = false;
        if (!f.wait_on || f.wait_on->gen != f.wait_gen) run.push_back(t);
      }
      if (all_done) {
        for (auto &w : wgrps)
          if (!w.open.empty() || !w.groups.empty())
            fail("wgmma products still pending (not waited for) when the block ends");
        for (int i = 0; i < 16; ++i)
          if (named_bars[i].count != 0)
            fail("named barrier %d: %d arrivals pending when the block ends", i,
                 named_bars[i].count);
        break;
      }
      if (run.empty()) {
        g_cur = nullptr;
        fail("deadlock: live threads all wait at barriers (divergent exit or sync?)");
      }
      /* a favoured warpgroup, changed at random every few thousand switches, runs ahead of
       * the others (9 picks in 10 among its runnable threads): warps of a CTA drift far apart
       * on the hardware, and a buffer that one warpgroup rewrites while another still reads it
       * is then seen */
      if (--favour_left <= 0) {
        favour = (int)(rng() % (unsigned)((g_nt + 127) / 128));
        favour_left = 1000 + (long)(rng() % 20000);
      }
      fav.clear();
      for (int t : run)
        if (t >> 7 == favour) fav.push_back(t);
      if (!fav.empty() && rng() % 10 != 0)
        g_cur = &fibers[fav[rng() % fav.size()]];
      else
        g_cur = &fibers[run[rng() % run.size()]];
      emu_switch(&sched_sp, g_cur->sp);
    }
    g_cur = nullptr;
  }
}
} // namespace emu
