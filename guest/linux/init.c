/* burstvm init for Linux guests (docs/guest.md): /sbin/init of an EROFS root
 * built with `burstvm rootfs build --init`. It speaks the agent port
 * protocol of the built-in agent, so the VMM times and checks a Linux guest
 * the same way:
 *   BOOT → APP_LAUNCH_START → ROOTFS_FILE (checksum of the file named by
 *   burstvm_check=PATH on the kernel command line) → ROOTFS_MARKER (sector 0
 *   of the writable layer /dev/vdb, then the marker is written there) →
 *   APP_LAUNCH_END (checksum 0: no app payload) → READY → [a command after
 *   `--` on the kernel command line: run it, wait] → EXIT (its status:
 *   the code, or 128+N after signal N) → power off.
 * Freestanding: raw system calls, no libc. Containers use the guest agent
 * (agent/) instead; this init is the smallest user space the VMM's Linux
 * tests boot. */
#include <stdint.h>

#include "../src/c/csum.h"

#define SYS_read 0
#define SYS_write 1
#define SYS_open 2
#define SYS_close 3
#define SYS_pread64 17
#define SYS_pwrite64 18
#define SYS_fsync 74
#define SYS_ioperm 173
#define SYS_reboot 169
#define SYS_exit 60
#define SYS_fork 57
#define SYS_execve 59
#define SYS_wait4 61
#define O_RDONLY 0
#define O_RDWR 2

#define PORT_EVENT 0x0f00
#define PORT_DATA 0x0f04
enum { EV_BOOT = 1, EV_APP_LAUNCH_START = 4, EV_APP_LAUNCH_END = 5, EV_READY = 6,
       EV_ERROR = 8, EV_EXIT = 9, EV_ROOTFS_FILE = 0x0a, EV_ROOTFS_MARKER = 0x0b };
#define ERR_EROFS 13
#define ERR_MARKER 14
/* Not an agent error code: the command could not be started (as a shell's 127). */
#define EXIT_NOT_STARTED 127

static long sys(long n, long a, long b, long c, long d) {
  long r;
  register long r10 __asm__("r10") = d;
  __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
  return r;
}

static void outb(uint16_t port, uint8_t v) { __asm__ volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static void outl(uint16_t port, uint32_t v) { __asm__ volatile("outl %0, %1" ::"a"(v), "Nd"(port)); }
static void report(uint8_t ev, uint32_t data) { outl(PORT_DATA, data); outb(PORT_EVENT, ev); }

static void say(const char *s) {
  long n = 0;
  while (s[n]) n++;
  sys(SYS_write, 1, (long)s, n, 0);
}

/* The VM ends with a restart: the VMM boots the kernel with reboot=k, so the
 * kernel resets through the i8042, which ends the VM (docs/design.md). A
 * power-off would only halt: the VMM offers no ACPI. */
__attribute__((noreturn)) static void power_off(void) {
  sys(SYS_reboot, 0xfee1dead, 672274793, 0x01234567, 0); /* LINUX_REBOOT_CMD_RESTART */
  for (;;) sys(SYS_exit, 0, 0, 0, 0);
}

__attribute__((noreturn)) static void fail(uint32_t code) {
  report(EV_ERROR, code);
  power_off();
}

/* burstvm_check=PATH on the kernel command line (no dot: dotted words are
 * module parameters, never passed on) reaches init as environment. */
static const char *check_path(char **envp) {
  for (; *envp; envp++) {
    const char *p = *envp, *k = "burstvm_check=";
    while (*k && *p == *k) p++, k++;
    if (!*k) return p;
  }
  return 0;
}

static uint8_t buf[4096];

static void check_file(const char *path) {
  long fd = sys(SYS_open, (long)path, O_RDONLY, 0, 0);
  if (fd < 0) fail(ERR_EROFS);
  struct csum c = {0};
  long n;
  while ((n = sys(SYS_read, fd, (long)buf, sizeof buf, 0)) > 0) csum_add(&c, buf, (uint64_t)n);
  sys(SYS_close, fd, 0, 0, 0);
  if (n < 0) fail(ERR_EROFS);
  report(EV_ROOTFS_FILE, csum_fold(&c));
}

static void write_marker(void) {
  long fd = sys(SYS_open, (long)"/dev/vdb", O_RDWR, 0, 0);
  if (fd < 0) return; /* no writable layer */
  if (sys(SYS_pread64, fd, (long)buf, 512, 0) != 512) fail(ERR_MARKER);
  struct csum before = {0};
  csum_add(&before, buf, 512);
  static const char magic[] = "BURSTVM-MARKER";
  for (int i = 0; i < 512; i++) buf[i] = i < (int)sizeof magic ? (uint8_t)magic[i] : 0;
  if (sys(SYS_pwrite64, fd, (long)buf, 512, 0) != 512 || sys(SYS_fsync, fd, 0, 0, 0) < 0) fail(ERR_MARKER);
  sys(SYS_close, fd, 0, 0, 0);
  report(EV_ROOTFS_MARKER, csum_fold(&before));
}

static int has_slash(const char *s) {
  for (; *s; s++)
    if (*s == '/') return 1;
  return 0;
}

/* dir + "/" + name into buf (bounded); 0 if it does not fit. */
static char *join(char *buf, long cap, const char *dir, const char *name) {
  long n = 0;
  for (const char *p = dir; *p; p++) if (n < cap - 1) buf[n++] = *p; else return 0;
  if (n < cap - 1) buf[n++] = '/'; else return 0;
  for (const char *p = name; *p; p++) if (n < cap - 1) buf[n++] = *p; else return 0;
  buf[n] = 0;
  return buf;
}

#define MAX_ENV 64
static char *child_env[MAX_ENV + 2];
static char path_buf[512];

/* Runs argv (the words after `--` on the kernel command line) with init's
 * environment plus PATH, as a shell would find it; returns its wait status
 * as an exit status (code, or 128+signal). */
static uint32_t run_command(char **argv, char **envp) {
  static const char *dirs[] = {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"};
  int n = 0;
  child_env[n++] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
  for (; *envp && n < MAX_ENV + 1; envp++) child_env[n++] = *envp;
  child_env[n] = 0;
  long pid = sys(SYS_fork, 0, 0, 0, 0);
  if (pid == 0) {
    if (has_slash(argv[0])) {
      sys(SYS_execve, (long)argv[0], (long)argv, (long)child_env, 0);
    } else {
      for (unsigned i = 0; i < sizeof dirs / sizeof dirs[0]; i++)
        if (join(path_buf, sizeof path_buf, dirs[i], argv[0]))
          sys(SYS_execve, (long)path_buf, (long)argv, (long)child_env, 0);
    }
    say("burstvm init: cannot execute the command\n");
    sys(SYS_exit, EXIT_NOT_STARTED, 0, 0, 0);
  }
  if (pid < 0) return EXIT_NOT_STARTED;
  int status = 0;
  /* PID 1 reaps every orphan; the command's own status is the one kept. */
  for (;;) {
    long r = sys(SYS_wait4, -1, (long)&status, 0, 0);
    if (r == pid) break;
    if (r < 0) return EXIT_NOT_STARTED;
  }
  if ((status & 0x7f) == 0) return (status >> 8) & 0xff; /* exited */
  return 128 + (status & 0x7f);                        /* killed by a signal */
}

__attribute__((used)) void init_main(long *sp) {
  long argc = sp[0];
  char **argv = (char **)(sp + 1);
  char **envp = (char **)(sp + 1 + argc + 1);
  say("burstvm init\n");
  if (sys(SYS_ioperm, PORT_EVENT, 8, 1, 0) < 0) power_off(); /* not under burstvm */
  report(EV_BOOT, 0);
  report(EV_APP_LAUNCH_START, 0);
  const char *path = check_path(envp);
  if (path) check_file(path);
  write_marker();
  report(EV_APP_LAUNCH_END, 0);
  report(EV_READY, 0);
  if (argc > 1) report(EV_EXIT, run_command(argv + 1, envp));
  power_off();
}

__asm__(".globl _start\n_start:\n  mov %rsp, %rdi\n  and $-16, %rsp\n  call init_main\n  hlt\n");
