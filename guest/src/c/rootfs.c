/* The rootfs proof (RunD §4.2): the app finds a named file in the shared
 * read-only EROFS layer — a read-only virtio-blk disk, or (pmem mode) an
 * image the VMM put in guest memory — and reports its checksum; then it
 * writes a marker into sector 0 of the writable layer (ext4 leaves the
 * first 1 KiB unused), reporting what was there first: a fresh layer
 * (a reflink of the template) has zeros, never another sandbox's marker. */
#include "agent.h"
#include "csum.h"
#include "erofs.h"
#include "rootfs.h"
#include "virtio.h"

#define MARKER_MAGIC "BURSTVM-MARKER"

static struct vblk ro_disk, rw_disk;
static uint8_t *bounce; /* 4 KiB + a sector, for unaligned reads */
static const struct boot_info *rbi;

static uint8_t blk_io(struct vblk *b, uint32_t type, uint64_t sector, void *buf, uint32_t len) {
  uint8_t st = vblk_request(b, type, sector, buf, len);
  if (st != VIRTIO_BLK_S_OK) {
    report_data(EV_VALUE, st);
    fail(ERR_BLK_IO);
  }
  return st;
}

/* erofs_read_fn over the read-only disk: whole sectors straight into the
 * caller's buffer, anything else through the bounce buffer. */
static int disk_read(void *ctx, uint64_t off, void *buf, uint32_t len) {
  struct vblk *b = ctx;
  uint8_t *out = buf;
  if ((off | len) % SECTOR_SIZE == 0) {
    blk_io(b, VIRTIO_BLK_T_IN, off / SECTOR_SIZE, buf, len);
    return 0;
  }
  while (len) {
    uint32_t in = off % SECTOR_SIZE, n = 4096 - in;
    if (n > len) n = len;
    blk_io(b, VIRTIO_BLK_T_IN, off / SECTOR_SIZE, bounce, (in + n + SECTOR_SIZE - 1) & ~(SECTOR_SIZE - 1));
    memcpy(out, bounce + in, n);
    off += n, out += n, len -= n;
  }
  return 0;
}

/* erofs_read_fn over the image in guest memory (pmem mode). */
static int mem_read(void *ctx, uint64_t off, void *buf, uint32_t len) {
  (void)ctx;
  if (off > rbi->rootfs_len || len > rbi->rootfs_len - off) return -1;
  memcpy(buf, (const uint8_t *)(rbi->rootfs_gpa + off), len);
  return 0;
}

static void check_file(const struct boot_info *bi, struct vblk *ro) {
  static struct erofs fs;
  struct erofs_inode ino;
  uint32_t sum = 0;
  int e;
  if (bi->rootfs_gpa)
    e = erofs_mount(&fs, mem_read, 0, alloc_pages(1));
  else if (ro)
    e = erofs_mount(&fs, disk_read, ro, alloc_pages(1));
  else
    fail(ERR_NO_ROOTFS);
  if (!e) e = erofs_lookup(&fs, bi->rootfs_file, &ino);
  if (!e && (ino.mode & EROFS_S_IFMT) != EROFS_S_IFREG) e = EROFS_ENOENT;
  if (!e) e = erofs_checksum(&fs, &ino, &sum);
  if (e) {
    report_data(EV_VALUE, (uint32_t)e);
    fail(ERR_EROFS);
  }
  report_data(EV_ROOTFS_FILE, sum);
}

static void write_marker(const struct boot_info *bi, struct vblk *rw) {
  uint8_t *sec = bounce, *back = bounce + SECTOR_SIZE;
  blk_io(rw, VIRTIO_BLK_T_IN, 0, sec, SECTOR_SIZE);
  struct csum before = {0};
  csum_add(&before, sec, SECTOR_SIZE);
  memset(sec, 0, SECTOR_SIZE);
  memcpy(sec, MARKER_MAGIC, sizeof MARKER_MAGIC);
  memcpy(sec + 16, bi->sandbox_id, sizeof bi->sandbox_id);
  blk_io(rw, VIRTIO_BLK_T_OUT, 0, sec, SECTOR_SIZE);
  blk_io(rw, VIRTIO_BLK_T_FLUSH, 0, 0, 0);
  blk_io(rw, VIRTIO_BLK_T_IN, 0, back, SECTOR_SIZE);
  for (uint32_t i = 0; i < SECTOR_SIZE; i++)
    if (sec[i] != back[i]) fail(ERR_MARKER);
  report_data(EV_ROOTFS_MARKER, csum_fold(&before));
}

void rootfs_launch(const struct boot_info *bi) {
  if (bi->version < 2) return;
  rbi = bi;
  struct vblk *ro = 0, *rw = 0;
  /* The read-only disk is the EROFS layer, a writable one the volatile
   * layer, whatever order the VMM listed them in. */
  for (uint32_t i = 0; i < bi->n_dev && i < 4; i++) {
    if (bi->dev[i].virtio_type != VIRTIO_ID_BLOCK) continue;
    struct vblk b;
    vblk_init(&b, &bi->dev[i]);
    if ((b.features & VIRTIO_BLK_F_RO) && !ro)
      ro_disk = b, ro = &ro_disk;
    else if (!(b.features & VIRTIO_BLK_F_RO) && !rw)
      rw_disk = b, rw = &rw_disk;
  }
  if (!bi->rootfs_file[0] && !rw) return;
  bounce = alloc_pages(2);
  if (bi->rootfs_file[0]) check_file(bi, ro);
  if (rw) write_marker(bi, rw);
}
