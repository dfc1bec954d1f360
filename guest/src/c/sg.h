/* Warp-pipe driver for burstvm's SG function (docs/sgiov.md sections 2-8):
 * the shared area (Cross-FIFO + ring table), the control rings, and the
 * socket-shaped API on top: init, open, connect, send, recv, close. The
 * Rust `sgiov::driver::Driver` is the reference; this is the same, in C. */
#ifndef SG_H
#define SG_H
#include <stdint.h>
#include "virtio.h"

#define SG_DEVICE_ID 0x5347          /* virtio-mmio device id (sgiov::layout::VIRTIO_DEVICE_ID) */
#define SG_MAX_SOCKS 4096            /* sockets open at once (--sg-pipes bound): 32 MiB of rings */
#define SG_RING_SIZE 4096            /* every ring: the smallest the device takes */
#define SG_FIFO_ENTRIES 256          /* Cross-FIFO slots per direction */

/* The shared-memory contract (docs/sgiov.md section 2). */
#define SG_AREA_MAGIC 0x315241564F494753ULL /* "SGIOVAR1" */
#define SG_SETUP_MAGIC 0x55534753u          /* "SGSU" */
struct sg_area {
  uint64_t magic;
  uint32_t version, area_len;
  uint32_t g2d_off, g2d_entries, d2g_off, d2g_entries, table_off, table_entries;
  uint32_t reserved[6];
  uint32_t dev_state, dev_error; /* device-written */
  uint32_t dev_reserved[14];
};
struct sg_fifo {
  uint32_t prod, pflags, prod_reserved[14];
  uint32_t cons, event_idx, cflags, watermark, cons_reserved[12];
  uint64_t slot[];
};
#define SG_FIFO_BACKLOG 1   /* pflags */
#define SG_FIFO_NO_NOTIFY 1 /* cflags */
struct sg_ring_desc { uint64_t base; uint32_t size, role, guest_ptr, dev_ptr, state, error; };
#define SG_ROLE_TX 1 /* the guest produces */
#define SG_ROLE_RX 2 /* the device produces */
struct sg_ctrl {
  uint16_t op, flags;
  uint32_t req_id, status;
  uint16_t sock, aux;
  uint32_t port;
  uint8_t prio, xf, path, reserved0;
  uint16_t peer_sock, reserved1;
  uint32_t reserved[9];
};
#define SG_STATUS_REFUSED 10
enum { SG_OP_OPEN = 1, SG_OP_LISTEN = 2, SG_OP_CONNECT = 3, SG_OP_ACCEPT = 4, SG_OP_CLOSE = 5 };
#define SG_OP_REPLY 0x80
#define SG_PATH_DIRECT 1
struct sg_setup { uint32_t magic, op; uint64_t area_gpa; uint32_t area_len, reserved[3]; };

/* Signal words: type 63..48, ring id 47..32, pointer 31..0. */
enum { SG_SIG_HEAD = 1, SG_SIG_TAIL = 2, SG_SIG_ERROR = 3, SG_SIG_CLOSED = 4 };

struct sg_ring {
  uint8_t *base;
  uint16_t id;
  uint32_t ours;   /* head of a TX ring, tail of an RX ring */
  uint32_t theirs; /* the device's: tail of a TX ring, head of an RX ring */
};
struct sg_sock { struct sg_ring tx, rx; uint32_t error; };

struct sgdev {
  uint64_t base;                    /* MMIO base */
  struct virtq setup, signal;       /* virtqueues 0 and 1 */
  struct sg_area *area;
  volatile struct sg_fifo *g2d, *d2g;
  volatile struct sg_ring_desc *table;
  uint32_t g2d_flushed;             /* g2d prod at the last flush */
  struct sg_ring req, rep;          /* control rings 0 and 1 */
  uint32_t next_req;
  uint32_t reply_id[256], reply_status[256]; /* by req_id % 256 */
  uint32_t nsocks, nslots;           /* table room, slots with ring memory so far */
  uint32_t nfree;                    /* closed slots, reused before a new one */
  /* Both sized by sg_init's max_socks, on the heap: the agent image stays small. */
  uint16_t *free_slot;
  struct sg_sock *socks;             /* slot k: TX ring 2 + 2k, RX ring 3 + 2k */
};

void sg_init(struct sgdev *d, const struct boot_dev *bd, uint32_t max_socks);
/* Requests return their req_id; the reply is awaited with sg_reply. */
uint32_t sg_open(struct sgdev *d, uint16_t *sock);
uint32_t sg_connect(struct sgdev *d, uint16_t sock, uint32_t port);
uint32_t sg_close(struct sgdev *d, uint16_t sock);
/* After the close's reply: the socket's ring ids and memory go to the next sg_open. */
void sg_release(struct sgdev *d, uint16_t sock);
/* Chains between sandboxes (docs/sgiov.md 14.1). */
uint32_t sg_connect_xf(struct sgdev *d, uint16_t sock, uint32_t port, uint8_t xf);
uint32_t sg_listen(struct sgdev *d, uint16_t sock, uint32_t port);
uint32_t sg_accept(struct sgdev *d, uint16_t listener, uint16_t sock);
#define SG_CLOSED 0xffff /* sg_sock_error: the peer closed */
uint32_t sg_sock_error(struct sgdev *d, uint16_t sock);
/* Bytes queued / taken (at most what fits / what is there). */
uint32_t sg_send(struct sgdev *d, uint16_t sock, const uint8_t *buf, uint32_t len);
uint32_t sg_recv(struct sgdev *d, uint16_t sock, uint8_t *buf, uint32_t len);
uint32_t sg_tx_space(struct sgdev *d, uint16_t sock);
uint32_t sg_rx_ready(struct sgdev *d, uint16_t sock);
/* End of a burst: ring the doorbell if the device asked to be told. */
void sg_flush(struct sgdev *d);
/* Interrupt work: drain the device's signals (also safe to call when polling). */
void sg_poll(struct sgdev *d);
/* The reply to req_id has arrived: 1 and its status in *status, else 0. */
int sg_reply(struct sgdev *d, uint32_t req_id, uint32_t *status);

#endif
