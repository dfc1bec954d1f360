/* Warp-pipe driver (docs/sgiov.md section 7): init, open, send, recv,
 * close over one SG function. The guest trusts its device; the device
 * checks everything written here. Waiting is the caller's (wait_until with
 * sg_poll in the condition): the device's interrupt wakes the agent. */
#include "agent.h"
#include "sg.h"

/* ---- Cross-FIFO ----------------------------------------------------------- */

static uint64_t sig_word(uint32_t type, uint16_t ring, uint32_t ptr) {
  return (uint64_t)type << 48 | (uint64_t)ring << 32 | ptr;
}

/* Ring the doorbell: the kick of virtqueue 1 is the device's g2d notification. */
static void doorbell(struct sgdev *d) { virtq_notify(d->base, &d->signal); }

static int g2d_has_space(void *arg) {
  struct sgdev *d = arg;
  sg_poll(d);
  return d->g2d->prod - d->g2d->cons < SG_FIFO_ENTRIES;
}

/* Producer step (section 3): a full FIFO sets BACKLOG, flushes and waits
 * for the device to drain it (it notifies us when it sees BACKLOG). */
static void push(struct sgdev *d, uint32_t type, uint16_t ring, uint32_t ptr) {
  volatile struct sg_fifo *f = d->g2d;
  uint32_t prod = f->prod;
  if (prod - f->cons >= SG_FIFO_ENTRIES) {
    f->pflags = SG_FIFO_BACKLOG;
    sg_flush(d);
    wait_until(g2d_has_space, d, ERR_SG_TIMEOUT);
    f->pflags = 0;
  }
  f->slot[prod & (SG_FIFO_ENTRIES - 1)] = sig_word(type, ring, ptr);
  barrier(); /* x86 keeps stores in order; the slot is written before prod */
  f->prod = prod + 1;
}

void sg_flush(struct sgdev *d) {
  volatile struct sg_fifo *f = d->g2d;
  uint32_t prod = f->prod;
  mfence();
  uint32_t cflags = f->cflags, event = f->event_idx;
  /* virtio's vring_need_event: did this burst move prod past event_idx? */
  if (!(cflags & SG_FIFO_NO_NOTIFY) && (uint32_t)(prod - event - 1) < (uint32_t)(prod - d->g2d_flushed))
    doorbell(d);
  d->g2d_flushed = prod;
}

/* ---- control rings ---------------------------------------------------------- */

static int req_space(void *arg) {
  struct sgdev *d = arg;
  sg_poll(d);
  return SG_RING_SIZE - (d->req.ours - d->req.theirs) >= sizeof(struct sg_ctrl);
}

static uint32_t request(struct sgdev *d, const struct sg_ctrl *m) {
  struct sg_ring *r = &d->req;
  if (SG_RING_SIZE - (r->ours - r->theirs) < sizeof *m) { /* wait for the device to take some */
    sg_flush(d);
    wait_until(req_space, d, ERR_SG_TIMEOUT);
  }
  struct sg_ctrl *slot = (struct sg_ctrl *)(r->base + (r->ours & (SG_RING_SIZE - 1)));
  *slot = *m;
  slot->req_id = d->next_req++;
  r->ours += sizeof *m;
  push(d, SG_SIG_HEAD, r->id, r->ours);
  return slot->req_id;
}

/* Replies up to the device's head of ring 1, then tell it how far we read. */
static void take_replies(struct sgdev *d) {
  struct sg_ring *r = &d->rep;
  if (r->ours == r->theirs) return;
  while (r->ours != r->theirs) {
    const struct sg_ctrl *m = (const struct sg_ctrl *)(r->base + (r->ours & (SG_RING_SIZE - 1)));
    if (m->op & SG_OP_REPLY) {
      d->reply_id[m->req_id & 255] = m->req_id;
      d->reply_status[m->req_id & 255] = m->status;
    }
    r->ours += sizeof *m;
  }
  push(d, SG_SIG_TAIL, r->id, r->ours);
  sg_flush(d);
}

int sg_reply(struct sgdev *d, uint32_t req_id, uint32_t *status) {
  if (d->reply_id[req_id & 255] != req_id) return 0;
  *status = d->reply_status[req_id & 255];
  return 1;
}

/* ---- interrupt work: the device's signals ---------------------------------- */

static void on_word(struct sgdev *d, uint64_t w) {
  uint32_t type = (uint32_t)(w >> 48), ptr = (uint32_t)w;
  uint16_t ring = (uint16_t)(w >> 32);
  if (ring == d->req.id && type == SG_SIG_TAIL) { d->req.theirs = ptr; return; }
  if (ring == d->rep.id && type == SG_SIG_HEAD) { d->rep.theirs = ptr; return; }
  uint32_t k = (ring - 2u) / 2;
  if (ring < 2 || k >= d->nsocks) return; /* not ours: ignore */
  struct sg_sock *s = &d->socks[k];
  if (type == SG_SIG_TAIL && ring == s->tx.id) s->tx.theirs = ptr;
  else if (type == SG_SIG_HEAD && ring == s->rx.id) s->rx.theirs = ptr;
  else if (type == SG_SIG_ERROR) s->error = ptr ? ptr : 1;
  else if (type == SG_SIG_CLOSED) s->error = 0xffff;
}

/* Consumer (section 3): drain, tell a backlogged device, arm, re-check. */
void sg_poll(struct sgdev *d) {
  volatile struct sg_fifo *f = d->d2g;
  for (;;) {
    uint32_t prod = f->prod, cons = f->cons;
    barrier();
    if (prod - cons > SG_FIFO_ENTRIES) fail(ERR_SG_RING); /* device corrupted its FIFO */
    for (; cons != prod; cons++) on_word(d, f->slot[cons & (SG_FIFO_ENTRIES - 1)]);
    f->cons = cons;
    if (f->pflags & SG_FIFO_BACKLOG) doorbell(d);
    f->event_idx = cons;
    f->cflags = 0;
    mfence();
    if (f->prod == cons) break;
  }
  take_replies(d);
}

/* ---- init ------------------------------------------------------------------- */

static int setup_done(void *arg) {
  struct sgdev *d = arg;
  return d->setup.used->idx != d->setup.last_used;
}

/* The ring's memory comes with its slot (allocated on the slot's first use);
 * (re)opening publishes a fresh descriptor. */
static void ring_desc(struct sgdev *d, struct sg_ring *r, uint16_t id, uint32_t role) {
  if (!r->base) r->base = alloc_pages(SG_RING_SIZE / 4096);
  r->id = id;
  r->ours = r->theirs = 0;
  d->table[id] = (struct sg_ring_desc){(uint64_t)r->base, SG_RING_SIZE, role, 0, 0, 0, 0};
}

void sg_init(struct sgdev *d, const struct boot_dev *bd, uint32_t max_socks) {
  memset(d, 0, sizeof *d);
  if (max_socks > SG_MAX_SOCKS) fail(ERR_SG_DEVICE);
  d->base = bd->mmio_base;
  virtq_alloc(&d->setup, 0);
  virtq_alloc(&d->signal, 1);
  struct virtio_init v = {
      .base = d->base, .device_id = SG_DEVICE_ID, .nq = 2, .q = {&d->setup, &d->signal}};
  virtio_init(&v);
  uint32_t socks_len = max_socks * (uint32_t)sizeof(struct sg_sock);
  d->socks = alloc_pages((socks_len + 4095) / 4096);
  memset(d->socks, 0, socks_len); /* no ring memory yet: allocated on a slot's first use */
  d->free_slot = alloc_pages((max_socks * 2 + 4095) / 4096);

  /* The area, canonical layout: header, g2d FIFO, d2g FIFO, ring table. */
  uint32_t fifo = 128 + 8 * SG_FIFO_ENTRIES, entries = 2 + 2 * max_socks;
  uint32_t table_off = 128 + 2 * fifo, len = (table_off + 32 * entries + 4095) & ~4095u;
  d->area = alloc_pages(len / 4096);
  *d->area = (struct sg_area){.magic = SG_AREA_MAGIC, .version = 1, .area_len = len,
                              .g2d_off = 128, .g2d_entries = SG_FIFO_ENTRIES,
                              .d2g_off = 128 + fifo, .d2g_entries = SG_FIFO_ENTRIES,
                              .table_off = table_off, .table_entries = entries};
  d->g2d = (void *)((uint8_t *)d->area + 128);
  d->d2g = (void *)((uint8_t *)d->area + 128 + fifo);
  d->table = (void *)((uint8_t *)d->area + table_off);
  d->d2g->watermark = 1; /* notify on the first word: the agent sleeps until then */
  ring_desc(d, &d->req, 0, SG_ROLE_TX);
  ring_desc(d, &d->rep, 1, SG_ROLE_RX);
  d->next_req = 1;

  /* Attach: a readable setup command and a writable status on queue 0. */
  uint8_t *page = alloc_pages(1);
  struct sg_setup *cmd = (struct sg_setup *)page;
  volatile uint32_t *status = (volatile uint32_t *)(page + 64);
  *cmd = (struct sg_setup){SG_SETUP_MAGIC, 1, (uint64_t)d->area, len, {0}};
  *status = 0xffffffffu;
  d->setup.desc[0] = (struct virtq_desc){(uint64_t)cmd, sizeof *cmd, VIRTQ_DESC_F_NEXT, 1};
  d->setup.desc[1] = (struct virtq_desc){(uint64_t)status, 4, VIRTQ_DESC_F_WRITE, 0};
  virtq_post(&d->setup, 0);
  virtq_notify(d->base, &d->setup);
  wait_until(setup_done, d, ERR_SG_TIMEOUT);
  d->setup.last_used++;
  if (*status != 0 || d->area->dev_state != 1) {
    report_data(EV_VALUE, *status);
    fail(ERR_SG_DEVICE);
  }
  d->nsocks = max_socks;
}

/* ---- the socket-shaped API ------------------------------------------------- */

static struct sg_sock *sock_of(struct sgdev *d, uint16_t sock) {
  uint32_t k = (sock - 2u) / 2;
  if (sock < 2 || k >= d->nsocks || d->socks[k].tx.id != sock) fail(ERR_SG_RING);
  return &d->socks[k];
}

/* A socket takes a closed slot if there is one (its ring ids are free again once
 * the device answered the close: sg_release), else the next new one: ring ids stay
 * below 2 + 2 * max_socks however often sockets are opened and closed. */
uint32_t sg_open(struct sgdev *d, uint16_t *sock) {
  uint32_t k;
  if (d->nfree) k = d->free_slot[--d->nfree];
  else if (d->nslots < d->nsocks) k = d->nslots++;
  else fail(ERR_NO_MEMORY);
  struct sg_sock *s = &d->socks[k];
  ring_desc(d, &s->tx, (uint16_t)(2 + 2 * k), SG_ROLE_TX);
  ring_desc(d, &s->rx, (uint16_t)(3 + 2 * k), SG_ROLE_RX);
  s->error = 0;
  *sock = s->tx.id;
  return request(d, &(struct sg_ctrl){.op = SG_OP_OPEN, .sock = s->tx.id, .aux = s->rx.id});
}

void sg_release(struct sgdev *d, uint16_t sock) {
  struct sg_sock *s = sock_of(d, sock);
  s->tx.id = 0; /* sock_of refuses it until it is opened again */
  d->free_slot[d->nfree++] = (uint16_t)((sock - 2u) / 2);
}

/* Port 0 is the device's echo: what the socket sends comes back on it. */
uint32_t sg_connect(struct sgdev *d, uint16_t sock, uint32_t port) {
  sock_of(d, sock);
  return request(d, &(struct sg_ctrl){.op = SG_OP_CONNECT, .sock = sock, .port = port,
                                      .path = SG_PATH_DIRECT});
}

/* A chain to another sandbox's listener (docs/sgiov.md 14.1): xf 0 copy,
 * 1 crypto (AES-GCM into the daemon's staging ring and out of it); always
 * staged, which crypto needs. */
uint32_t sg_connect_xf(struct sgdev *d, uint16_t sock, uint32_t port, uint8_t xf) {
  sock_of(d, sock);
  return request(d, &(struct sg_ctrl){.op = SG_OP_CONNECT, .sock = sock, .port = port, .xf = xf});
}

uint32_t sg_listen(struct sgdev *d, uint16_t sock, uint32_t port) {
  sock_of(d, sock);
  return request(d, &(struct sg_ctrl){.op = SG_OP_LISTEN, .sock = sock, .port = port});
}

/* The reply comes when a CONNECT is paired with `sock` (an open socket). */
uint32_t sg_accept(struct sgdev *d, uint16_t listener, uint16_t sock) {
  sock_of(d, listener);
  sock_of(d, sock);
  return request(d, &(struct sg_ctrl){.op = SG_OP_ACCEPT, .sock = listener, .aux = sock});
}

/* The peer closed (a CLOSED word), or the ring is in error: its code. */
uint32_t sg_sock_error(struct sgdev *d, uint16_t sock) { return sock_of(d, sock)->error; }

/* After the reply the device no longer touches the socket's rings. */
uint32_t sg_close(struct sgdev *d, uint16_t sock) {
  sock_of(d, sock);
  return request(d, &(struct sg_ctrl){.op = SG_OP_CLOSE, .sock = sock});
}

uint32_t sg_tx_space(struct sgdev *d, uint16_t sock) {
  struct sg_sock *s = sock_of(d, sock);
  return SG_RING_SIZE - (s->tx.ours - s->tx.theirs);
}

uint32_t sg_rx_ready(struct sgdev *d, uint16_t sock) {
  struct sg_sock *s = sock_of(d, sock);
  if (s->error) { report_data(EV_VALUE, s->error); fail(ERR_SG_RING); }
  return s->rx.theirs - s->rx.ours;
}

/* Copy into the TX ring at head (two pieces if it wraps), publish the head. */
uint32_t sg_send(struct sgdev *d, uint16_t sock, const uint8_t *buf, uint32_t len) {
  struct sg_sock *s = sock_of(d, sock);
  uint32_t n = sg_tx_space(d, sock);
  if (n > len) n = len;
  for (uint32_t i = 0; i < n; i++) s->tx.base[(s->tx.ours + i) & (SG_RING_SIZE - 1)] = buf[i];
  if (!n) return 0;
  s->tx.ours += n;
  d->table[s->tx.id].guest_ptr = s->tx.ours;
  push(d, SG_SIG_HEAD, s->tx.id, s->tx.ours);
  return n;
}

/* Copy out of the RX ring at tail, publish the tail. */
uint32_t sg_recv(struct sgdev *d, uint16_t sock, uint8_t *buf, uint32_t len) {
  struct sg_sock *s = sock_of(d, sock);
  uint32_t n = sg_rx_ready(d, sock);
  if (n > len) n = len;
  for (uint32_t i = 0; i < n; i++) buf[i] = s->rx.base[(s->rx.ours + i) & (SG_RING_SIZE - 1)];
  if (!n) return 0;
  s->rx.ours += n;
  d->table[s->rx.id].guest_ptr = s->rx.ours;
  push(d, SG_SIG_TAIL, s->rx.id, s->rx.ours);
  return n;
}
