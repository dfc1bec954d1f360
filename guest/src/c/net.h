/* Ethernet / ARP / IPv4 / UDP frames: just what the agent's request needs. */
#ifndef NET_H
#define NET_H
#include <stdint.h>
#include "bootinfo.h"

#define ETH_HLEN 14
#define IP_HLEN 20
#define UDP_HLEN 8
#define ARP_LEN 28

/* Build the UDP request (payload: the sandbox id, then `seq` as 4 big-endian bytes unless
 * it is negative) into `frame`; returns its length. */
uint32_t net_build_request(const struct boot_info *bi, const uint8_t mac[6], uint8_t *frame,
                           int64_t seq);

enum frame_kind { FRAME_OTHER, FRAME_ARP_REQUEST, FRAME_REPLY };

/* Classify a received frame. FRAME_REPLY: a UDP datagram from
 * server_ip:server_port to our ip:client_port; *payload_len is set. */
enum frame_kind net_classify(const struct boot_info *bi, const uint8_t mac[6], const uint8_t *f,
                             uint32_t len, uint32_t *payload_len);

/* Build the ARP reply to request `req` into `frame`; returns its length. */
uint32_t net_build_arp_reply(const struct boot_info *bi, const uint8_t mac[6], const uint8_t *req,
                             uint8_t *frame);

#endif
