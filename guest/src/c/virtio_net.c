/* virtio-net driver over virtio-mmio version 2: one RX and one TX queue. */
#include "agent.h"
#include "virtio.h"

/* Also a re-init after a reset: everything starts over in fresh pages. The
 * rings are filled before the one kernel call of virtio_init, at CPL3,
 * where stores are native (at CPL0 kvm_pvm emulates each). */
void vnet_init(struct vnet *n, const struct boot_dev *d, int touch_rx, uint8_t report,
               uint8_t report_after, uint64_t (*irq_setup)(void *), void *irq_arg) {
  memset(n, 0, sizeof *n);
  n->base = d->mmio_base;
  virtq_alloc(&n->rx, 0);
  virtq_alloc(&n->tx, 1);

  /* RX: one device-writable buffer per descriptor, all posted (virtio_init
   * publishes them, as many as the queue size the device allows). With
   * BI_TOUCH_RX we write each buffer page first, so that lazy zeroing
   * happens now, on the guest's fault, and never after the device has
   * written a packet there (FastIOV's proactive fault). */
  uint32_t rx_pages = (VQ_SIZE * RX_BUF_SIZE + 4095) / 4096;
  uint8_t *rx = n->rx_bufs = alloc_dma_pages(rx_pages);
  if (touch_rx)
    for (uint32_t p = 0; p < rx_pages; p++) ((volatile uint8_t *)rx)[p * 4096] = 0;
  const uint64_t len_flags = RX_BUF_SIZE | (uint64_t)VIRTQ_DESC_F_WRITE << 32;
  volatile uint64_t *desc = (volatile uint64_t *)n->rx.desc;
  for (uint16_t i = 0; i < VQ_SIZE; i++, rx += RX_BUF_SIZE, desc += 2) {
    desc[0] = (uint64_t)rx;
    desc[1] = len_flags;
    n->rx.avail->ring[i] = i;
  }
  n->rx.avail_idx = VQ_SIZE;
  /* TX: a single buffer in descriptor 0, reused for every frame. */
  n->tx_buf = alloc_dma_pages(1);
  n->tx.desc[0].addr = (uint64_t)n->tx_buf;

  struct virtio_init v = {
      .base = n->base,
      .wanted = VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS | VIRTIO_F_ACCESS_PLATFORM,
      .device_id = VIRTIO_ID_NET,
      .report = report,
      .report_after = report_after,
      .nq = 2,
      .q = {&n->rx, &n->tx},
      .first = irq_setup,
      .first_arg = irq_arg,
  };
  n->features = virtio_init(&v);
}

int vnet_link_up(void *arg) {
  struct vnet *n = arg;
  if (!(n->features & VIRTIO_NET_F_STATUS)) return 1; /* no status: always up */
  return *(volatile uint16_t *)(n->base + VIRTIO_MMIO_CONFIG + VIRTIO_NET_CFG_STATUS) & VIRTIO_NET_S_LINK_UP;
}

/* Two aligned reads (32 + 16 bits, as virtio-mmio allows) instead of six:
 * each is an exit to the VMM. */
void vnet_read_mac(struct vnet *n, uint8_t mac[6]) {
  uint64_t cfg = n->base + VIRTIO_MMIO_CONFIG + VIRTIO_NET_CFG_MAC;
  uint32_t lo = mmio_read32(cfg);
  uint16_t hi = mmio_read16(cfg + 4);
  memcpy(mac, &lo, 4);
  memcpy(mac + 4, &hi, 2);
}

int vnet_needs_reset(void *arg) {
  struct vnet *n = arg;
  return virtio_needs_reset(n->base);
}

/* A transmit descriptor far outside guest RAM: the device must fail (and say so). */
void vnet_send_bad(struct vnet *n) {
  virtio_await_reset(n->base);
  n->tx.desc[0].addr = 0xfff000000000ULL;
  n->tx.desc[0].len = 64;
  n->tx.desc[0].flags = 0;
  virtq_post(&n->tx, 0);
  virtq_notify(n->base, &n->tx);
}

/* The TX buffer may be reused once the device has returned it. If it has
 * not, the completion's interrupt is asked for (vnet_send turns it off
 * again), then the ring looked at once more: the store must be visible
 * before that load, or a completion between the two would go unsignalled. */
int vnet_tx_idle(void *arg) {
  struct vnet *n = arg;
  if (n->tx.used->idx == n->tx.avail_idx) return 1;
  n->tx.avail->flags = 0;
  mfence();
  return n->tx.used->idx == n->tx.avail_idx;
}

uint8_t *vnet_tx_frame(struct vnet *n) { return n->tx_buf + VNET_HDR_LEN; }

void vnet_send(struct vnet *n, uint32_t frame_len) {
  memset(n->tx_buf, 0, VNET_HDR_LEN); /* no offloads */
  n->tx.desc[0].len = VNET_HDR_LEN + frame_len;
  n->tx.desc[0].flags = 0;
  /* Its completion interrupts no one: only vnet_tx_idle waits for one, and
   * it asks for the interrupt first. */
  n->tx.avail->flags = VIRTQ_AVAIL_F_NO_INTERRUPT;
  virtq_post(&n->tx, 0);
  /* The agent waits next (for the reply, or TX idle): the notify rides on that sleep. */
  virtq_notify_later(n->base, &n->tx);
}

/* Next received frame (without the virtio-net header), or 0 if none. */
int vnet_rx(struct vnet *n, uint8_t **frame, uint32_t *len) {
  struct virtq *q = &n->rx;
  if (q->used->idx == q->last_used) return 0;
  barrier();
  volatile struct virtq_used_elem *e = &q->used->ring[q->last_used % q->num];
  uint32_t id = e->id, total = e->len;
  q->last_used++;
  if (id >= q->num) fail(ERR_QUEUE); /* device returned a descriptor we never posted */
  n->rx_cur = (uint16_t)id;
  if (total > RX_BUF_SIZE) total = RX_BUF_SIZE;
  *frame = n->rx_bufs + id * RX_BUF_SIZE + VNET_HDR_LEN;
  *len = total > VNET_HDR_LEN ? total - VNET_HDR_LEN : 0;
  return 1;
}

/* Give the frame returned by vnet_rx back to the device. */
void vnet_rx_done(struct vnet *n) {
  virtq_post(&n->rx, n->rx_cur);
  virtq_notify(n->base, &n->rx);
}
