/* Agent-wide definitions: the agent port protocol, error codes, helpers. */
#ifndef AGENT_H
#define AGENT_H
#include <stdint.h>
#include <stddef.h>

/* Agent port (docs/design.md): DATA is latched, EVENT is timestamped. */
#define PORT_EVENT 0x0f00
#define PORT_DATA  0x0f04

enum agent_event {
  EV_BOOT = 0x01,
  EV_VF_DRIVER_START = 0x02,
  EV_VF_DRIVER_END = 0x03,
  EV_APP_LAUNCH_START = 0x04,
  EV_APP_LAUNCH_END = 0x05,
  EV_READY = 0x06,
  EV_VALUE = 0x07,
  EV_ERROR = 0x08,
  EV_EXIT = 0x09,
  EV_ROOTFS_FILE = 0x0a,    /* DATA = checksum of boot_info.rootfs_file in the EROFS layer */
  EV_ROOTFS_MARKER = 0x0b,  /* DATA = checksum of the writable layer's sector 0 before the marker */
  EV_VF_LINK_UP = 0x0c,     /* async VF init: the wait for the link ended */
  EV_TEMPLATE = 0x0d,       /* template checkpoint: the VMM saves the VM here (docs/templates.md) */
  EV_SG_PIPES = 0x0e,       /* BI_SG: DATA = pipes whose echo came back byte-exact */
  EV_SG_CSUM = 0x0f,        /* BI_SG: DATA = checksum of everything the pipes returned */
};

/* ERROR codes (DATA of EV_ERROR); the VMM names them (docs/guest.md). */
enum agent_error {
  ERR_BAD_MAGIC = 1,        /* boot info magic or version wrong */
  ERR_NO_MEMORY = 2,        /* bump allocator exhausted / no usable RAM range */
  ERR_BAD_DEVICE = 3,       /* virtio-mmio magic/version/device id mismatch */
  ERR_FEATURES = 4,         /* device lacks VIRTIO_F_VERSION_1 or refused FEATURES_OK */
  ERR_QUEUE = 5,            /* queue unavailable or too small */
  ERR_LINK_TIMEOUT = 6,     /* link never came up */
  ERR_REPLY_TIMEOUT = 7,    /* no UDP reply arrived */
  ERR_TX_TIMEOUT = 8,       /* device never returned the TX buffer */
  ERR_DEVICE_FAILED = 9,    /* device set DEVICE_NEEDS_RESET */
  ERR_EXCEPTION = 10,       /* CPU exception (vector in a VALUE before it) */
  ERR_BLK_TIMEOUT = 11,     /* virtio-blk request never completed */
  ERR_BLK_IO = 12,          /* virtio-blk request failed (status in a VALUE before it) */
  ERR_EROFS = 13,           /* rootfs file not readable (erofs.h code in a VALUE before it) */
  ERR_MARKER = 14,          /* the marker read back from the writable layer differs */
  ERR_NO_ROOTFS = 15,       /* rootfs_file set but no EROFS image (disk or memory) */
  ERR_NO_NEEDS_RESET = 16,  /* fault mode: the device never set DEVICE_NEEDS_RESET */
  ERR_SG_DEVICE = 17,       /* no SG function, or its attach failed (status in a VALUE before) */
  ERR_SG_REFUSED = 18,      /* the SG function refused a control request (status in a VALUE before) */
  ERR_SG_TIMEOUT = 19,      /* the SG function did not answer within the agent's wait */
  ERR_SG_DATA = 20,         /* bytes back from a warp pipe differ from those sent */
  ERR_SG_RING = 21,         /* a ring in error / closed (code in a VALUE before), or a corrupt FIFO */
};

static inline void outb(uint16_t port, uint8_t v) { __asm__ volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static inline void outl(uint16_t port, uint32_t v) { __asm__ volatile("outl %0, %1" ::"a"(v), "Nd"(port)); }

/* Memory-mapped register access: volatile so the compiler never merges/elides. */
static inline uint32_t mmio_read32(uint64_t a) { return *(volatile uint32_t *)a; }
static inline void mmio_write32(uint64_t a, uint32_t v) { *(volatile uint32_t *)a = v; }
static inline uint16_t mmio_read16(uint64_t a) { return *(volatile uint16_t *)a; }

static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }
/* A full fence: a store made visible before a later load (x86 reorders those). */
static inline void mfence(void) { __asm__ volatile("mfence" ::: "memory"); }

__attribute__((noreturn)) void fail(uint32_t code);

struct boot_info;
/* entry.S: continue in fn(bi) at CPL3 (IOPL 3, interrupts off until the
 * interrupt set-up); never returns. */
__attribute__((noreturn)) void enter_user(void (*fn)(struct boot_info *), struct boot_info *bi);
/* entry.S: interrupts taken so far (the device and timer stubs count them). */
extern volatile uint64_t irq_count;

/* 1 at CPL3 (the agent's work), 0 at CPL0 (boot, exception handlers, kernel
 * calls, or all of it with BI_KERNEL_MODE). */
static inline int at_cpl3(void) {
  uint16_t cs;
  __asm__ volatile("mov %%cs, %0" : "=r"(cs));
  return cs & 3;
}

/* fn(arg) at CPL0, interrupts off (entry.S, ud_stub): for code that touches
 * device registers in a row, each access a third of its cost at CPL3 on
 * kvm_pvm. Called directly when already at CPL0. fn may fail() (the agent
 * then ends at CPL0). */
typedef uint64_t (*kfn)(void *);
static inline uint64_t kcall(kfn fn, void *arg) {
  if (!at_cpl3()) return fn(arg);
  uint64_t r = (uint64_t)fn;
  __asm__ volatile("ud2"
                   : "+a"(r), "+D"(arg)
                   :
                   : "rcx", "rdx", "rsi", "r8", "r9", "r10", "r11", "cc", "memory");
  return r;
}

/* Agent-port reports, from either ring (at CPL3 a kernel call: one trip for
 * both port writes). The argument packs the event, whether DATA is written,
 * and DATA. */
#define REPORT_DATA (1ULL << 8)
uint64_t k_report(void *ev_data);
static inline void report_data(uint8_t ev, uint32_t data) {
  kcall(k_report, (void *)((uint64_t)data << 32 | REPORT_DATA | ev));
}
static inline void report(uint8_t ev) { kcall(k_report, (void *)(uint64_t)ev); }

/* Freestanding libc subset (agent.c); gcc may emit calls to these. */
void *memset(void *d, int c, size_t n);
void *memcpy(void *d, const void *s, size_t n);

#endif
