/* The rootfs proof of the built-in agent (docs/rootfs.md). */
#ifndef ROOTFS_H
#define ROOTFS_H
#include "bootinfo.h"

/* Reports EV_ROOTFS_FILE (checksum of bi->rootfs_file in the EROFS layer)
 * when a file is named, and EV_ROOTFS_MARKER after writing the marker into
 * the writable layer when there is one. */
void rootfs_launch(const struct boot_info *bi);

#endif
