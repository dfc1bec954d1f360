/* A read-only EROFS reader just big enough to find a file by path and read
 * it (docs/guest.md): superblock, inodes (compact and extended), directory
 * blocks, and the two uncompressed data layouts (FLAT_PLAIN, FLAT_INLINE).
 * Images come from `burstvm rootfs build` (mkfs.erofs without compression
 * or xattrs). The image is read through a callback, so the same code works
 * on a virtio-blk disk, a memory-mapped image, or a file on the host
 * (tests/host_erofs.c). Every on-disk value is bounds-checked. */
#ifndef EROFS_H
#define EROFS_H
#include <stdint.h>

#define EROFS_SUPER_OFFSET 1024
#define EROFS_MAGIC 0xE0F5E1E2u

enum erofs_err {
  EROFS_OK = 0,
  EROFS_EIO = 1,      /* the read callback failed */
  EROFS_EBADFS = 2,   /* not EROFS, or a layout/feature this reader does not handle */
  EROFS_ENOENT = 3,   /* no such path */
  EROFS_ENOTDIR = 4,  /* a path component is not a directory */
};

/* Read `len` bytes at byte `off` of the image into `buf`; 0 on success. */
typedef int (*erofs_read_fn)(void *ctx, uint64_t off, void *buf, uint32_t len);

struct erofs {
  erofs_read_fn read;
  void *ctx;
  uint32_t blksz;      /* 4096 */
  uint64_t meta_off;   /* byte offset of the inode area (meta_blkaddr * blksz) */
  uint64_t size;       /* image size in bytes (blocks * blksz) */
  uint64_t root_nid;
  uint8_t *blk;        /* caller-provided scratch buffer of blksz bytes */
};

struct erofs_inode {
  uint64_t nid;
  uint16_t mode;       /* S_IFMT bits + permissions */
  uint8_t layout;      /* 0 = FLAT_PLAIN, 2 = FLAT_INLINE */
  uint64_t size;
  uint64_t data_off;   /* byte offset of block-aligned data */
  uint64_t tail_off;   /* FLAT_INLINE: byte offset of the inline tail */
};

#define EROFS_S_IFMT 0170000
#define EROFS_S_IFDIR 0040000
#define EROFS_S_IFREG 0100000

/* Reads and checks the superblock. `scratch` holds 4096 bytes. */
int erofs_mount(struct erofs *fs, erofs_read_fn read, void *ctx, uint8_t *scratch);
int erofs_read_inode(struct erofs *fs, uint64_t nid, struct erofs_inode *out);
/* Absolute path ("/etc/os-release"); symlinks are not followed. */
int erofs_lookup(struct erofs *fs, const char *path, struct erofs_inode *out);
/* Reads bytes [off, off+len) of a regular file or directory. */
int erofs_read(struct erofs *fs, const struct erofs_inode *ino, uint64_t off, void *buf, uint32_t len);
/* The agent checksum (docs/guest.md) of a whole file, read block by block. */
int erofs_checksum(struct erofs *fs, const struct erofs_inode *ino, uint32_t *sum);

#endif
