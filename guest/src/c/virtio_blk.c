/* virtio-blk driver over virtio-mmio version 2, ixy-style: one request
 * queue, one request in flight (the agent has nothing else to do while it
 * waits), three descriptors per request: header, data, status. */
#include "agent.h"
#include "virtio.h"

void vblk_init(struct vblk *b, const struct boot_dev *d) {
  b->base = d->mmio_base;
  virtq_alloc(&b->q, 0);
  /* Header and status live in one page of their own. */
  uint8_t *page = alloc_pages(1);
  b->hdr = (struct virtio_blk_req *)page;
  b->status = page + sizeof(struct virtio_blk_req);
  b->q.desc[0].addr = (uint64_t)b->hdr;
  b->q.desc[0].len = sizeof(struct virtio_blk_req);
  b->q.desc[2].addr = (uint64_t)b->status;
  b->q.desc[2].len = 1;
  b->q.desc[2].flags = VIRTQ_DESC_F_WRITE;
  struct virtio_init v = {
      .base = b->base,
      .wanted = VIRTIO_BLK_F_RO | VIRTIO_BLK_F_FLUSH,
      .device_id = VIRTIO_ID_BLOCK,
      .nq = 1,
      .q = {&b->q},
  };
  b->features = virtio_init(&v);
  b->sectors = *(volatile uint64_t *)(b->base + VIRTIO_MMIO_CONFIG + VIRTIO_BLK_CFG_CAPACITY);
}

static int vblk_done(void *arg) {
  struct vblk *b = arg;
  return b->q.used->idx != b->q.last_used;
}

/* One request: IN/OUT of `len` bytes (a multiple of 512) at `sector`, or
 * FLUSH (len 0). Returns the device's status byte (VIRTIO_BLK_S_OK = 0). */
uint8_t vblk_request(struct vblk *b, uint32_t type, uint64_t sector, void *buf, uint32_t len) {
  struct virtq *q = &b->q;
  b->hdr->type = type;
  b->hdr->reserved = 0;
  b->hdr->sector = sector;
  *b->status = 0xff;
  if (len) {
    q->desc[0].flags = VIRTQ_DESC_F_NEXT;
    q->desc[0].next = 1;
    q->desc[1].addr = (uint64_t)buf;
    q->desc[1].len = len;
    q->desc[1].flags = VIRTQ_DESC_F_NEXT | (type == VIRTIO_BLK_T_IN ? VIRTQ_DESC_F_WRITE : 0);
    q->desc[1].next = 2;
  } else {
    q->desc[0].flags = VIRTQ_DESC_F_NEXT;
    q->desc[0].next = 2;
  }
  virtq_post(q, 0);
  virtq_notify(b->base, q);
  wait_until(vblk_done, b, ERR_BLK_TIMEOUT);
  barrier();
  volatile struct virtq_used_elem *e = &q->used->ring[q->last_used % q->num];
  q->last_used++;
  if (e->id != 0) fail(ERR_QUEUE); /* device returned a descriptor we never posted */
  return *b->status;
}
