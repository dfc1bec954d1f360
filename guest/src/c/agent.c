/* burstvm built-in guest agent: main flow.
 *
 * boot → (virtio-net driver init) → app launch (rootfs file + marker, app
 * payload) → (link up, UDP request, reply) → READY → EXIT, each step
 * reported on the agent port. Everything after the boot report runs at CPL3
 * (entry.S, docs/guest.md "The agent at CPL3"): on kvm_pvm CPL0 code is
 * emulated at ~1 µs an instruction and CPL3 code runs natively. Every wait
 * sleeps in `hlt` until an interrupt (device or LAPIC timer) arrives. */
#include "agent.h"
#include "bootinfo.h"
#include "csum.h"
#include "net.h"
#include "rootfs.h"
#include "sg.h"
#include "virtio.h"

/* ---- freestanding libc subset ------------------------------------------ */

/* String instructions, 8 bytes at a time: where CPL0 code is emulated
 * instruction by instruction (kvm_pvm), a byte loop costs four emulated
 * instructions per byte and `rep` one per call; on hardware it is the fast
 * path too. The direction flag is clear (SysV ABI). */
void *memset(void *d, int c, size_t n) {
  void *p = d;
  size_t q = n >> 3, r = n & 7;
  uint64_t v = (uint8_t)c * 0x0101010101010101ULL;
  __asm__ volatile("rep stosq" : "+D"(p), "+c"(q) : "a"(v) : "memory");
  __asm__ volatile("rep stosb" : "+D"(p), "+c"(r) : "a"(v) : "memory");
  return d;
}

void *memcpy(void *d, const void *s, size_t n) {
  void *p = d;
  size_t q = n >> 3, r = n & 7;
  __asm__ volatile("rep movsq" : "+D"(p), "+S"(s), "+c"(q) : : "memory");
  __asm__ volatile("rep movsb" : "+D"(p), "+S"(s), "+c"(r) : : "memory");
  return d;
}

/* ---- ending --------------------------------------------------------------- */

uint64_t k_report(void *ev_data) {
  uint64_t v = (uint64_t)ev_data;
  if (v & REPORT_DATA) outl(PORT_DATA, (uint32_t)(v >> 32));
  outb(PORT_EVENT, (uint8_t)v);
  return 0;
}

__attribute__((noreturn)) static uint64_t k_halt(void *arg) {
  (void)arg;
  for (;;) __asm__ volatile("cli; hlt");
}

__attribute__((noreturn)) static void agent_exit(uint32_t status) {
  report_data(EV_EXIT, status);
  kcall(k_halt, 0); /* the VMM ends the VM at EXIT */
  __builtin_unreachable();
}

__attribute__((noreturn)) void fail(uint32_t code) {
  report_data(EV_ERROR, code);
  agent_exit(1);
}

__attribute__((noreturn)) void exception_handler(uint64_t vector, uint64_t rip, uint64_t cr2,
                                                  uint64_t cs) {
  report_data(EV_VALUE, (uint32_t)vector);
  report_data(EV_VALUE, (uint32_t)rip);
  report_data(EV_VALUE, (uint32_t)cr2);
  report_data(EV_VALUE, (uint32_t)(cr2 >> 32));
  report_data(EV_VALUE, (uint32_t)cs);
  fail(ERR_EXCEPTION);
}

/* ---- memory: bump allocator over boot_info.mem[0] ------------------------ */

static uint64_t heap_next, heap_end;

static void *bump(uint64_t *next, uint64_t end, uint32_t n) {
  uint64_t p = *next;
  if (end - *next < (uint64_t)n * 4096) fail(ERR_NO_MEMORY);
  *next += (uint64_t)n * 4096;
  return (void *)p;
}

/* The VMM guarantees guest RAM reads as zero on first use. */
void *alloc_pages(uint32_t n) { return bump(&heap_next, heap_end, n); }

/* What a device reads or writes comes from the DMA window when there is one
 * (vmm --dma-window, the `window` variant): the device maps only the window,
 * never guest RAM. Fresh like RAM: zero on first use. */
static uint64_t dma_next, dma_end;

void *alloc_dma_pages(uint32_t n) {
  return dma_end ? bump(&dma_next, dma_end, n) : alloc_pages(n);
}

static void heap_init(const struct boot_info *bi) {
  if (bi->n_mem == 0) fail(ERR_NO_MEMORY);
  heap_next = (bi->mem[0].base + 4095) & ~4095ULL;
  heap_end = bi->mem[0].base + bi->mem[0].size;
  if (heap_end < heap_next || heap_end > 0x100000000ULL) fail(ERR_NO_MEMORY);
  if (bi->version >= 5 && bi->dma_window_size) {
    dma_next = bi->dma_window_gpa;
    dma_end = bi->dma_window_gpa + bi->dma_window_size;
    if (dma_next & 4095 || dma_end < dma_next || dma_end > 0x100000000ULL) fail(ERR_NO_MEMORY);
  }
}

/* ---- interrupts: IDT, LAPIC, IOAPIC ---------------------------------------- */

#define IDT_GPA 0x1000
#define IDT_GATES 64
#define VEC_TIMER 0x20
#define VEC_DEV0 0x21 /* device i uses VEC_DEV0 + i */
#define VEC_SPURIOUS 0x3f

#define LAPIC 0xfee00000ULL
#define LAPIC_TPR 0x080
#define LAPIC_SVR 0x0f0
#define LAPIC_LVT_TIMER 0x320
#define LAPIC_LVT_LINT0 0x350
#define LAPIC_TIMER_INIT 0x380
#define LAPIC_TIMER_DIV 0x3e0
#define IOAPIC 0xfec00000ULL

/* KVM's LAPIC timer runs at 1 GHz; divided by 128 this is a 250 ms tick. */
#define TIMER_DIV_128 0xa
#define TIMER_COUNT 1953125
#define TIMER_PERIODIC (1u << 17)
#define WAIT_TICKS 240        /* 60 s per wait, a backstop behind the VMM's --timeout */
#define MAX_WAKEUPS 100000
#define RESEND_TICKS 4        /* resend the request every second until answered */

extern char exc_stubs[], ud_stub[], irq_stub[], timer_stub[], spurious_stub[];
volatile uint64_t timer_ticks;

struct idt_gate { uint16_t off0, sel; uint8_t ist, type; uint16_t off1; uint32_t off2, zero; };

static void set_gate(struct idt_gate *idt, int v, void *handler) {
  uint64_t h = (uint64_t)handler;
  idt[v] = (struct idt_gate){(uint16_t)h, 0x08, 0, 0x8e, (uint16_t)(h >> 16), (uint32_t)(h >> 32), 0};
}

static void lapic_write(uint32_t reg, uint32_t v) { mmio_write32(LAPIC + reg, v); }

/* Route IOAPIC pin `gsi` to `vector` on CPU 0: edge-triggered, active high. */
static void ioapic_route(uint32_t gsi, uint8_t vector) {
  mmio_write32(IOAPIC, 0x10 + 2 * gsi + 1);
  mmio_write32(IOAPIC + 0x10, 0); /* destination APIC id 0 */
  mmio_write32(IOAPIC, 0x10 + 2 * gsi);
  mmio_write32(IOAPIC + 0x10, vector); /* unmasked */
}

/* Exceptions report ERROR instead of triple-faulting (#UD is also the
 * kernel call); vectors 0x20+ are the timer, the devices and the spurious
 * vector. Plain stores into the table _start loaded (lidt is a CPL0
 * instruction, the stores are not): no interrupt or exception comes before
 * this. */
static void idt_setup(void) {
  struct idt_gate *idt = (struct idt_gate *)IDT_GPA;
  for (int v = 0; v < 32; v++) set_gate(idt, v, exc_stubs + 16 * v);
  set_gate(idt, 6, ud_stub);
  for (int v = 32; v < IDT_GATES; v++) set_gate(idt, v, irq_stub);
  set_gate(idt, VEC_TIMER, timer_stub);
  set_gate(idt, VEC_SPURIOUS, spurious_stub);
}

/* The user-mode frame of the kernel call running now (entry.S): every entry
 * from CPL3 starts at the top of the TSS stack, and kernel calls run with
 * interrupts off, so nothing else is below it. */
struct kframe { uint64_t rip, cs, rflags, rsp, ss; };
extern struct kframe user_frame;

/* A kernel call: a dozen register writes in a row; then interrupts on for
 * user mode (its kcall returns with IF set), the PICs masked. At CPL0 all
 * along (BI_KERNEL_MODE) interrupts stay off outside k_sleep's hlt. */
static uint64_t k_irq_setup(void *arg) {
  const struct boot_info *bi = arg;
  outb(0x21, 0xff); /* mask the legacy PICs: all interrupts come via the IOAPIC */
  outb(0xa1, 0xff);
  lapic_write(LAPIC_LVT_LINT0, 1u << 16); /* masked: no ExtINT from the PIC */
  lapic_write(LAPIC_TPR, 0);
  lapic_write(LAPIC_SVR, 0x100 | VEC_SPURIOUS); /* software-enable the LAPIC */
  for (uint32_t i = 0; i < bi->n_dev && i < 4; i++)
    if (bi->dev[i].irq < 24) ioapic_route(bi->dev[i].irq, VEC_DEV0 + i);
  lapic_write(LAPIC_TIMER_DIV, TIMER_DIV_128);
  lapic_write(LAPIC_LVT_TIMER, VEC_TIMER | TIMER_PERIODIC);
  lapic_write(LAPIC_TIMER_INIT, TIMER_COUNT);
  if ((user_frame.cs & 3) == 3) user_frame.rflags |= 0x200;
  return 0;
}

static const struct boot_info *boot;

/* A kernel call: acknowledge every device's interrupt (there are at most
 * four), then sleep until an interrupt unless one came since irq_count read
 * *seen. Interrupts are off here and `sti; hlt` is atomic (sti's
 * one-instruction shadow); at CPL3 they are on, so one that came between the
 * caller's look and this call has counted already. The ack comes first: a
 * device signals an event after it only once its status is acknowledged. */
static uint64_t k_sleep(void *seen) {
  virtq_flush_later(); /* a request's notify rides on the sleep for its answer */
  for (uint32_t i = 0; i < boot->n_dev && i < 4; i++) virtio_ack_irq(boot->dev[i].mmio_base);
  if (irq_count == *(uint64_t *)seen) __asm__ volatile("sti; hlt; cli" ::: "memory");
  return 0;
}

static uint64_t k_flush_later(void *arg) {
  (void)arg;
  virtq_flush_later();
  return 0;
}

/* Sleep until cond(arg) holds. The interrupt count is read before cond is
 * checked, so an interrupt that arrives after the check still ends the
 * sleep. A deferred notify (virtq_notify_later) goes with the first sleep,
 * or before returning if cond held without one. */
void wait_until(int (*cond)(void *), void *arg, uint32_t err) {
  uint64_t start = timer_ticks;
  for (uint32_t wakeups = 0;; wakeups++) {
    uint64_t seen = irq_count;
    if (cond(arg)) {
      if (virtq_later_pending()) kcall(k_flush_later, 0);
      return;
    }
    if (timer_ticks - start >= WAIT_TICKS || wakeups >= MAX_WAKEUPS) fail(err);
    kcall(k_sleep, &seen);
  }
}

/* Sleep until cond(arg) holds, where cond reads device registers: all of it
 * in one kernel call, wait_until's loop run at CPL0 (its kcall of k_sleep is
 * then a plain call; a register read from CPL3 costs several times one from
 * CPL0 on kvm_pvm, more than the kernel call around the loop), then
 * `report` reported there too (0: none). */
struct kwait { int (*cond)(void *); void *arg; uint32_t err; uint8_t report; };

static uint64_t k_wait(void *p) {
  const struct kwait *w = p;
  wait_until(w->cond, w->arg, w->err);
  if (w->report) k_report((void *)(uint64_t)w->report);
  return 0;
}

void wait_until_dev(int (*cond)(void *), void *arg, uint32_t err, uint8_t report) {
  struct kwait w = {cond, arg, err, report};
  kcall(k_wait, &w);
}

/* ---- the application ------------------------------------------------------ */

/* The app loads from its rootfs (rootfs.c), then checksums its payload
 * (csum.h, docs/guest.md). */

/* An app payload may begin with a header that names the status the app ends
 * with (docs/guest.md): the 8 bytes "BVMAPP01", then a little-endian u32.
 * A container image's entrypoint carries it; generated payloads do not. */
#define APP_MAGIC 0x31305050414D5642ULL
static uint32_t app_exit_status(const struct boot_info *bi) {
  const uint8_t *p = (const uint8_t *)bi->app_gpa;
  if (bi->app_len < 12 || *(const uint64_t *)p != APP_MAGIC) return 0;
  return *(const uint32_t *)(p + 8);
}

static void app_launch(const struct boot_info *bi) {
  report(EV_APP_LAUNCH_START);
  rootfs_launch(bi);
  struct csum c = {0};
  csum_add(&c, (const uint8_t *)bi->app_gpa, bi->app_len);
  report_data(EV_APP_LAUNCH_END, csum_fold(&c));
}

/* Probe mode: report the 8 bytes at each address as two VALUEs (low, high). */
static void probe(const struct boot_info *bi) {
  for (uint32_t i = 0; i < bi->n_probe && i < 64; i++) {
    uint64_t v = *(volatile uint64_t *)bi->probe_gpa[i];
    report_data(EV_VALUE, (uint32_t)v);
    report_data(EV_VALUE, (uint32_t)(v >> 32));
  }
}

/* The request/reply exchange, driven from wait_until. */
static const struct boot_info *req_bi;
static uint8_t req_mac[6];
static uint64_t req_sent_at;
static uint32_t reply_len;
static int64_t req_seq = -1; /* echo mode: replies received so far, sent with each request */

static void send_request(void *arg) {
  struct vnet *n = arg;
  vnet_send(n, net_build_request(req_bi, req_mac, vnet_tx_frame(n), req_seq));
  req_sent_at = timer_ticks;
}

static int got_reply(void *arg);

static void exchange(struct vnet *n) {
  send_request(n);
  wait_until(got_reply, n, ERR_REPLY_TIMEOUT);
}

static int got_reply(void *arg) {
  struct vnet *n = arg;
  uint8_t *f;
  uint32_t len, plen = 0;
  while (vnet_rx(n, &f, &len)) {
    enum frame_kind k = net_classify(req_bi, req_mac, f, len, &plen);
    if (k == FRAME_ARP_REQUEST) {
      wait_until(vnet_tx_idle, n, ERR_TX_TIMEOUT);
      vnet_send(n, net_build_arp_reply(req_bi, req_mac, f, vnet_tx_frame(n)));
    }
    vnet_rx_done(n);
    if (k == FRAME_REPLY) {
      reply_len = plen;
      return 1;
    }
  }
  if (timer_ticks - req_sent_at >= RESEND_TICKS && vnet_tx_idle(n)) send_request(n);
  return 0;
}

static const struct boot_dev *find_net(const struct boot_info *bi) {
  for (uint32_t i = 0; i < bi->n_dev && i < 4; i++)
    if (bi->dev[i].virtio_type == VIRTIO_ID_NET) return &bi->dev[i];
  return 0;
}

/* ---- SG mode: echo through warp pipes (docs/sgiov.md, "The agent's SG mode") --- */

static struct sgdev sg;
static uint16_t *sg_socks; /* sg_mode's sockets (on the heap: the image stays small) */
static uint32_t sg_pending[32]; /* req_ids awaited by sg_replies_in (sg_batch: at most 32) */
static uint32_t sg_npending;
static uint32_t sg_want; /* bytes every pipe must hand back */
static uint8_t sg_buf[SG_RING_SIZE];

/* Salt of this sandbox's payload (sg_mode sets it; vmm bootinfo.rs sg_seed): two
 * sandboxes send different bytes, so a pipe handing back another's fails the check. */
static uint32_t sg_seed;

/* FNV-1a of the sandbox id. */
static uint32_t sg_seed_of(const char *id) {
  uint32_t h = 2166136261u;
  for (uint32_t k = 0; k < 64 && id[k]; k++) h = (h ^ (uint8_t)id[k]) * 16777619u;
  return h;
}

/* Byte j through pipe i (vmm bootinfo.rs sg_byte: the VMM's expected checksum). */
static uint8_t sg_byte(uint32_t i, uint32_t j) {
  /* The high half of a word gets 5 x the salt: the checksum's fold (low ^ high) keeps it. */
  uint8_t salt = (uint8_t)((uint8_t)(sg_seed >> 8 * (j & 3)) * (1 + (j & 4)));
  return (uint8_t)(i * 31 ^ j ^ (j >> 8) * 7) ^ salt;
}

static int sg_replies_in(void *arg) {
  (void)arg;
  sg_poll(&sg);
  uint32_t st;
  for (uint32_t i = 0; i < sg_npending; i++)
    if (!sg_reply(&sg, sg_pending[i], &st)) return 0;
  return 1;
}

/* Flush the batch of requests, wait for every reply, all must be 0. */
static void sg_await_batch(void) {
  sg_flush(&sg);
  wait_until(sg_replies_in, 0, ERR_SG_TIMEOUT);
  for (uint32_t i = 0; i < sg_npending; i++) {
    uint32_t st = 0;
    sg_reply(&sg, sg_pending[i], &st);
    if (st) { report_data(EV_VALUE, st); fail(ERR_SG_REFUSED); }
  }
  sg_npending = 0;
}

static int sg_all_back(void *arg) {
  uint32_t n = *(uint32_t *)arg;
  sg_poll(&sg);
  for (uint32_t i = 0; i < n; i++)
    if (sg_rx_ready(&sg, sg_socks[i]) < sg_want) return 0;
  return 1;
}

static int sg_tx_room(void *arg) {
  uint16_t sock = *(uint16_t *)arg;
  sg_poll(&sg);
  return sg_tx_space(&sg, sock) >= sg_want;
}

/* Pipe i's sg_want bytes into sg_buf, added to c (if any): 1 if they are
 * the pattern sent through pipe i. */
static uint32_t sg_take(uint32_t i, struct csum *c) {
  if (sg_recv(&sg, sg_socks[i], sg_buf, sg_want) != sg_want) fail(ERR_SG_DATA);
  uint32_t bad = 0;
  for (uint32_t j = 0; j < sg_want; j++) bad |= sg_buf[j] ^ sg_byte(i, j);
  if (c) csum_add(c, sg_buf, sg_want);
  return !bad;
}

/* One round: the payload into every pipe, then every echo out and checked.
 * Returns the pipes that came back byte-exact (all, or the agent fails). */
static uint32_t sg_round(uint32_t n, struct csum *c) {
  uint8_t *buf = sg_buf;
  for (uint32_t i = 0; i < n; i++) {
    if (sg_tx_space(&sg, sg_socks[i]) < sg_want) {
      sg_flush(&sg);
      wait_until(sg_tx_room, &sg_socks[i], ERR_SG_TIMEOUT);
    }
    for (uint32_t j = 0; j < sg_want; j++) buf[j] = sg_byte(i, j);
    sg_send(&sg, sg_socks[i], buf, sg_want);
  }
  sg_flush(&sg);
  wait_until(sg_all_back, &n, ERR_SG_TIMEOUT);
  uint32_t ok = 0;
  for (uint32_t i = 0; i < n; i++) ok += sg_take(i, c);
  sg_flush(&sg);
  return ok;
}

static void sg_batch(uint32_t req) {
  sg_pending[sg_npending++] = req;
  if (sg_npending >= 32) sg_await_batch();
}

/* Close sockets 0..n-1 and, once the device answered, free their slots. */
static void sg_close_all(uint32_t n) {
  for (uint32_t i = 0; i < n; i++) sg_batch(sg_close(&sg, sg_socks[i]));
  sg_await_batch();
  for (uint32_t i = 0; i < n; i++) sg_release(&sg, sg_socks[i]);
}

/* Open bi->sg_pipes echo sockets, one round through all of them, report the
 * count and checksum; then close them (BI_SG alone) or keep the rounds going
 * after READY (with BI_ECHO: the caller loops sg_round). */
static const struct boot_dev *sg_device(const struct boot_info *bi) {
  const struct boot_dev *dev = 0;
  for (uint32_t i = 0; i < bi->n_dev && i < 4; i++)
    if (bi->dev[i].virtio_type == SG_DEVICE_ID) dev = &bi->dev[i];
  if (bi->version < 3 || !dev || !bi->sg_pipes || bi->sg_pipes > SG_MAX_SOCKS ||
      !bi->sg_bytes || bi->sg_bytes > SG_RING_SIZE)
    fail(ERR_SG_DEVICE);
  return dev;
}

static void sg_mode(const struct boot_info *bi) {
  const struct boot_dev *dev = sg_device(bi);
  uint32_t n = bi->sg_pipes;
  sg_want = bi->sg_bytes;
  sg_seed = sg_seed_of(bi->sandbox_id);
  sg_init(&sg, dev, n);
  sg_socks = alloc_pages((n * 2 + 4095) / 4096);
  for (uint32_t i = 0; i < n; i++) {
    uint16_t s;
    sg_batch(sg_open(&sg, &s));
    sg_socks[i] = s;
    sg_batch(sg_connect(&sg, s, 0));
  }
  sg_await_batch();
  struct csum c = {0};
  report_data(EV_SG_PIPES, sg_round(n, &c));
  report_data(EV_SG_CSUM, csum_fold(&c));
  if (bi->flags & BI_ECHO) return;
  sg_close_all(n);
  /* Ring ids come back: reopen up to 32 sockets on the released slots and move a
   * round through them byte-exact (any mix-up fails ERR_SG_DATA), then close. */
  uint32_t again = n < 32 ? n : 32;
  for (uint32_t i = 0; i < again; i++) {
    uint16_t s;
    sg_batch(sg_open(&sg, &s));
    sg_socks[i] = s;
    sg_batch(sg_connect(&sg, s, 0));
  }
  sg_await_batch();
  if (sg_round(again, 0) != again) fail(ERR_SG_DATA);
  sg_close_all(again);
}

/* ---- SG chain: two sandboxes through the daemon (docs/sgiov.md 14.1) ------- */

static int tick_passed(void *arg) { return timer_ticks != *(uint64_t *)arg; }

/* One control request, its reply awaited: the status. */
static uint32_t sg_request_wait(uint32_t req) {
  sg_pending[0] = req;
  sg_npending = 1;
  sg_flush(&sg);
  wait_until(sg_replies_in, 0, ERR_SG_TIMEOUT);
  sg_npending = 0;
  uint32_t st = 0;
  sg_reply(&sg, req, &st);
  return st;
}

static int sg_all_closed(void *arg) {
  uint32_t n = *(uint32_t *)arg;
  sg_poll(&sg);
  for (uint32_t i = 0; i < n; i++)
    if (!sg_sock_error(&sg, sg_socks[i])) return 0;
  return 1;
}

/* BI_SG_SEND: CONNECT sg_pipes sockets to sg_port (retried while nobody
 * listens yet: the receiver's VM may still be booting), one round (the
 * payload out, the receiver's echo back, checked), report, CLOSE.
 * BI_SG_RECV: LISTEN on sg_port, ACCEPT sg_pipes connections (paired in
 * CONNECT order), wait for the payload of each, check it, report, echo it
 * back, wait for the sender's CLOSE (closing first would drop the echo
 * still in flight), CLOSE. Both report the same count and checksum: the
 * VMM of each checks it, so the receiver's VMM verifies what the sender
 * sent and the sender's what came back. */
static void sg_chain(const struct boot_info *bi) {
  const struct boot_dev *dev = sg_device(bi);
  if (bi->version < 4 || !bi->sg_port || bi->sg_pipes >= SG_MAX_SOCKS) fail(ERR_SG_DEVICE);
  uint32_t n = bi->sg_pipes;
  int recv = bi->flags & BI_SG_RECV;
  sg_want = bi->sg_bytes;
  sg_seed = bi->sg_port; /* both ends salt alike: the chain's port (vmm sg_checksum_seeded) */
  sg_init(&sg, dev, n + 1);
  sg_socks = alloc_pages((n * 2 + 4095) / 4096);
  uint16_t l = 0;
  if (recv) {
    sg_batch(sg_open(&sg, &l));
    sg_batch(sg_listen(&sg, l, bi->sg_port));
  }
  for (uint32_t i = 0; i < n; i++) sg_batch(sg_open(&sg, &sg_socks[i]));
  sg_await_batch();
  struct csum c = {0};
  if (!recv) {
    for (uint32_t i = 0; i < n; i++)
      for (uint32_t tries = 0;; tries++) {
        uint32_t st = sg_request_wait(sg_connect_xf(&sg, sg_socks[i], bi->sg_port, (uint8_t)bi->sg_xf));
        if (!st) break;
        if (st != SG_STATUS_REFUSED || tries >= WAIT_TICKS) { report_data(EV_VALUE, st); fail(ERR_SG_REFUSED); }
        uint64_t t = timer_ticks;
        wait_until(tick_passed, &t, ERR_SG_TIMEOUT);
      }
    report_data(EV_SG_PIPES, sg_round(n, &c));
    report_data(EV_SG_CSUM, csum_fold(&c));
  } else {
    for (uint32_t i = 0; i < n; i++) sg_batch(sg_accept(&sg, l, sg_socks[i]));
    sg_await_batch();
    sg_flush(&sg);
    wait_until(sg_all_back, &n, ERR_SG_TIMEOUT);
    uint32_t ok = 0;
    for (uint32_t i = 0; i < n; i++) {
      ok += sg_take(i, &c);
      if (sg_send(&sg, sg_socks[i], sg_buf, sg_want) != sg_want) fail(ERR_SG_DATA);
    }
    sg_flush(&sg);
    report_data(EV_SG_PIPES, ok);
    report_data(EV_SG_CSUM, csum_fold(&c));
    wait_until(sg_all_closed, &n, ERR_SG_TIMEOUT);
    sg_batch(sg_close(&sg, l));
  }
  for (uint32_t i = 0; i < n; i++) sg_batch(sg_close(&sg, sg_socks[i]));
  sg_await_batch();
}

/* Template checkpoint (docs/templates.md): the VMM pauses and saves the VM
 * at this `out`. A sandbox restored from the template resumes after it with
 * its own boot info written at the same address, so everything per sandbox
 * (memory ranges, devices, app, network, rootfs) is read from here on; the
 * memory clobber makes the compiler reload it. */
static void template_checkpoint(void) {
  __asm__ volatile("outb %0, %1" ::"a"((uint8_t)EV_TEMPLATE), "Nd"(PORT_EVENT) : "memory");
}

__attribute__((noreturn)) static void agent_run(struct boot_info *bi);

/* At CPL0, from _start: the boot report and the template checkpoint (a
 * template holds the VM as it was before the switch), then the rest at CPL3
 * (or here, with BI_KERNEL_MODE). */
void agent_main(struct boot_info *bi) {
  if (bi->magic != BOOTINFO_MAGIC || bi->version < 1) fail(ERR_BAD_MAGIC);
  report(EV_BOOT);
  if (bi->flags & BI_TEMPLATE) template_checkpoint();
  if (bi->magic != BOOTINFO_MAGIC || bi->version < 1) fail(ERR_BAD_MAGIC);
  if (bi->flags & BI_KERNEL_MODE) agent_run(bi);
  enter_user(agent_run, bi);
}

__attribute__((noreturn)) static void agent_run(struct boot_info *bi) {
  boot = bi;
  idt_setup();
  heap_init(bi);
  const struct boot_dev *dev = find_net(bi);
  /* With a network device the interrupt set-up rides on its init's kernel call. */
  if (bi->n_dev && !dev) kcall(k_irq_setup, bi);

  if (!dev) { /* no network: the app launch (and the warp pipes) is all there is */
    app_launch(bi);
    if (bi->flags & BI_PROBE_MODE) probe(bi);
    if ((bi->flags & BI_SG) && (bi->flags & (BI_SG_SEND | BI_SG_RECV))) sg_chain(bi);
    else if (bi->flags & BI_SG) sg_mode(bi);
    report_data(EV_READY, 0);
    /* SG echo: the same bytes keep moving (a VMM killed mid-transfer, tests). */
    while ((bi->flags & (BI_SG | BI_ECHO)) == (BI_SG | BI_ECHO))
      if (sg_round(bi->sg_pipes, 0) != bi->sg_pipes) fail(ERR_SG_DATA);
    agent_exit(app_exit_status(bi));
  }

  static struct vnet net;
  int async = bi->flags & BI_ASYNC_VF_INIT;

  /* FastIOV §4.2.2: the sync driver waits for the VF before the app starts;
   * the async one lets the app launch overlap the VF becoming ready, and
   * waits for the link only before its first packet. */
  vnet_init(&net, dev, bi->flags & BI_TOUCH_RX, EV_VF_DRIVER_START, async ? EV_VF_DRIVER_END : 0,
            k_irq_setup, bi);
  if (!async) wait_until_dev(vnet_link_up, &net, ERR_LINK_TIMEOUT, EV_VF_DRIVER_END);

  app_launch(bi);
  if (bi->flags & BI_PROBE_MODE) probe(bi);
  if (async) wait_until_dev(vnet_link_up, &net, ERR_LINK_TIMEOUT, EV_VF_LINK_UP);

  req_bi = bi;
  memcpy(req_mac, bi->mac, 6);
  if (!(req_mac[0] | req_mac[1] | req_mac[2] | req_mac[3] | req_mac[4] | req_mac[5]) &&
      (net.features & VIRTIO_NET_F_MAC))
    vnet_read_mac(&net, req_mac);
  if (bi->flags & BI_ECHO) req_seq = 0;
  exchange(&net);
  /* Driver reload (kexec, rmmod/modprobe): reset the device and start over on the same
   * VF; with BI_FAULT_ONCE the VF first fails and the device must say so. */
  if (bi->flags & (BI_RESET_ONCE | BI_FAULT_ONCE)) {
    if (bi->flags & BI_FAULT_ONCE) {
      vnet_send_bad(&net);
      wait_until_dev(vnet_needs_reset, &net, ERR_NO_NEEDS_RESET, 0);
    }
    report_data(EV_VALUE, reply_len);
    vnet_init(&net, dev, bi->flags & BI_TOUCH_RX, 0, 0, 0, 0);
    wait_until_dev(vnet_link_up, &net, ERR_LINK_TIMEOUT, 0);
    exchange(&net);
  }
  report_data(EV_READY, reply_len);
  /* Echo: keep the traffic going, each request carrying the replies seen so far. */
  while (bi->flags & BI_ECHO) {
    req_seq++;
    exchange(&net);
  }
  agent_exit(app_exit_status(bi));
}
