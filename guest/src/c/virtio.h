/* virtio-mmio (version 2) and split-virtqueue definitions, the transport
 * helpers (virtio.c), and the interfaces of the virtio-net driver
 * (virtio_net.c) and the virtio-blk driver (virtio_blk.c). */
#ifndef VIRTIO_H
#define VIRTIO_H
#include <stdint.h>
#include "bootinfo.h"

/* virtio-mmio registers (virtio 1.2 §4.2.2). */
#define VIRTIO_MMIO_MAGIC_VALUE       0x000 /* "virt" */
#define VIRTIO_MMIO_VERSION           0x004
#define VIRTIO_MMIO_DEVICE_ID         0x008
#define VIRTIO_MMIO_DEVICE_FEATURES   0x010
#define VIRTIO_MMIO_DEVICE_FEATURES_SEL 0x014
#define VIRTIO_MMIO_DRIVER_FEATURES   0x020
#define VIRTIO_MMIO_DRIVER_FEATURES_SEL 0x024
#define VIRTIO_MMIO_QUEUE_SEL         0x030
#define VIRTIO_MMIO_QUEUE_NUM_MAX     0x034
#define VIRTIO_MMIO_QUEUE_NUM         0x038
#define VIRTIO_MMIO_QUEUE_READY       0x044
#define VIRTIO_MMIO_QUEUE_NOTIFY      0x050
#define VIRTIO_MMIO_INTERRUPT_STATUS  0x060
#define VIRTIO_MMIO_INTERRUPT_ACK     0x064
#define VIRTIO_MMIO_INT_CONFIG        0x2 /* InterruptStatus: configuration change */
#define VIRTIO_MMIO_STATUS            0x070
#define VIRTIO_MMIO_QUEUE_DESC_LOW    0x080
#define VIRTIO_MMIO_QUEUE_DESC_HIGH   0x084
#define VIRTIO_MMIO_QUEUE_DRIVER_LOW  0x090
#define VIRTIO_MMIO_QUEUE_DRIVER_HIGH 0x094
#define VIRTIO_MMIO_QUEUE_DEVICE_LOW  0x0a0
#define VIRTIO_MMIO_QUEUE_DEVICE_HIGH 0x0a4
#define VIRTIO_MMIO_CONFIG            0x100

#define VIRTIO_MMIO_MAGIC 0x74726976
#define VIRTIO_ID_NET 1
#define VIRTIO_ID_BLOCK 2

/* Device status bits. */
#define VIRTIO_STATUS_ACKNOWLEDGE 1
#define VIRTIO_STATUS_DRIVER      2
#define VIRTIO_STATUS_DRIVER_OK   4
#define VIRTIO_STATUS_FEATURES_OK 8
#define VIRTIO_STATUS_NEEDS_RESET 64

/* Feature bits we may negotiate: nothing else (no offloads, no mergeable
 * buffers, no event index), so the device does the simplest thing. */
#define VIRTIO_NET_F_MAC    (1ULL << 5)
#define VIRTIO_NET_F_STATUS (1ULL << 16)
#define VIRTIO_F_VERSION_1  (1ULL << 32)
/* Offered when the device reaches only the DMA window (the agent's window
 * mode keeps its rings and buffers there). */
#define VIRTIO_F_ACCESS_PLATFORM (1ULL << 33)
#define VIRTIO_BLK_F_RO     (1ULL << 5)
#define VIRTIO_BLK_F_FLUSH  (1ULL << 9)

/* virtio-net config space. */
#define VIRTIO_NET_CFG_MAC    0
#define VIRTIO_NET_CFG_STATUS 6
#define VIRTIO_NET_S_LINK_UP  1

/* With VERSION_1 every packet is preceded by this 12-byte header. */
struct virtio_net_hdr {
  uint8_t flags, gso_type;
  uint16_t hdr_len, gso_size, csum_start, csum_offset, num_buffers;
};
#define VNET_HDR_LEN 12

/* virtio-blk config space and requests (virtio 1.2 §5.2). */
#define VIRTIO_BLK_CFG_CAPACITY 0 /* le64, in 512-byte sectors */
#define VIRTIO_BLK_T_IN    0
#define VIRTIO_BLK_T_OUT   1
#define VIRTIO_BLK_T_FLUSH 4
#define VIRTIO_BLK_S_OK    0
#define SECTOR_SIZE 512
struct virtio_blk_req { uint32_t type, reserved; uint64_t sector; };

/* Split virtqueue (virtio 1.2 §2.7). */
#define VIRTQ_DESC_F_NEXT  1
#define VIRTQ_DESC_F_WRITE 2
#define VIRTQ_AVAIL_F_NO_INTERRUPT 1 /* driver: no used-buffer notification wanted */
#define VIRTQ_USED_F_NO_NOTIFY     1 /* device: no available-buffer notification wanted */
struct virtq_desc { uint64_t addr; uint32_t len; uint16_t flags, next; };
struct virtq_avail { uint16_t flags, idx, ring[]; };
struct virtq_used_elem { uint32_t id, len; };
struct virtq_used { uint16_t flags, idx; struct virtq_used_elem ring[]; };

/* Queue size we ask for (the device may offer fewer). One page holds the
 * descriptor table, avail and used ring of a queue this small. */
#define VQ_SIZE 8
#define RX_BUF_SIZE 2048 /* header + a 1514-byte frame, two per page */

struct virtq {
  uint16_t index, num;    /* queue index on the device, size */
  uint16_t last_used;     /* next used entry we have not consumed */
  uint16_t avail_idx;     /* our copy of avail->idx */
  volatile struct virtq_desc *desc;
  volatile struct virtq_avail *avail;
  volatile struct virtq_used *used;
};

struct vnet {
  uint64_t base;          /* MMIO base */
  uint64_t features;      /* negotiated */
  struct virtq rx, tx;
  uint8_t *rx_bufs;       /* RX buffer i is rx_bufs + i * RX_BUF_SIZE, in descriptor i */
  uint8_t *tx_buf;
  uint16_t rx_cur;        /* descriptor of the frame handed out by vnet_rx */
};

struct vblk {
  uint64_t base;          /* MMIO base */
  uint64_t features;      /* negotiated (VIRTIO_BLK_F_RO: the read-only layer) */
  uint64_t sectors;       /* capacity */
  struct virtq q;
  struct virtio_blk_req *hdr;
  volatile uint8_t *status;
};

/* Bump allocator over boot_info.mem (agent.c). Returned pages are zero. */
void *alloc_pages(uint32_t n);
/* Pages a device reads or writes: from the DMA window if the VMM gave one. */
void *alloc_dma_pages(uint32_t n);
/* Sleep until cond(arg) holds, acknowledging device interrupts (agent.c);
 * fail(err) after the agent's wait limit. */
void wait_until(int (*cond)(void *), void *arg, uint32_t err);
/* The same for a cond that reads device registers: cond runs at CPL0, the
 * wait is one kernel call, `report` (if not 0) is reported when it ends. */
void wait_until_dev(int (*cond)(void *), void *arg, uint32_t err, uint8_t report);

/* Transport (virtio.c). virtq_alloc gives a queue its page (size VQ_SIZE
 * until the device says otherwise); the driver may then fill descriptors
 * and post buffers (virtq_post's ring entries, avail_idx) before
 * virtio_init. virtio_init reports `report` (if not 0), resets the device,
 * checks its id, negotiates `wanted` (plus VERSION_1), sets up the nq
 * queues q[i] (q[i]->index is the queue's index on the device), publishes
 * what was posted, sets DRIVER_OK, notifies the queues with buffers and
 * reports `report_after` (if not 0); returns the negotiated features. The
 * reports ride on the same kernel call: agent events around the init. */
struct virtio_init {
  uint64_t base, wanted;
  uint32_t device_id;
  uint8_t report, report_after;
  uint16_t nq;
  struct virtq *q[2];
  /* Run first in the same kernel call (0: none): the interrupt set-up. */
  uint64_t (*first)(void *);
  void *first_arg;
  uint64_t features; /* out */
};
void virtq_alloc(struct virtq *q, uint16_t index);
uint64_t virtio_init(struct virtio_init *v);
void virtq_post(struct virtq *q, uint16_t id);
void virtq_notify(uint64_t base, struct virtq *q);
/* The notify at the agent's next sleep instead of now (k_sleep; wait_until
 * sends it if it returns without sleeping): a request and the wait for its
 * answer in one kernel call. */
void virtq_notify_later(uint64_t base, struct virtq *q);
/* At CPL0: the deferred notify, if one is pending (k_sleep). */
void virtq_flush_later(void);
int virtq_later_pending(void);
void virtio_ack_irq(uint64_t base);
int virtio_needs_reset(uint64_t base);
/* DEVICE_NEEDS_RESET of this device is awaited, not a failure, until its next virtio_init. */
void virtio_await_reset(uint64_t base);

/* `report`, `report_after`: agent events reported in the same kernel call,
 * before and after the init (0: none); `irq_setup` (if not 0) runs first in
 * that call with `irq_arg`. */
void vnet_init(struct vnet *n, const struct boot_dev *d, int touch_rx, uint8_t report,
               uint8_t report_after, uint64_t (*irq_setup)(void *), void *irq_arg);
int vnet_link_up(void *n);
int vnet_tx_idle(void *n);
uint8_t *vnet_tx_frame(struct vnet *n);
void vnet_send(struct vnet *n, uint32_t frame_len);
int vnet_rx(struct vnet *n, uint8_t **frame, uint32_t *len);
void vnet_rx_done(struct vnet *n);
void vnet_read_mac(struct vnet *n, uint8_t mac[6]);
int vnet_needs_reset(void *n);
void vnet_send_bad(struct vnet *n);

void vblk_init(struct vblk *b, const struct boot_dev *d);
uint8_t vblk_request(struct vblk *b, uint32_t type, uint64_t sector, void *buf, uint32_t len);

#endif
