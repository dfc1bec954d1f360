/* What Linux user space needs, checked from inside a burstvm guest
 * (docs/guest.md, "User space under kvm_pvm"). A static program (glibc,
 * `cc -static -O2`); the Linux boot tests put it into an EROFS image and
 * run it as the command of burstvm's init.
 *
 *   selftest check [DYN]   fork, execve (static, and the dynamic build DYN
 *                          if given), pipes between two processes, wait4,
 *                          SIGCHLD and SIGUSR1 handlers (rt_sigreturn) with
 *                          FPU state kept across them, a SIGKILLed child,
 *                          interval timer, nanosleep, clock_gettime (vDSO),
 *                          page faults, threads (clone + futex); prints
 *                          "selftest: ok" and exits 0, else names the step
 *                          and exits 1.
 *   selftest bench         costs: one getpid, one fork+execve+wait of this
 *                          static binary, a user-space compute loop.
 *   selftest compute       the compute loop alone (to time it on the host).
 *   selftest exit N        exits with N (the execve target).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *self_path;

static void fail(const char *what) {
  printf("selftest: FAIL %s (errno %d)\n", what, errno);
  fflush(stdout);
  exit(1);
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* The loop timed against the host: integer and floating point, no memory. */
static double compute(uint64_t iters) {
  uint64_t x = 88172645463325252ull;
  double acc = 0;
  for (uint64_t i = 0; i < iters; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    acc += (double)(x & 0xffff) * 0.5;
  }
  return acc;
}
#define COMPUTE_ITERS 200000000ull

static int wait_status(pid_t pid) {
  int st;
  if (waitpid(pid, &st, 0) != pid) fail("waitpid");
  return st;
}

static volatile sig_atomic_t chld_seen, usr1_seen, alrm_seen;
static volatile double handler_fpu;

static void on_chld(int sig) { (void)sig; chld_seen++; }
static void on_usr1(int sig) {
  (void)sig;
  /* FPU work in the handler: the interrupted code's FPU state must survive. */
  handler_fpu = 1.0;
  for (int i = 0; i < 100; i++) handler_fpu = handler_fpu * 1.0001 + 0.25;
  usr1_seen = 1;
}
static void on_alrm(int sig) { (void)sig; alrm_seen++; }

static void handle(int sig, void (*fn)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = fn;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  if (sigaction(sig, &sa, 0) < 0) fail("sigaction");
}

/* Two processes and a pipe: the child writes a pattern, the parent checks it. */
static void check_pipe(void) {
  int fd[2];
  if (pipe(fd) < 0) fail("pipe");
  enum { LEN = 256 * 1024 };
  pid_t pid = fork();
  if (pid < 0) fail("fork");
  if (pid == 0) {
    close(fd[0]);
    static unsigned char buf[LEN];
    for (int i = 0; i < LEN; i++) buf[i] = (unsigned char)(i * 7 + 3);
    for (int off = 0; off < LEN;) {
      ssize_t n = write(fd[1], buf + off, LEN - off);
      if (n <= 0) _exit(2);
      off += (int)n;
    }
    _exit(0);
  }
  close(fd[1]);
  static unsigned char got[LEN];
  int off = 0;
  for (;;) {
    ssize_t n = read(fd[0], got + off, LEN - off);
    if (n < 0) fail("pipe read");
    if (n == 0) break;
    off += (int)n;
    if (off == LEN) {
      char extra;
      if (read(fd[0], &extra, 1) != 0) fail("pipe: bytes past the end");
      break;
    }
  }
  close(fd[0]);
  if (off != LEN) fail("pipe: short");
  for (int i = 0; i < LEN; i++)
    if (got[i] != (unsigned char)(i * 7 + 3)) fail("pipe: wrong byte");
  int st = wait_status(pid);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) fail("pipe writer status");
}

static void check_exec(const char *path, int code) {
  pid_t pid = fork();
  if (pid < 0) fail("fork");
  if (pid == 0) {
    char n[8];
    snprintf(n, sizeof n, "%d", code);
    execl(path, path, "exit", n, (char *)0);
    _exit(126);
  }
  int st = wait_status(pid);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != code) {
    printf("selftest: %s gave status %#x\n", path, st);
    fail("execve");
  }
}

static void check_kill(void) {
  pid_t pid = fork();
  if (pid < 0) fail("fork");
  if (pid == 0) {
    for (;;) pause();
  }
  if (kill(pid, SIGKILL) < 0) fail("kill");
  int st = wait_status(pid);
  if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGKILL) fail("SIGKILL status");
}

static void check_signals(void) {
  volatile double mine = 3.0;
  for (int i = 0; i < 10; i++) mine = mine * 1.5 - 0.25;
  double before = mine;
  if (raise(SIGUSR1) < 0) fail("raise");
  if (!usr1_seen) fail("SIGUSR1 handler");
  if (mine != before || handler_fpu < 1.0) fail("FPU state across a signal");
}

static void check_timers(void) {
  uint64_t t0 = now_ns();
  struct timespec d = {0, 20 * 1000 * 1000};
  if (nanosleep(&d, 0) < 0) fail("nanosleep");
  uint64_t slept = now_ns() - t0;
  if (slept < 20 * 1000 * 1000) fail("nanosleep: too short");
  struct itimerval it = {{0, 0}, {0, 10 * 1000}};
  if (setitimer(ITIMER_REAL, &it, 0) < 0) fail("setitimer");
  sigset_t none;
  sigemptyset(&none);
  for (int i = 0; i < 100 && !alrm_seen; i++) sigsuspend(&none);
  if (!alrm_seen) fail("SIGALRM");
  struct timespec rt;
  if (clock_gettime(CLOCK_REALTIME, &rt) < 0) fail("clock_gettime");
}

static void check_memory(void) {
  size_t len = 16 << 20;
  unsigned char *p = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("mmap");
  for (size_t i = 0; i < len; i += 4096) {
    if (p[i] != 0) fail("fresh page not zero");
    p[i] = (unsigned char)(i >> 12);
  }
  for (size_t i = 0; i < len; i += 4096)
    if (p[i] != (unsigned char)(i >> 12)) fail("page contents");
  munmap(p, len);
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long counter;
static void *worker(void *arg) {
  (void)arg;
  for (int i = 0; i < 20000; i++) {
    pthread_mutex_lock(&mu);
    counter++;
    pthread_mutex_unlock(&mu);
  }
  return 0;
}

static void check_threads(void) {
  pthread_t t[2];
  for (int i = 0; i < 2; i++)
    if (pthread_create(&t[i], 0, worker, 0) != 0) fail("pthread_create");
  for (int i = 0; i < 2; i++) pthread_join(t[i], 0);
  if (counter != 40000) fail("threads: lost updates");
}

static int check(const char *dyn) {
  handle(SIGCHLD, on_chld);
  handle(SIGUSR1, on_usr1);
  handle(SIGALRM, on_alrm);
  check_pipe();
  check_exec(self_path, 7);
  if (dyn) check_exec(dyn, 5);
  check_kill();
  if (!chld_seen) fail("SIGCHLD handler");
  check_signals();
  check_timers();
  check_memory();
  check_threads();
  printf("selftest: ok (pid %d, SIGCHLD seen %d times)\n", (int)getpid(), (int)chld_seen);
  return 0;
}

static int bench(void) {
  enum { GETPIDS = 2000, EXECS = 20 };
  uint64_t t0 = now_ns();
  for (int i = 0; i < GETPIDS; i++) syscall(SYS_getpid); /* no glibc cache */
  uint64_t t1 = now_ns();
  for (int i = 0; i < EXECS; i++) check_exec(self_path, 0);
  uint64_t t2 = now_ns();
  volatile double r = compute(COMPUTE_ITERS);
  (void)r;
  uint64_t t3 = now_ns();
  printf("bench: getpid_ns=%llu fork_exec_wait_us=%llu compute_ms=%llu\n",
         (unsigned long long)((t1 - t0) / GETPIDS), (unsigned long long)((t2 - t1) / EXECS / 1000),
         (unsigned long long)((t3 - t2) / 1000000));
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, 0, _IONBF, 0);
  self_path = argv[0];
  if (argc >= 3 && !strcmp(argv[1], "exit")) return atoi(argv[2]);
  if (argc >= 2 && !strcmp(argv[1], "check")) return check(argc >= 3 ? argv[2] : 0);
  if (argc >= 2 && !strcmp(argv[1], "bench")) return bench();
  if (argc >= 2 && !strcmp(argv[1], "compute")) {
    uint64_t t0 = now_ns();
    volatile double r = compute(COMPUTE_ITERS);
    (void)r;
    printf("compute_ms=%llu\n", (unsigned long long)((now_ns() - t0) / 1000000));
    return 0;
  }
  fprintf(stderr, "usage: selftest check [DYN] | bench | compute | exit N\n");
  return 2;
}
