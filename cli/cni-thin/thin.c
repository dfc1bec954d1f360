/*
 * burstvm-cni-thin: a CNI plugin executable that runs burstvm-cni's command
 * in burstvm's CNI server (the NIC daemon's `--cni-socket`, cni::server)
 * instead of in its own process, and prints what the server sends back.
 *
 * Freestanding, without libc: a static glibc executable spends ~0.25 ms
 * of CPU here before main (43 trapped CPUIDs in its CPU-feature set-up at
 * 3.55 us each, its relocations and first faults), and a burst of starts
 * pays it per attachment. This one makes a dozen system calls, and calls
 * no function it does not define (cli/build.rs checks that the object needs
 * no symbol from elsewhere: the libc linked beside it for std's sake is
 * never entered, its set-up never having run).
 *
 * The server is the config's top-level "cniSocket". When there is none,
 * or the server cannot be reached or goes away before it says it has the
 * request, nothing was done: the config goes back on stdin (a memfd) and
 * burstvm-cni from CNI_PATH runs in this process's place, with the same
 * environment. Once the server has the request, its going away is the
 * TRY_AGAIN_LATER error result it sent ahead. Wire format: cni::server.
 */

#include <stddef.h>
#include <stdint.h>

#define SYS_read 0
#define SYS_write 1
#define SYS_close 3
#define SYS_lseek 8
#define SYS_dup2 33
#define SYS_socket 41
#define SYS_connect 42
#define SYS_setsockopt 54
#define SYS_execve 59
#define SYS_exit_group 231
#define SYS_newfstatat 262
#define SYS_memfd_create 319

#define EINTR 4
#define AF_UNIX 1
#define SOCK_STREAM 1
#define SOCK_CLOEXEC 0x80000
#define SOL_SOCKET 1
#define SO_RCVTIMEO 20
#define SO_SNDTIMEO 21
#define AT_FDCWD -100

/* cni::MAX_STDIN and cni::server::MAX_ENV (cli/tests/cni_thin.rs keeps them
 * equal). */
#define MAX_STDIN (1 << 20)
#define MAX_ENV (64 << 10)
/* A reply's stdout: the result, which carries a prevResult of up to MAX_STDIN. */
#define MAX_OUT (2 << 20)
#define MAX_LOST (64 << 10)
/* Seconds the server may take to answer (a burst queues ADDs behind the
 * kernel's rtnl lock and the NIC daemon): then it is a lost server. */
#define REPLY_TIMEOUT_S 120

#define PLUGIN "burstvm-cni"

static char config[MAX_STDIN + 1];
static char vars[MAX_ENV];
static char out[MAX_OUT];
static char lost[MAX_LOST];

static long sys6(long n, long a, long b, long c, long d, long e, long f)
{
	long ret;
	register long r10 __asm__("r10") = d;
	register long r8 __asm__("r8") = e;
	register long r9 __asm__("r9") = f;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
			 : "rcx", "r11", "memory");
	return ret;
}

static long sys3(long n, long a, long b, long c)
{
	return sys6(n, a, b, c, 0, 0, 0);
}

static void copy(char *d, const char *s, size_t n)
{
	__asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
}

static size_t len(const char *s)
{
	size_t n = 0;
	while (s[n])
		n++;
	return n;
}

static int starts(const char *s, const char *prefix)
{
	while (*prefix)
		if (*s++ != *prefix++)
			return 0;
	return 1;
}

__attribute__((noreturn)) static void leave(int status)
{
	for (;;)
		sys3(SYS_exit_group, status, 0, 0);
}

/* All `n` bytes of `p` through `nr` (SYS_read or SYS_write); -1 on an
 * error or an end before them. */
static int transfer(long nr, int fd, char *p, size_t n)
{
	while (n > 0) {
		long r = sys3(nr, fd, (long)p, (long)n);
		if (r == -EINTR)
			continue;
		if (r <= 0)
			return -1;
		p += r;
		n -= (size_t)r;
	}
	return 0;
}

static int write_all(int fd, const char *p, size_t n)
{
	return transfer(SYS_write, fd, (char *)p, n);
}

static int read_all(int fd, char *p, size_t n)
{
	return transfer(SYS_read, fd, p, n);
}

/* Up to `cap` bytes of `fd` until its end; -1 on an error. */
static long read_to_end(int fd, char *p, size_t cap)
{
	size_t n = 0;
	while (n < cap) {
		long r = sys3(SYS_read, fd, (long)(p + n), (long)(cap - n));
		if (r == -EINTR)
			continue;
		if (r < 0)
			return -1;
		if (r == 0)
			break;
		n += (size_t)r;
	}
	return (long)n;
}

static void say(const char *msg)
{
	write_all(2, "burstvm-cni-thin: ", 18);
	write_all(2, msg, len(msg));
	write_all(2, "\n", 1);
}

/* --- The config's top-level string members (JSON, RFC 8259) ---------- */

static const char *ws(const char *p, const char *end)
{
	while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
		p++;
	return p;
}

/* Past the string that starts at p (at its '"'); NULL if it does not end. */
static const char *skip_string(const char *p, const char *end)
{
	for (p++; p < end; p++) {
		if (*p == '\\')
			p++;
		else if (*p == '"')
			return p + 1;
	}
	return NULL;
}

/* Past the value at p; NULL if it does not end inside the buffer. */
static const char *skip_value(const char *p, const char *end)
{
	int depth = 0;
	while (p < end) {
		char c = *p;
		if (c == '"') {
			p = skip_string(p, end);
			if (!p)
				return NULL;
			if (depth == 0)
				return p;
			continue;
		}
		if (c == '{' || c == '[') {
			depth++;
		} else if (c == '}' || c == ']') {
			if (depth == 0)
				return p;
			if (--depth == 0)
				return p + 1;
		} else if (depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r')) {
			return p;
		}
		p++;
	}
	return depth == 0 ? p : NULL;
}

/*
 * The value of the top-level member `key` when it is a string without
 * escapes (a path or a version; anything else is not ours to decode): its
 * start and length. 0 if the config has no such member or is not an object.
 */
static int member(const char *p, const char *end, const char *key, const char **val, size_t *n)
{
	size_t klen = len(key);
	p = ws(p, end);
	if (p == end || *p != '{')
		return 0;
	p = ws(p + 1, end);
	while (p < end && *p == '"') {
		const char *k = p + 1, *kend = skip_string(p, end);
		if (!kend)
			return 0;
		int match = (size_t)(kend - 1 - k) == klen && starts(k, key);
		p = ws(kend, end);
		if (p == end || *p != ':')
			return 0;
		p = ws(p + 1, end);
		if (match) {
			if (p == end || *p != '"')
				return 0;
			const char *v = p + 1, *vend = skip_string(p, end);
			if (!vend)
				return 0;
			for (const char *q = v; q < vend - 1; q++)
				if (*q == '\\')
					return 0;
			*val = v;
			*n = (size_t)(vend - 1 - v);
			return 1;
		}
		p = skip_value(p, end);
		if (!p)
			return 0;
		p = ws(p, end);
		if (p < end && *p == ',')
			p = ws(p + 1, end);
	}
	return 0;
}

/* --- Running burstvm-cni itself ----------------------------------------- */

/* Device and inode of `path` (struct stat's first two fields on x86-64);
 * 0 if it cannot be read. */
static int file_id(const char *path, uint64_t id[2])
{
	uint64_t st[18]; /* struct stat: 144 bytes */
	if (sys6(SYS_newfstatat, AT_FDCWD, (long)path, (long)st, 0, 0, 0) != 0)
		return 0;
	id[0] = st[0];
	id[1] = st[1];
	return 1;
}

/* Execs burstvm-cni from CNI_PATH with the config on stdin; returns only
 * if there is none to exec, after saying so. A burstvm-cni that is this
 * very executable (the forwarder installed under the plugin's name) is
 * skipped: it would exec itself for ever. */
static void run_plugin(char **envp, const char *cfg, size_t n)
{
	uint64_t self[2] = {0, 0}, other[2] = {0, 0};
	int know_self = file_id("/proc/self/exe", self);
	long fd = sys3(SYS_memfd_create, (long)"cni-config", 0, 0);
	if (fd < 0 || write_all((int)fd, cfg, n) < 0 || sys3(SYS_lseek, fd, 0, 0) != 0 ||
	    sys3(SYS_dup2, fd, 0, 0) != 0) {
		say("cannot put the config back on stdin for " PLUGIN);
		return;
	}
	sys3(SYS_close, fd, 0, 0);
	const char *path = NULL;
	for (char **e = envp; *e; e++)
		if (starts(*e, "CNI_PATH="))
			path = *e + 9;
	static char exe[4096];
	char *argv[] = {exe, NULL};
	while (path && *path) {
		size_t d = 0;
		while (path[d] && path[d] != ':')
			d++;
		if (d > 0 && d + 1 + sizeof(PLUGIN) <= sizeof(exe)) {
			copy(exe, path, d);
			exe[d] = '/';
			copy(exe + d + 1, PLUGIN, sizeof(PLUGIN));
			if (!know_self || !file_id(exe, other) || other[0] != self[0] ||
			    other[1] != self[1])
				sys3(SYS_execve, (long)exe, (long)argv, (long)envp);
		}
		path += d + (path[d] == ':');
	}
	say("no CNI server took the call and " PLUGIN " is not in CNI_PATH");
}

/* An error result in the config's version, for a call nothing can serve. */
__attribute__((noreturn)) static void fail(const char *cfg, size_t n, const char *msg)
{
	const char *v = "1.1.0";
	size_t vn = 5;
	member(cfg, cfg + n, "cniVersion", &v, &vn);
	write_all(1, "{\"cniVersion\":\"", 15);
	write_all(1, v, vn);
	write_all(1, "\",\"code\":11,\"msg\":\"", 19);
	write_all(1, msg, len(msg));
	write_all(1, "\"}\n", 3);
	leave(1);
}

/* --- Asking the server -------------------------------------------------- */

static int put_len(int fd, size_t n)
{
	uint32_t v = (uint32_t)n;
	return write_all(fd, (const char *)&v, 4);
}

static long get_len(int fd, size_t max)
{
	uint32_t v;
	if (read_all(fd, (char *)&v, 4) < 0 || v > max)
		return -1;
	return (long)v;
}

/* The server's socket, connected; -1 if it cannot be. */
static int dial(const char *path, size_t n)
{
	struct {
		uint16_t family;
		char path[108];
	} addr;
	if (n == 0 || n >= sizeof(addr.path))
		return -1;
	addr.family = AF_UNIX;
	copy(addr.path, path, n);
	addr.path[n] = 0;
	long fd = sys3(SYS_socket, AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	struct {
		long sec, usec;
	} tv = {REPLY_TIMEOUT_S, 0};
	sys6(SYS_setsockopt, fd, SOL_SOCKET, SO_RCVTIMEO, (long)&tv, sizeof(tv), 0);
	sys6(SYS_setsockopt, fd, SOL_SOCKET, SO_SNDTIMEO, (long)&tv, sizeof(tv), 0);
	if (sys3(SYS_connect, fd, (long)&addr, (long)(2 + n + 1)) < 0) {
		sys3(SYS_close, fd, 0, 0);
		return -1;
	}
	return (int)fd;
}

__attribute__((used)) void thin_main(long *sp)
{
	long argc = sp[0];
	char **envp = (char **)(sp + 1 + argc + 1);

	long n = read_to_end(0, config, sizeof(config));
	if (n < 0)
		fail("", 0, "cannot read the network config from stdin");
	size_t nv = 0;
	int vars_fit = 1;
	for (char **e = envp; *e; e++) {
		if (!starts(*e, "CNI_"))
			continue;
		size_t l = len(*e) + 1;
		if (nv + l > sizeof(vars)) {
			vars_fit = 0;
			break;
		}
		copy(vars + nv, *e, l);
		nv += l;
	}
	const char *sock;
	size_t sn;
	int fd = -1;
	if (vars_fit && member(config, config + n, "cniSocket", &sock, &sn))
		fd = dial(sock, sn);
	if (fd >= 0 && (write_all(fd, "BVC1", 4) < 0 || put_len(fd, nv) < 0 ||
			write_all(fd, vars, nv) < 0 || put_len(fd, (size_t)n) < 0 ||
			write_all(fd, config, (size_t)n) < 0))
		fd = -1;
	long ln = fd >= 0 ? get_len(fd, sizeof(lost)) : -1;
	if (ln < 0 || read_all(fd, lost, (size_t)ln) < 0) {
		/* The server never had the call: nothing was done. */
		run_plugin(envp, config, (size_t)n);
		fail(config, (size_t)n, "no burstvm CNI server and no burstvm-cni in CNI_PATH");
	}
	int32_t status;
	long no;
	if (read_all(fd, (char *)&status, 4) < 0 || (no = get_len(fd, sizeof(out))) < 0 ||
	    read_all(fd, out, (size_t)no) < 0) {
		write_all(1, lost, (size_t)ln);
		leave(1);
	}
	write_all(1, out, (size_t)no);
	/* stderr is for people: what arrives of it is passed on. */
	long ne = get_len(fd, UINT32_MAX);
	while (ne > 0) {
		size_t chunk = ne < (long)sizeof(lost) ? (size_t)ne : sizeof(lost);
		if (read_all(fd, lost, chunk) < 0)
			break;
		write_all(2, lost, chunk);
		ne -= (long)chunk;
	}
	leave(status);
}

__asm__(".globl _start\n"
	"_start:\n"
	"	xor %ebp, %ebp\n"
	"	mov %rsp, %rdi\n"
	"	and $-16, %rsp\n"
	"	call thin_main\n"
	"	ud2\n");
