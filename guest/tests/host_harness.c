/* Host-side checks of the agent's frame code (net.c) and of the boot-info
 * layout, compiled with the host gcc by tests/host_c.rs. Prints one line
 * per check; exit status 0 only if all pass. */
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>
#include <string.h>
#include "../src/c/bootinfo.h"
#include "../src/c/net.h"

__attribute__((noreturn)) void fail(uint32_t code) { printf("fail %u\n", code); _exit(2); }

static int failures;
#define CHECK(c) do { if (!(c)) { printf("FAILED: %s (line %d)\n", #c, __LINE__); failures++; } } while (0)

static uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

int main(void) {
  /* Layout fixed by docs/design.md (the VMM asserts the same offsets). */
  CHECK(offsetof(struct boot_info, sandbox_id) == 16);
  CHECK(offsetof(struct boot_info, n_mem) == 80);
  CHECK(offsetof(struct boot_info, mem) == 88);
  CHECK(offsetof(struct boot_info, dev) == 152);
  CHECK(offsetof(struct boot_info, app_gpa) == 216);
  CHECK(offsetof(struct boot_info, mac) == 232);
  CHECK(offsetof(struct boot_info, ip) == 244);
  CHECK(offsetof(struct boot_info, server_port) == 260);
  CHECK(offsetof(struct boot_info, n_probe) == 264);
  CHECK(offsetof(struct boot_info, probe_gpa) == 272);
  CHECK(offsetof(struct boot_info, rootfs_gpa) == 784);
  CHECK(offsetof(struct boot_info, rootfs_file) == 800);
  CHECK(offsetof(struct boot_info, sg_pipes) == 928);
  CHECK(offsetof(struct boot_info, sg_bytes) == 932);
  CHECK(offsetof(struct boot_info, sg_port) == 936);
  CHECK(offsetof(struct boot_info, sg_xf) == 940);
  CHECK(offsetof(struct boot_info, dma_window_gpa) == 944);
  CHECK(offsetof(struct boot_info, dma_window_size) == 952);
  CHECK(sizeof(struct boot_info) == 960);

  struct boot_info bi;
  memset(&bi, 0, sizeof bi);
  strcpy(bi.sandbox_id, "sbx-42");
  uint8_t mac[6] = {2, 0, 0, 0, 0, 2}, peer[6] = {2, 0, 0, 0, 0, 1};
  uint8_t ip[4] = {10, 0, 0, 2}, sip[4] = {10, 0, 0, 1};
  memcpy(&bi.ip, ip, 4);
  memcpy(&bi.server_ip, sip, 4);
  bi.server_port = 7777;
  bi.client_port = 40000;

  /* Request: broadcast while server_mac is zero, then to server_mac. */
  uint8_t f[1600], g[1600];
  uint32_t n = net_build_request(&bi, mac, f, -1);
  CHECK(n == 14 + 20 + 8 + 6);
  CHECK(memcmp(f, "\xff\xff\xff\xff\xff\xff", 6) == 0);
  memcpy(bi.server_mac, peer, 6);
  n = net_build_request(&bi, mac, f, -1);
  CHECK(memcmp(f, peer, 6) == 0 && memcmp(f + 6, mac, 6) == 0 && be16(f + 12) == 0x0800);
  CHECK(be16(f + 16) == 20 + 8 + 6 && f[23] == 17);
  CHECK(memcmp(f + 26, ip, 4) == 0 && memcmp(f + 30, sip, 4) == 0);
  uint32_t s = 0;
  for (int i = 14; i < 34; i += 2) s += be16(f + i);
  while (s >> 16) s = (s & 0xffff) + (s >> 16);
  CHECK(s == 0xffff); /* header checksum verifies */
  CHECK(be16(f + 34) == 40000 && be16(f + 36) == 7777 && be16(f + 38) == 8 + 6);
  CHECK(memcmp(f + 42, "sbx-42", 6) == 0);
  /* Echo mode: the id, then the sequence number, big-endian; lengths follow. */
  n = net_build_request(&bi, mac, f, 0x01020304);
  CHECK(n == 14 + 20 + 8 + 6 + 4 && be16(f + 16) == 20 + 8 + 10 && be16(f + 38) == 8 + 10);
  CHECK(memcmp(f + 42, "sbx-42\x01\x02\x03\x04", 10) == 0);

  /* Ids longer than a word, and the longest (63 bytes): found whole; a
   * header of large words still checksums (carries folded). */
  const char *ids[] = {"bv-12345678-m50p-window-7", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde"};
  for (int k = 0; k < 2; k++) {
    memset(bi.sandbox_id, 0, sizeof bi.sandbox_id);
    strcpy(bi.sandbox_id, ids[k]);
    uint32_t len = (uint32_t)strlen(ids[k]);
    uint8_t big_ip[4] = {255, 255, 254, 253}, big_sip[4] = {254, 255, 255, 255};
    memcpy(&bi.ip, big_ip, 4);
    memcpy(&bi.server_ip, big_sip, 4);
    n = net_build_request(&bi, mac, f, -1);
    CHECK(n == 14 + 20 + 8 + len && memcmp(f + 42, ids[k], len) == 0);
    s = 0;
    for (int i = 14; i < 34; i += 2) s += be16(f + i);
    while (s >> 16) s = (s & 0xffff) + (s >> 16);
    CHECK(s == 0xffff);
  }
  memset(bi.sandbox_id, 0, sizeof bi.sandbox_id);
  strcpy(bi.sandbox_id, "sbx-42");
  memcpy(&bi.ip, ip, 4);
  memcpy(&bi.server_ip, sip, 4);
  n = net_build_request(&bi, mac, f, 0x01020304);

  /* Reply: the request mirrored, with a 5-byte payload. */
  uint32_t plen = 0;
  memcpy(g, mac, 6); memcpy(g + 6, peer, 6); g[12] = 8; g[13] = 0;
  memcpy(g + 14, f + 14, 20);
  memcpy(g + 26, sip, 4); memcpy(g + 30, ip, 4);
  g[16] = 0; g[17] = 20 + 8 + 5;
  g[34] = 7777 >> 8; g[35] = 7777 & 0xff; g[36] = 40000 >> 8; g[37] = 40000 & 0xff;
  g[38] = 0; g[39] = 8 + 5; g[40] = g[41] = 0;
  memcpy(g + 42, "hello", 5);
  CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_REPLY && plen == 5);
  CHECK(net_classify(&bi, mac, g, 40, &plen) == FRAME_OTHER);      /* truncated */
  g[36] = 0; CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_OTHER); /* wrong port */
  g[36] = 40000 >> 8;
  g[33] = 9; CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_OTHER); /* not our IP */
  g[33] = 2;
  g[20] = 0x20; CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_OTHER); /* fragment */
  g[20] = 0;
  g[39] = 200; CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_OTHER); /* UDP length lies */
  g[39] = 8 + 5;
  g[0] = 4; CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_OTHER); /* other MAC */
  g[0] = 2;
  CHECK(net_classify(&bi, mac, g, 47, &plen) == FRAME_REPLY);

  /* ARP: a request for our IP is answered with our MAC; others are ignored. */
  uint8_t a[42] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 2, 0, 0, 0, 0, 1, 8, 6,
                   0, 1, 8, 0, 6, 4, 0, 1, 2, 0, 0, 0, 0, 1, 10, 0, 0, 1,
                   0, 0, 0, 0, 0, 0, 10, 0, 0, 2};
  CHECK(net_classify(&bi, mac, a, 42, &plen) == FRAME_ARP_REQUEST);
  n = net_build_arp_reply(&bi, mac, a, f);
  CHECK(n == 42 && memcmp(f, peer, 6) == 0 && be16(f + 20) == 2);
  CHECK(memcmp(f + 22, mac, 6) == 0 && memcmp(f + 28, ip, 4) == 0);
  CHECK(memcmp(f + 32, peer, 6) == 0 && memcmp(f + 38, sip, 4) == 0);
  a[41] = 3; CHECK(net_classify(&bi, mac, a, 42, &plen) == FRAME_OTHER);
  CHECK(net_classify(&bi, mac, a, 20, &plen) == FRAME_OTHER);

  printf("%d failures\n", failures);
  return failures != 0;
}
