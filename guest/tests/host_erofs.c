/* Host harness for the agent's EROFS reader (src/c/erofs.c), driven by
 * tests/host_c.rs: `host_erofs IMAGE PATH...` prints, per path,
 * "PATH ok SIZE CHECKSUM" or "PATH err CODE"; a mount error prints
 * "mount err CODE" and exits 3. */
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include "../src/c/erofs.h"

static int read_file(void *ctx, uint64_t off, void *buf, uint32_t len) {
  int fd = *(int *)ctx;
  return pread(fd, buf, len, (off_t)off) == (ssize_t)len ? 0 : -1;
}

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  int fd = open(argv[1], O_RDONLY);
  if (fd < 0) return 2;
  static uint8_t scratch[4096];
  struct erofs fs;
  int e = erofs_mount(&fs, read_file, &fd, scratch);
  if (e) {
    printf("mount err %d\n", e);
    return 3;
  }
  for (int i = 2; i < argc; i++) {
    struct erofs_inode ino;
    uint32_t sum = 0;
    e = erofs_lookup(&fs, argv[i], &ino);
    if (!e) e = erofs_checksum(&fs, &ino, &sum);
    if (e)
      printf("%s err %d\n", argv[i], e);
    else
      printf("%s ok %llu %08x\n", argv[i], (unsigned long long)ino.size, sum);
  }
  return 0;
}
