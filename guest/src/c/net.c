/* Frame building and parsing. Multi-byte header fields are big-endian on the
 * wire; boot_info addresses are already in network byte order, ports are in
 * host order (docs/guest.md). */
#include "agent.h"
#include "net.h"

static void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = (uint8_t)v; }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
/* Compares of 4 and 6 bytes (addresses) in two loads each: CPL0 code is
 * emulated per instruction on kvm_pvm, and a byte loop is five per byte. */
static uint32_t ld32(const void *p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }
static uint16_t ld16(const void *p) { uint16_t v; __builtin_memcpy(&v, p, 2); return v; }
static int eq4(const void *a, const void *b) { return ld32(a) == ld32(b); }
static int eq6(const void *a, const void *b) {
  return ld32(a) == ld32(b) && ld16((const uint8_t *)a + 4) == ld16((const uint8_t *)b + 4);
}

/* Length of a NUL-terminated id in a buffer of `max` bytes, 8 bytes a step. */
static uint32_t id_len(const char *s, uint32_t max) {
  uint32_t n = 0;
  for (; n + 8 <= max; n += 8) {
    uint64_t w;
    __builtin_memcpy(&w, s + n, 8);
    if ((w - 0x0101010101010101ULL) & ~w & 0x8080808080808080ULL) break; /* a zero byte */
  }
  while (n < max && s[n]) n++;
  return n;
}

static uint32_t put_eth(uint8_t *f, const uint8_t *dst, const uint8_t *src, uint16_t type) {
  memcpy(f, dst, 6);
  memcpy(f + 6, src, 6);
  put16(f + 12, type);
  return ETH_HLEN;
}

/* RFC 1071 over the 20-byte header, five 32-bit words at once (the sum of
 * big-endian 16-bit words equals the folded sum of the 32-bit ones). */
static uint16_t ip_checksum(const uint8_t *h) {
  uint64_t s = 0;
  for (int i = 0; i < IP_HLEN; i += 4) s += __builtin_bswap32(ld32(h + i));
  s = (s & 0xffffffff) + (s >> 32);
  s = (s & 0xffff) + (s >> 16);
  s = (s & 0xffff) + (s >> 16);
  s = (s & 0xffff) + (s >> 16);
  return (uint16_t)~s;
}

uint32_t net_build_request(const struct boot_info *bi, const uint8_t mac[6], uint8_t *f,
                           int64_t seq) {
  static const uint8_t zero[6], bcast[6] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  uint32_t id = id_len(bi->sandbox_id, sizeof bi->sandbox_id - 1);
  uint32_t n = id + (seq >= 0 ? 4 : 0);

  put_eth(f, eq6(bi->server_mac, zero) ? bcast : bi->server_mac, mac, 0x0800);
  uint8_t *ip = f + ETH_HLEN, *udp = ip + IP_HLEN;
  memset(ip, 0, IP_HLEN);
  ip[0] = 0x45;                            /* IPv4, 20-byte header */
  put16(ip + 2, IP_HLEN + UDP_HLEN + n);   /* total length */
  put16(ip + 6, 0x4000);                   /* don't fragment */
  ip[8] = 64;                              /* TTL */
  ip[9] = 17;                              /* UDP */
  memcpy(ip + 12, &bi->ip, 4);
  memcpy(ip + 16, &bi->server_ip, 4);
  put16(ip + 10, ip_checksum(ip));
  put16(udp, bi->client_port);
  put16(udp + 2, bi->server_port);
  put16(udp + 4, UDP_HLEN + n);
  put16(udp + 6, 0);                       /* no UDP checksum (allowed on IPv4) */
  memcpy(udp + UDP_HLEN, bi->sandbox_id, id);
  if (seq >= 0) {
    put16(udp + UDP_HLEN + id, (uint16_t)((uint64_t)seq >> 16));
    put16(udp + UDP_HLEN + id + 2, (uint16_t)seq);
  }
  return ETH_HLEN + IP_HLEN + UDP_HLEN + n;
}

enum frame_kind net_classify(const struct boot_info *bi, const uint8_t mac[6], const uint8_t *f,
                             uint32_t len, uint32_t *payload_len) {
  if (len < ETH_HLEN) return FRAME_OTHER;
  uint16_t type = get16(f + 12);
  const uint8_t *p = f + ETH_HLEN;
  len -= ETH_HLEN;

  if (type == 0x0806) { /* ARP request (Ethernet/IPv4) for our address */
    if (len < ARP_LEN || get16(p) != 1 || get16(p + 2) != 0x0800 || p[4] != 6 || p[5] != 4 ||
        get16(p + 6) != 1 || !eq4(p + 24, &bi->ip))
      return FRAME_OTHER;
    return FRAME_ARP_REQUEST;
  }
  if (type != 0x0800 || len < IP_HLEN + UDP_HLEN || (p[0] >> 4) != 4) return FRAME_OTHER;
  uint32_t ihl = (p[0] & 0xf) * 4u, total = get16(p + 2);
  if (ihl < IP_HLEN || total > len || total < ihl + UDP_HLEN || p[9] != 17) return FRAME_OTHER;
  if (get16(p + 6) & 0x3fff) return FRAME_OTHER; /* a fragment */
  if (!eq4(p + 12, &bi->server_ip) || !eq4(p + 16, &bi->ip)) return FRAME_OTHER;
  if (!eq6(f, mac) && f[0] != 0xff) return FRAME_OTHER;
  const uint8_t *udp = p + ihl;
  uint32_t ulen = get16(udp + 4);
  if (get16(udp) != bi->server_port || get16(udp + 2) != bi->client_port || ulen < UDP_HLEN ||
      ulen > total - ihl)
    return FRAME_OTHER;
  *payload_len = ulen - UDP_HLEN;
  return FRAME_REPLY;
}

uint32_t net_build_arp_reply(const struct boot_info *bi, const uint8_t mac[6], const uint8_t *req,
                             uint8_t *f) {
  const uint8_t *r = req + ETH_HLEN;
  put_eth(f, r + 8, mac, 0x0806);
  uint8_t *a = f + ETH_HLEN;
  put16(a, 1);          /* Ethernet */
  put16(a + 2, 0x0800); /* IPv4 */
  a[4] = 6;
  a[5] = 4;
  put16(a + 6, 2);      /* reply */
  memcpy(a + 8, mac, 6);
  memcpy(a + 14, &bi->ip, 4);
  memcpy(a + 18, r + 8, 10); /* requester's MAC and IP */
  return ETH_HLEN + ARP_LEN;
}
