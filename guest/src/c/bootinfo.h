/* Boot info block the VMM writes at GPA 0x7000 (docs/design.md, binding). */
#ifndef BOOTINFO_H
#define BOOTINFO_H
#include <stdint.h>

#define BOOTINFO_MAGIC 0x42555253544d5631ULL /* "BURSTVM1" */
/* Version 2 appends the rootfs fields, version 3 the SG fields, version 4
 * the SG chain fields, version 5 the DMA window. A reader
 * accepts any version >= 1 and reads the fields of version k only if
 * version >= k. */
#define BOOTINFO_VERSION 5

#define BI_ASYNC_VF_INIT 1
#define BI_PROBE_MODE 2
#define BI_TOUCH_RX 4
#define BI_ECHO 8          /* after READY keep exchanging requests (payload id + seq) */
#define BI_RESET_ONCE 16   /* after the first reply reset and re-init the device, then READY */
#define BI_FAULT_ONCE 32   /* as RESET_ONCE, but first make the VF fail (bad descriptor) */
#define BI_TEMPLATE 64      /* stop at the template checkpoint (docs/templates.md) */
#define BI_SG 128           /* warp pipes on the SG function (docs/sgiov.md); with BI_ECHO keep going */
#define BI_SG_SEND 256      /* with BI_SG: CONNECT to sg_port of another sandbox, send, check its echo */
#define BI_SG_RECV 512      /* with BI_SG: LISTEN on sg_port, accept, check, echo back */
#define BI_KERNEL_MODE 1024 /* do all the work at CPL0 (the agent's old way: an A/B of the CPL3 switch) */

struct boot_mem   { uint64_t base, size; };
struct boot_dev   { uint64_t mmio_base; uint32_t irq; uint32_t virtio_type; }; /* 1 net, 2 blk */
struct boot_info {
  uint64_t magic;
  uint32_t version;           /* BOOTINFO_VERSION */
  uint32_t flags;             /* BI_ASYNC_VF_INIT=1, BI_PROBE_MODE=2, BI_TOUCH_RX=4, BI_ECHO=8,
                                 BI_RESET_ONCE=16, BI_FAULT_ONCE=32, BI_TEMPLATE=64, BI_SG=128 */
  char     sandbox_id[64];    /* NUL-terminated */
  uint32_t n_mem, n_dev;
  struct boot_mem mem[4];     /* usable RAM ranges for the agent's allocator */
  struct boot_dev dev[4];
  uint64_t app_gpa, app_len;  /* app payload the agent checksums (app-launch) */
  uint8_t  mac[6], server_mac[6]; /* guest MAC; server MAC or all-zero = broadcast */
  uint32_t ip, netmask, gateway, server_ip; /* network byte order */
  uint16_t server_port, client_port;
  uint32_t n_probe;           /* probe mode: addresses to read and report */
  uint64_t probe_gpa[64];
  /* version 2: rootfs (docs/rootfs.md) */
  uint64_t rootfs_gpa, rootfs_len; /* EROFS image in guest memory (pmem mode); 0 = on the read-only disk */
  char     rootfs_file[128];       /* NUL-terminated path the agent checksums; "" = none */
  /* version 3: SG-IOV (docs/sgiov.md) */
  uint32_t sg_pipes, sg_bytes;     /* BI_SG: echo sockets to open, bytes through each */
  /* version 4: SG chain (docs/sgiov.md section 14.1) */
  uint32_t sg_port, sg_xf;         /* BI_SG_SEND/RECV: the port; CONNECT's transform (0 copy, 1 crypto) */
  /* version 5: the DMA window (vmm --dma-window): everything a device reads or
   * writes (rings, packet buffers) goes there; size 0 = anywhere in RAM */
  uint64_t dma_window_gpa, dma_window_size;
};

#endif
