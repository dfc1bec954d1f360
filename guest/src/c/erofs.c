/* EROFS reader (see erofs.h). On-disk format: linux/fs/erofs/erofs_fs.h.
 *
 *   image:  [0,1024) unused | superblock at 1024 | ... blocks of blksz bytes
 *   inode:  at meta_off + nid * 32; compact (32 bytes) or extended (64)
 *   data:   FLAT_PLAIN  = size bytes from block raw_blkaddr on
 *           FLAT_INLINE = size / blksz full blocks from raw_blkaddr, then the
 *                         tail (size % blksz) right after the inode + xattrs
 *   dir:    data blocks of { le64 nid; le16 nameoff; u8 type; u8 rsv } entries,
 *           names packed after them; entry 0's nameoff / 12 = entries in block
 */
#include "erofs.h"
#include "csum.h"

#define LAYOUT_FLAT_PLAIN 0
#define LAYOUT_FLAT_INLINE 2
#define DIRENT_SIZE 12
/* Incompatible features this reader can live with (LZ4_0PADDING only
 * concerns compressed files, which read_inode refuses). */
#define INCOMPAT_OK 0x1u

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const uint8_t *p) { return (uint32_t)le16(p) | (uint32_t)le16(p + 2) << 16; }
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

static int rd(struct erofs *fs, uint64_t off, void *buf, uint32_t len) {
  if (off > fs->size || len > fs->size - off) return EROFS_EBADFS;
  return fs->read(fs->ctx, off, buf, len) ? EROFS_EIO : EROFS_OK;
}

int erofs_mount(struct erofs *fs, erofs_read_fn read, void *ctx, uint8_t *scratch) {
  uint8_t *sb = scratch;
  fs->read = read;
  fs->ctx = ctx;
  fs->blk = scratch;
  fs->size = EROFS_SUPER_OFFSET + 128; /* until the superblock says more */
  int e = rd(fs, EROFS_SUPER_OFFSET, sb, 128);
  if (e) return e;
  if (le32(sb) != EROFS_MAGIC) return EROFS_EBADFS;
  if (sb[12] != 12) return EROFS_EBADFS; /* blkszbits: only 4 KiB blocks */
  if (le32(sb + 80) & ~INCOMPAT_OK) return EROFS_EBADFS;
  fs->blksz = 4096;
  fs->root_nid = le16(sb + 14);
  fs->size = (uint64_t)le32(sb + 36) * fs->blksz;
  fs->meta_off = (uint64_t)le32(sb + 40) * fs->blksz;
  if (fs->size < EROFS_SUPER_OFFSET + 128 || fs->meta_off >= fs->size) return EROFS_EBADFS;
  return EROFS_OK;
}

int erofs_read_inode(struct erofs *fs, uint64_t nid, struct erofs_inode *out) {
  uint8_t raw[64];
  if (nid > (fs->size - fs->meta_off) / 32) return EROFS_EBADFS;
  uint64_t off = fs->meta_off + nid * 32;
  int e = rd(fs, off, raw, 32);
  if (e) return e;
  uint16_t format = le16(raw);
  int extended = format & 1;
  uint32_t isize = extended ? 64 : 32;
  if (extended && (e = rd(fs, off + 32, raw + 32, 32))) return e;
  out->nid = nid;
  out->layout = (format >> 1) & 7;
  out->mode = le16(raw + 4);
  out->size = extended ? le64(raw + 8) : le32(raw + 8);
  uint16_t icount = le16(raw + 2);
  uint32_t xattr_size = icount ? 12 + 4 * (uint32_t)(icount - 1) : 0;
  out->data_off = (uint64_t)le32(raw + 16) * fs->blksz;
  out->tail_off = off + isize + xattr_size;

  uint64_t full = out->size, tail = 0;
  if (out->layout == LAYOUT_FLAT_INLINE) {
    tail = out->size % fs->blksz;
    full = out->size - tail;
    /* The tail sits in the inode's block. */
    if (out->tail_off % fs->blksz + tail > fs->blksz || out->tail_off + tail > fs->size)
      return EROFS_EBADFS;
  } else if (out->layout != LAYOUT_FLAT_PLAIN) {
    return EROFS_EBADFS; /* compressed or chunk-based */
  }
  if (full && (out->data_off > fs->size || full > fs->size - out->data_off)) return EROFS_EBADFS;
  return EROFS_OK;
}

int erofs_read(struct erofs *fs, const struct erofs_inode *ino, uint64_t off, void *buf, uint32_t len) {
  if (off > ino->size || len > ino->size - off) return EROFS_EBADFS;
  uint64_t full = ino->size;
  if (ino->layout == LAYOUT_FLAT_INLINE) full -= ino->size % fs->blksz;
  uint8_t *p = buf;
  if (off < full) {
    uint32_t n = (uint32_t)(full - off < len ? full - off : len);
    int e = rd(fs, ino->data_off + off, p, n);
    if (e) return e;
    p += n, off += n, len -= n;
  }
  return len ? rd(fs, ino->tail_off + (off - full), p, len) : EROFS_OK;
}

static int name_eq(const uint8_t *a, uint32_t alen, const char *b, uint32_t blen) {
  if (alen != blen) return 0;
  for (uint32_t i = 0; i < alen; i++)
    if (a[i] != (uint8_t)b[i]) return 0;
  return 1;
}

/* Finds `name` (len bytes) in directory `dir`; sets *nid. */
static int dir_lookup(struct erofs *fs, const struct erofs_inode *dir, const char *name, uint32_t len,
                      uint64_t *nid) {
  uint8_t *b = fs->blk;
  for (uint64_t at = 0; at < dir->size; at += fs->blksz) {
    uint32_t blen = (uint32_t)(dir->size - at < fs->blksz ? dir->size - at : fs->blksz);
    int e = erofs_read(fs, dir, at, b, blen);
    if (e) return e;
    if (blen < DIRENT_SIZE) return EROFS_EBADFS;
    uint32_t first = le16(b + 8);
    if (first < DIRENT_SIZE || first % DIRENT_SIZE || first > blen) return EROFS_EBADFS;
    uint32_t n = first / DIRENT_SIZE;
    for (uint32_t i = 0; i < n; i++) {
      uint32_t start = le16(b + i * DIRENT_SIZE + 8);
      uint32_t end = i + 1 < n ? le16(b + (i + 1) * DIRENT_SIZE + 8) : blen;
      if (start < first || end < start || end > blen) return EROFS_EBADFS;
      /* The last name of a block may be NUL-padded to the block's end. */
      while (i + 1 == n && end > start && b[end - 1] == 0) end--;
      if (name_eq(b + start, end - start, name, len)) {
        *nid = le64(b + i * DIRENT_SIZE);
        return EROFS_OK;
      }
    }
  }
  return EROFS_ENOENT;
}

int erofs_lookup(struct erofs *fs, const char *path, struct erofs_inode *out) {
  int e = erofs_read_inode(fs, fs->root_nid, out);
  while (!e) {
    while (*path == '/') path++;
    if (!*path) return EROFS_OK;
    uint32_t len = 0;
    while (path[len] && path[len] != '/') len++;
    if ((out->mode & EROFS_S_IFMT) != EROFS_S_IFDIR) return EROFS_ENOTDIR;
    uint64_t nid;
    if ((e = dir_lookup(fs, out, path, len, &nid))) return e;
    e = erofs_read_inode(fs, nid, out);
    path += len;
  }
  return e;
}

int erofs_checksum(struct erofs *fs, const struct erofs_inode *ino, uint32_t *sum) {
  struct csum c = {0};
  for (uint64_t at = 0; at < ino->size; at += fs->blksz) {
    uint32_t n = (uint32_t)(ino->size - at < fs->blksz ? ino->size - at : fs->blksz);
    int e = erofs_read(fs, ino, at, fs->blk, n);
    if (e) return e;
    csum_add(&c, fs->blk, n);
  }
  *sum = csum_fold(&c);
  return EROFS_OK;
}
