/* virtio-net driver over virtio-mmio version 2: one RX and one TX queue.
 * Follows the init sequence of virtio 1.2 §3.1.1 step by step. */
#include "agent.h"
#include "virtio.h"

static uint32_t rd(struct vnet *n, uint32_t reg) { return mmio_read32(n->base + reg); }
static void wr(struct vnet *n, uint32_t reg, uint32_t v) { mmio_write32(n->base + reg, v); }

static void set_status(struct vnet *n, uint32_t bits) {
  wr(n, VIRTIO_MMIO_STATUS, rd(n, VIRTIO_MMIO_STATUS) | bits);
}

/* Place one queue in a fresh page and hand its addresses to the device. */
static void setup_queue(struct vnet *n, struct virtq *q, uint16_t index) {
  wr(n, VIRTIO_MMIO_QUEUE_SEL, index);
  uint32_t max = rd(n, VIRTIO_MMIO_QUEUE_NUM_MAX);
  if (max == 0 || rd(n, VIRTIO_MMIO_QUEUE_READY)) fail(ERR_QUEUE);
  uint16_t num = VQ_SIZE;
  while (num > max) num >>= 1; /* stay a power of two */

  uint8_t *page = alloc_pages(1);
  q->index = index;
  q->num = num;
  q->desc = (void *)page;
  q->avail = (void *)(page + 16 * VQ_SIZE);
  q->used = (void *)(page + 512); /* 4-byte aligned, after avail's 6 + 2*VQ_SIZE bytes */

  wr(n, VIRTIO_MMIO_QUEUE_NUM, num);
  wr(n, VIRTIO_MMIO_QUEUE_DESC_LOW, (uint32_t)(uint64_t)q->desc);
  wr(n, VIRTIO_MMIO_QUEUE_DESC_HIGH, (uint32_t)((uint64_t)q->desc >> 32));
  wr(n, VIRTIO_MMIO_QUEUE_DRIVER_LOW, (uint32_t)(uint64_t)q->avail);
  wr(n, VIRTIO_MMIO_QUEUE_DRIVER_HIGH, (uint32_t)((uint64_t)q->avail >> 32));
  wr(n, VIRTIO_MMIO_QUEUE_DEVICE_LOW, (uint32_t)(uint64_t)q->used);
  wr(n, VIRTIO_MMIO_QUEUE_DEVICE_HIGH, (uint32_t)((uint64_t)q->used >> 32));
  wr(n, VIRTIO_MMIO_QUEUE_READY, 1);
}

/* Make descriptor `id` available. Device reads are ordered after our stores
 * because x86 does not reorder stores; the barrier stops the compiler. */
static void post(struct virtq *q, uint16_t id) {
  q->avail->ring[q->avail_idx % q->num] = id;
  barrier();
  q->avail->idx = ++q->avail_idx;
}

static void notify(struct vnet *n, struct virtq *q) {
  barrier();
  wr(n, VIRTIO_MMIO_QUEUE_NOTIFY, q->index);
}

void vnet_init(struct vnet *n, const struct boot_dev *d, int touch_rx) {
  n->base = d->mmio_base;
  if (rd(n, VIRTIO_MMIO_MAGIC_VALUE) != VIRTIO_MMIO_MAGIC || rd(n, VIRTIO_MMIO_VERSION) != 2 ||
      rd(n, VIRTIO_MMIO_DEVICE_ID) != VIRTIO_ID_NET)
    fail(ERR_BAD_DEVICE);

  wr(n, VIRTIO_MMIO_STATUS, 0); /* reset */
  uint32_t st = rd(n, VIRTIO_MMIO_STATUS);
  if (st & VIRTIO_STATUS_NEEDS_RESET) fail(ERR_DEVICE_FAILED); /* e.g. the VF open failed */
  if (st != 0) fail(ERR_BAD_DEVICE);
  set_status(n, VIRTIO_STATUS_ACKNOWLEDGE);
  set_status(n, VIRTIO_STATUS_DRIVER);

  wr(n, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
  uint64_t dev = rd(n, VIRTIO_MMIO_DEVICE_FEATURES);
  wr(n, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
  dev |= (uint64_t)rd(n, VIRTIO_MMIO_DEVICE_FEATURES) << 32;
  if (!(dev & VIRTIO_F_VERSION_1)) fail(ERR_FEATURES);
  n->features = dev & (VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS);
  wr(n, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
  wr(n, VIRTIO_MMIO_DRIVER_FEATURES, (uint32_t)n->features);
  wr(n, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
  wr(n, VIRTIO_MMIO_DRIVER_FEATURES, (uint32_t)(n->features >> 32));
  set_status(n, VIRTIO_STATUS_FEATURES_OK);
  if (!(rd(n, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_FEATURES_OK)) fail(ERR_FEATURES);

  setup_queue(n, &n->rx, 0);
  setup_queue(n, &n->tx, 1);

  /* RX: one device-writable buffer per descriptor. With BI_TOUCH_RX we write
   * each buffer page first, so that lazy zeroing happens now, on the guest's
   * fault, and never after the device has written a packet there (FastIOV's
   * proactive fault). */
  uint8_t *rx = alloc_pages((n->rx.num * RX_BUF_SIZE + 4095) / 4096);
  for (uint16_t i = 0; i < n->rx.num; i++) {
    n->rx_buf[i] = rx + i * RX_BUF_SIZE;
    if (touch_rx && (i * RX_BUF_SIZE) % 4096 == 0) *(volatile uint8_t *)n->rx_buf[i] = 0;
    n->rx.desc[i].addr = (uint64_t)n->rx_buf[i];
    n->rx.desc[i].len = RX_BUF_SIZE;
    n->rx.desc[i].flags = VIRTQ_DESC_F_WRITE;
    post(&n->rx, i);
  }
  /* TX: a single buffer in descriptor 0, reused for every frame. */
  n->tx_buf = alloc_pages(1);
  n->tx.desc[0].addr = (uint64_t)n->tx_buf;

  set_status(n, VIRTIO_STATUS_DRIVER_OK);
  if (rd(n, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_NEEDS_RESET) fail(ERR_DEVICE_FAILED);
  notify(n, &n->rx);
}

int vnet_link_up(struct vnet *n) {
  if (!(n->features & VIRTIO_NET_F_STATUS)) return 1; /* no status: always up */
  return *(volatile uint16_t *)(n->base + VIRTIO_MMIO_CONFIG + VIRTIO_NET_CFG_STATUS) & VIRTIO_NET_S_LINK_UP;
}

void vnet_read_mac(struct vnet *n, uint8_t mac[6]) {
  for (int i = 0; i < 6; i++) mac[i] = mmio_read8(n->base + VIRTIO_MMIO_CONFIG + VIRTIO_NET_CFG_MAC + i);
}

/* Acknowledge whatever the device signalled; the driver then looks at the
 * rings and config itself (a vhost-user backend signals through irqfd
 * without setting InterruptStatus). */
void vnet_ack_irq(struct vnet *n) {
  uint32_t isr = rd(n, VIRTIO_MMIO_INTERRUPT_STATUS);
  if (isr) wr(n, VIRTIO_MMIO_INTERRUPT_ACK, isr);
  if (rd(n, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_NEEDS_RESET) fail(ERR_DEVICE_FAILED);
}

/* The TX buffer may be reused once the device has returned it. */
int vnet_tx_idle(struct vnet *n) {
  return n->tx.used->idx == n->tx.avail_idx;
}

uint8_t *vnet_tx_frame(struct vnet *n) { return n->tx_buf + VNET_HDR_LEN; }

void vnet_send(struct vnet *n, uint32_t frame_len) {
  memset(n->tx_buf, 0, VNET_HDR_LEN); /* no offloads */
  n->tx.desc[0].len = VNET_HDR_LEN + frame_len;
  n->tx.desc[0].flags = 0;
  post(&n->tx, 0);
  notify(n, &n->tx);
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
  *frame = n->rx_buf[id] + VNET_HDR_LEN;
  *len = total > VNET_HDR_LEN ? total - VNET_HDR_LEN : 0;
  return 1;
}

/* Give the frame returned by vnet_rx back to the device. */
void vnet_rx_done(struct vnet *n) {
  post(&n->rx, n->rx_cur);
  notify(n, &n->rx);
}
