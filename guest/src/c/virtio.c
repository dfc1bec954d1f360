/* virtio-mmio (version 2) transport and split virtqueues, shared by the
 * drivers (virtio_net.c, virtio_blk.c). Follows the init sequence of
 * virtio 1.2 §3.1.1 step by step, all of it in one kernel call (agent.h,
 * kcall): from CPL0 each access costs a third of what it does from CPL3 on
 * kvm_pvm, and each kernel call costs more than several accesses. */
#include "agent.h"
#include "virtio.h"

static uint32_t rd(uint64_t base, uint32_t reg) { return mmio_read32(base + reg); }
static void wr(uint64_t base, uint32_t reg, uint32_t v) { mmio_write32(base + reg, v); }

/* The driver's view of Status during init: each MMIO access is an exit, so
 * the bits it set are remembered rather than read back before each write. */
static uint32_t set_status(uint64_t base, uint32_t status, uint32_t bits) {
  wr(base, VIRTIO_MMIO_STATUS, status | bits);
  return status | bits;
}

/* Base of the device whose DEVICE_NEEDS_RESET the agent provoked (fault mode). */
static uint64_t reset_awaited;

void virtio_await_reset(uint64_t base) { reset_awaited = base; }

int virtio_needs_reset(uint64_t base) {
  return (rd(base, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_NEEDS_RESET) != 0;
}

/* virtio 1.2 §3.1.1 steps 1-6: reset, identify, negotiate. */
static uint64_t start(uint64_t base, uint32_t device_id, uint64_t wanted) {
  if (reset_awaited == base) reset_awaited = 0;
  if (rd(base, VIRTIO_MMIO_MAGIC_VALUE) != VIRTIO_MMIO_MAGIC || rd(base, VIRTIO_MMIO_VERSION) != 2 ||
      rd(base, VIRTIO_MMIO_DEVICE_ID) != device_id)
    fail(ERR_BAD_DEVICE);

  wr(base, VIRTIO_MMIO_STATUS, 0); /* reset */
  uint32_t st = rd(base, VIRTIO_MMIO_STATUS);
  if (st & VIRTIO_STATUS_NEEDS_RESET) fail(ERR_DEVICE_FAILED); /* e.g. the VF open failed */
  if (st != 0) fail(ERR_BAD_DEVICE);
  st = set_status(base, st, VIRTIO_STATUS_ACKNOWLEDGE);
  st = set_status(base, st, VIRTIO_STATUS_DRIVER);

  wr(base, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
  uint64_t dev = rd(base, VIRTIO_MMIO_DEVICE_FEATURES);
  wr(base, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
  dev |= (uint64_t)rd(base, VIRTIO_MMIO_DEVICE_FEATURES) << 32;
  if (!(dev & VIRTIO_F_VERSION_1)) fail(ERR_FEATURES);
  uint64_t features = dev & (wanted | VIRTIO_F_VERSION_1);
  wr(base, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
  wr(base, VIRTIO_MMIO_DRIVER_FEATURES, (uint32_t)features);
  wr(base, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
  wr(base, VIRTIO_MMIO_DRIVER_FEATURES, (uint32_t)(features >> 32));
  set_status(base, st, VIRTIO_STATUS_FEATURES_OK);
  if (!(rd(base, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_FEATURES_OK)) fail(ERR_FEATURES);
  return features;
}

/* Step 7 for one queue, in the page virtq_alloc gave it. Buffers the driver
 * posted beforehand (avail_idx) are published here, once the size is known. */
static void setup_queue(uint64_t base, struct virtq *q) {
  wr(base, VIRTIO_MMIO_QUEUE_SEL, q->index);
  uint32_t max = rd(base, VIRTIO_MMIO_QUEUE_NUM_MAX);
  if (max == 0 || rd(base, VIRTIO_MMIO_QUEUE_READY)) fail(ERR_QUEUE);
  uint16_t num = VQ_SIZE;
  while (num > max) num >>= 1; /* stay a power of two */
  q->num = num;
  if (q->avail_idx > num) q->avail_idx = num;
  q->avail->idx = q->avail_idx;

  wr(base, VIRTIO_MMIO_QUEUE_NUM, num);
  wr(base, VIRTIO_MMIO_QUEUE_DESC_LOW, (uint32_t)(uint64_t)q->desc);
  wr(base, VIRTIO_MMIO_QUEUE_DESC_HIGH, (uint32_t)((uint64_t)q->desc >> 32));
  wr(base, VIRTIO_MMIO_QUEUE_DRIVER_LOW, (uint32_t)(uint64_t)q->avail);
  wr(base, VIRTIO_MMIO_QUEUE_DRIVER_HIGH, (uint32_t)((uint64_t)q->avail >> 32));
  wr(base, VIRTIO_MMIO_QUEUE_DEVICE_LOW, (uint32_t)(uint64_t)q->used);
  wr(base, VIRTIO_MMIO_QUEUE_DEVICE_HIGH, (uint32_t)((uint64_t)q->used >> 32));
  wr(base, VIRTIO_MMIO_QUEUE_READY, 1);
}

void virtq_alloc(struct virtq *q, uint16_t index) {
  uint8_t *page = alloc_dma_pages(1);
  q->index = index;
  q->num = VQ_SIZE;
  q->last_used = q->avail_idx = 0;
  q->desc = (void *)page;
  q->avail = (void *)(page + 16 * VQ_SIZE);
  q->used = (void *)(page + 512); /* 4-byte aligned, after avail's 6 + 2*VQ_SIZE bytes */
}

/* The whole bring-up is one kernel call: each trip CPL3 -> CPL0 -> CPL3
 * costs more on kvm_pvm than the register accesses it carries (under a
 * burst 50-60 us, against ~10 us for an access from CPL0). After step 8
 * (DRIVER_OK) the status is exactly ACKNOWLEDGE | DRIVER | FEATURES_OK |
 * DRIVER_OK unless the device failed, so only NEEDS_RESET is looked at. */
static uint64_t k_init(void *arg) {
  struct virtio_init *v = arg;
  if (v->first) v->first(v->first_arg);
  if (v->report) k_report((void *)(uint64_t)v->report);
  v->features = start(v->base, v->device_id, v->wanted);
  for (uint16_t i = 0; i < v->nq; i++) setup_queue(v->base, v->q[i]);
  set_status(v->base, VIRTIO_STATUS_ACKNOWLEDGE | VIRTIO_STATUS_DRIVER | VIRTIO_STATUS_FEATURES_OK,
             VIRTIO_STATUS_DRIVER_OK);
  if (rd(v->base, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_NEEDS_RESET) fail(ERR_DEVICE_FAILED);
  for (uint16_t i = 0; i < v->nq; i++)
    if (v->q[i]->avail_idx) virtq_notify(v->base, v->q[i]);
  if (v->report_after) k_report((void *)(uint64_t)v->report_after);
  return 0;
}

uint64_t virtio_init(struct virtio_init *v) {
  kcall(k_init, v);
  return v->features;
}

/* Make descriptor `id` available. Device reads are ordered after our stores
 * because x86 does not reorder stores; the barrier stops the compiler. */
void virtq_post(struct virtq *q, uint16_t id) {
  q->avail->ring[q->avail_idx % q->num] = id;
  barrier();
  q->avail->idx = ++q->avail_idx;
}

/* Not while the device says it needs no notification (a polling NIC sets
 * VIRTQ_USED_F_NO_NOTIFY; virtio 1.2 §2.7.10): each notify is an exit. The
 * avail index store must be visible before the flags load (as Linux's
 * virtqueue_kick_prepare orders them), or a device that just cleared the
 * flag and looked at the ring would miss both the buffer and the notify. */
struct notify_args { uint64_t base; uint16_t index; };

static uint64_t k_notify(void *arg) {
  const struct notify_args *a = arg;
  wr(a->base, VIRTIO_MMIO_QUEUE_NOTIFY, a->index);
  return 0;
}

/* From CPL3 the register write goes through a kernel call: on kvm_pvm an
 * MMIO write from CPL3 costs more than the kernel call plus the write from
 * CPL0 (docs/guest.md, "The agent at CPL3"). */
void virtq_notify(uint64_t base, struct virtq *q) {
  mfence();
  if (q->used->flags & VIRTQ_USED_F_NO_NOTIFY) return;
  struct notify_args a = {base, q->index};
  kcall(k_notify, &a);
}

/* One deferred notify at a time: a second one for another queue sends the
 * first now. */
static struct notify_args later; /* base 0: none */

void virtq_notify_later(uint64_t base, struct virtq *q) {
  mfence();
  if (q->used->flags & VIRTQ_USED_F_NO_NOTIFY) return;
  if (later.base && (later.base != base || later.index != q->index)) kcall(k_notify, &later);
  later = (struct notify_args){base, q->index};
}

void virtq_flush_later(void) {
  if (!later.base) return;
  k_notify(&later);
  later.base = 0;
}

int virtq_later_pending(void) { return later.base != 0; }

/* Acknowledge whatever the device signalled; the driver then looks at the
 * rings and config itself (a vhost-user backend signals through irqfd
 * without setting InterruptStatus). A device that sets DEVICE_NEEDS_RESET
 * sends a configuration change notification (virtio 1.2 §2.1.2), so Status
 * is read only then: one MMIO exit less per device and wake-up. */
void virtio_ack_irq(uint64_t base) {
  uint32_t isr = rd(base, VIRTIO_MMIO_INTERRUPT_STATUS);
  if (isr) wr(base, VIRTIO_MMIO_INTERRUPT_ACK, isr);
  if ((isr & VIRTIO_MMIO_INT_CONFIG) && base != reset_awaited && virtio_needs_reset(base))
    fail(ERR_DEVICE_FAILED);
}
